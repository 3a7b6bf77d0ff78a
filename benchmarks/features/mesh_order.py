"""Benchmark: ``parallel.order`` across two emulated hosts joined by a rate-limited link.

Two emulated hosts (examples/emulated_hosts.py; root) x 2 ranks, dp 2 x pp 2, the link between
the hosts limited by a token bucket (``tbf``, ``--rate-mbit``).  Two models where the better
order differs:

- ``gradients``: wide layers, short sequences, 2 micro-batches: the dp all-reduce of each
  stage's gradients carries far more bytes than a pipeline boundary, so pp outermost
  (``[pp,dp,tp]``: each dp group inside a host) should win;
- ``activations``: narrow layers, long sequences, 8 micro-batches: the boundaries carry more,
  so ``[dp,pp,tp]`` (each pipeline inside a host) should win.

Each model runs with both orders in alternating rounds (medians of the rounds' median step),
and once with ``parallel.order=auto`` (its pick, and the pick's measured step against the
faster order's).  For every run the start-of-run prediction (``predicted step``: the program
rehearsed at start, as every run of 25 steps or more on shared cores does, each boundary on its
measured link, plus the measured tail) is set against the measured median step.

    python benchmarks/features/mesh_order.py --rounds 3 --rate-mbit 200
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hosts import launch_on_hosts, outputs  # noqa: E402
from examples.emulated_hosts import EmulatedHosts, unavailable  # noqa: E402

COMMON = ["train.param_dtype=float32", "train.eval_every=0", "train.eval_batches=1", "metrics.tensorboard=false",
          "pipeline.profile=true", "parallel.dp=2", "parallel.pp=2", "data.num_tokens=200000",
          "comm.timeout_s=60", "comm.first_step_timeout_s=120", "comm.join_timeout_s=120"]
MODELS = {
    "gradients": ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.seq_len=8", "model.block_size=8",
                  "data.batch_size=8", "pipeline.num_microbatches=2"],
    "activations": ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "data.seq_len=256", "model.block_size=256",
                    "data.batch_size=32", "pipeline.num_microbatches=8"],
}
ORDERS = ("[dp,pp,tp]", "[pp,dp,tp]")


def run(model: str, order: str, steps: int, rate_mbit: float) -> dict:
    """One job on two fresh emulated hosts: its order, median step and predicted step (ms)."""
    with EmulatedHosts(2, rate_mbit=rate_mbit) as hosts:
        run_dir = tempfile.mkdtemp(prefix="pf-order-")
        texts = outputs(launch_on_hosts(hosts, [*COMMON, *MODELS[model], f"parallel.order={order}",
                                                f"train.max_steps={steps}", f"train.log_every={steps}",
                                                f"train.run_dir={run_dir}"], timeout_s=600, rdzv_conf=None), timeout_s=660)
    text = texts[0]
    median = re.search(r"INFO median step ([\d.]+) ms \|", text)  # the summary line, not post_recvs's
    predicted = re.search(r"predicted step ([\d.]+) ms", text)
    chosen = re.search(r"mesh order (\[\w+,\w+,\w+\])", text)
    measured = [float(s) for s in re.findall(r"measured in ([\d.]+) s", text)]  # the links (and auto's host links)
    if median is None or predicted is None or chosen is None:
        raise SystemExit(f"{model} {order}: no figures in the output:\n{text[-4000:]}")
    return {"order": chosen.group(1), "step": float(median.group(1)), "predicted": float(predicted.group(1)),
            "measuring_s": sum(measured)}


def main() -> None:
    """Measure both orders of both models, then auto's pick; print one line per case."""
    parser = argparse.ArgumentParser(prog="python benchmarks/features/mesh_order.py", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    # 25 steps or more: the run rehearses its program at start, as any run on shared cores does
    # (4 ranks on this machine's 2 cores; pipeflow/planning/rehearsal.py), and predicts from that
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate-mbit", type=int, default=200)
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"emulated hosts unavailable: {reason}")
    print(f"2 emulated hosts x 2 ranks, dp 2 x pp 2, link between hosts {args.rate_mbit:g} Mbit/s (tbf); "
          f"{args.steps} steps per run, {args.rounds} alternating rounds")
    for model in MODELS:
        runs: dict[str, list[dict]] = {order: [] for order in ORDERS}
        for _ in range(args.rounds):
            for order in ORDERS:
                runs[order].append(run(model, order, args.steps, args.rate_mbit))
        medians = {o: statistics.median(r["step"] for r in rs) for o, rs in runs.items()}
        for order, rs in runs.items():
            predicted = statistics.median(r["predicted"] for r in rs)
            rounds = ", ".join(f"{r['step']:.1f}" for r in rs)
            measuring = max(r["measuring_s"] for r in rs)
            print(f"{model:12s} order {order}: step {medians[order]:.1f} ms (rounds {rounds}), "
                  f"predicted at start {predicted:.1f} ms, "
                  f"predicted/measured {predicted / medians[order]:.2f}, links measured in {measuring:.2f} s at most")
        faster = min(medians, key=medians.get)
        auto = run(model, "auto", args.steps, args.rate_mbit)
        picked = medians.get(auto["order"], auto["step"])  # the picked order's median over the rounds
        print(f"{model:12s} auto picked {auto['order']} (faster measured: {faster}): its median step "
              f"{picked / medians[faster]:.2f}x the faster order's; auto's own run {auto['step']:.1f} ms, "
              f"predicted {auto['predicted']:.1f} ms, measuring the links took {auto['measuring_s']:.2f} s")


if __name__ == "__main__":
    main()
