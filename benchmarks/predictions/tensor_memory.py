"""Predicted against measured tensor memory per rank, every schedule, on the default job.

    python benchmarks/predictions/tensor_memory.py --ranks 4 --out benchmarks/RESULTS.md

One torchrun sweep of ``train.py`` (the default GPT, p = --ranks, m = 8) over every built-in
schedule; each job measures its tensor bytes (``pipeflow.runtime.memory``: parameters, grads,
AdamW state, what is kept for backward, the step's data and the transport's buffers, each
storage once) after every action of step 1 and predicts the same quantity at start
(``pipeflow.schedules.memory.tensor_memory`` on the profiled layers).  The table lists both per
pipeline rank, their ratio, and the process RSS beside them (its own column: mostly the torch
runtime, not tensors).  Extra Hydra overrides go after ``--``.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner
from benchmarks.runner import benchmark_parser, report  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "interleaved_zb", "zbv",
             "v_half", "v_min", "dualpipev", "auto")
TARGET = 0.10


def run_sweep(args: argparse.Namespace, sweep_dir: str) -> list[dict[str, str]]:
    """One torchrun launch of the sweep; returns sweep.csv's rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--standalone",
           os.path.join(ROOT, "train.py"), "-m", f"schedule={','.join(args.schedules)}",
           f"train.max_steps={args.steps}", "train.eval_every=0", "metrics.progress_bar=false",
           f"hydra.sweep.dir={sweep_dir}", *args.overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the sweep failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(os.path.join(sweep_dir, "sweep.csv")) as f:
        return list(csv.DictReader(f))


def table(rows: list[dict[str, str]], args: argparse.Namespace) -> str:
    """Per schedule and pipeline rank: measured and predicted tensor MB, their ratio, RSS."""
    job = f"the job (`train.py {' '.join(args.overrides)}`" if args.overrides else "the default job (`train.py`: GPT"
    lines = [f"{job} on {args.ranks} processes, m = 8), tensor bytes per pipeline rank (the largest of its data-parallel "
             f"replicas) at the in-step peak of step 1 (measured after every action) beside the start-of-run "
             f"prediction; target +-{TARGET:.0%}",
             "", "| schedule | rank | tensor MB measured | tensor MB predicted | predicted / measured | process RSS MB |",
             "| --- | --- | --- | --- | --- | --- |"]
    worst = 0.0
    by_name = {r["overrides"].split("=", 1)[1]: r for r in rows}
    for name in args.schedules:
        if name not in by_name:
            lines.append(f"| `{name}` | - | skipped | | | |")
            continue
        row = by_name[name]
        measured, predicted, rss = ([float(x) for x in row[k].split(";")]
                                    for k in ("tensor_mb", "predicted_memory_mb", "rss_mb"))
        for r, (m, p, mb) in enumerate(zip(measured, predicted, rss)):
            worst = max(worst, abs(p / m - 1))
            lines.append(f"| `{name}` | {r} | {m:.2f} | {p:.2f} | {p / m:.3f} | {mb:.0f} |")
    lines.append(f"\nlargest deviation {worst:.1%} ({'within' if worst <= TARGET else 'OUTSIDE'} +-{TARGET:.0%})")
    return "\n".join(lines)


def sample_cost_ms(held: int = 4, repeats: int = 200) -> tuple[float, float, int]:
    """What one sample costs: the default GPT's stage 1 (two blocks) with AdamW state and `held`
    micro-batches kept; returns (ms per ``MemoryAccountant.count``, ms of one forward of a
    micro-batch, the tensors a sample walks)."""
    import time

    import torch

    from pipeflow.models import build_gpt
    from pipeflow.runtime.memory import MemoryAccountant
    from pipeflow.runtime.stage import Stage

    torch.manual_seed(0)
    spec = build_gpt(n_layer=6)
    stage = Stage(1, 4, spec.build_layers([2, 3]))
    optimizer = torch.optim.AdamW(stage.parameters())
    accountant = MemoryAccountant({1: stage}, optimizer, torch.device("cpu"))
    x = torch.randn(4, 64, 64)
    (out,) = stage.forward(99, (x.requires_grad_(),))
    stage.backward(99, (torch.ones_like(out),))
    optimizer.step()
    start = time.perf_counter()
    with accountant.tracking():
        for i in range(held):
            stage.forward(i, (torch.randn(4, 64, 64, requires_grad=True),))
    forward_ms = 1e3 * (time.perf_counter() - start) / held
    start = time.perf_counter()
    for _ in range(repeats):
        accountant.count()
    walked = len(list(accountant.kept())) + 3 * len(accountant.parameters())
    return 1e3 * (time.perf_counter() - start) / repeats, forward_ms, walked


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every job (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as sweep_dir:
        rows = run_sweep(args, sweep_dir)
    cost, _, walked = sample_cost_ms()
    overhead = (f"\nOverhead: one sample (after each action of a measured step) costs {cost:.2f} ms on the default "
                f"GPT's stage 1 holding 4 micro-batches (about {walked} tensors walked): 1F1B at m = 8 samples 16 times "
                f"a step, about {16 * cost:.0f} ms on the one measured step (metrics.memory_steps); other steps pay "
                "nothing (no hooks, no samples).")
    report("Tensor memory per rank, predicted vs measured", table(rows, args) + overhead, args.out)


if __name__ == "__main__":
    main()
