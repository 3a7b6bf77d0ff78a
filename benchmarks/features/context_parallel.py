"""What ``parallel.cp`` saves and what its ring costs: activation memory per rank, and the share
of the ring's exchanges hidden behind the attention compute.

    python benchmarks/features/context_parallel.py --cps 1 2 4 --seq 1024 --out benchmarks/RESULTS.md

For each context-parallel degree cp (world = cp spawned gloo ranks, pp = dp = 1) the same job (a
GPT on one long sequence per micro-batch, ``train.py``'s own
:func:`~pipeflow.run.builder.build_run`) trains ``--steps`` steps; reported per rank:

- the in-step peak of activation bytes, measured by pipeflow's accountant at step 1
  (:mod:`pipeflow.runtime.memory`) and predicted at the start (the layout's prediction, profiled
  at ``seq / cp``), and their ratio to cp = 1's;
- the step time (median of the slowest rank, barrier to barrier).

Then, on the same ranks, one attention layer's ring (:mod:`pipeflow.runtime.parallel.ring_attention`)
forward + backward on the model's shapes, three ways in alternating rounds: as it runs (each
exchange posted before the block it overlaps is computed), with every exchange waited for as soon
as it is posted (``OVERLAP = False``), and the exchanges alone (no compute).  The hidden share is
(serial - overlapped) / exchanges alone, clipped to [0, 1]: how much of the ring's transfer time
the compute absorbed.  On a CPU with fewer cores than ranks gloo's transfers and the compute share
cores, so the share measures this machine, not a GPU's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.features.sharding import compose  # noqa: E402
from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_per_degree, timed_train_steps  # noqa: E402
from pipeflow.run.builder import build_run  # noqa: E402
from pipeflow.runtime.parallel import ring_attention  # noqa: E402
from pipeflow.runtime.transport import P2PComm  # noqa: E402


def overrides(args: argparse.Namespace, cp: int, run_dir: str) -> list[str]:
    """``train.py``'s overrides for the job at degree `cp`."""
    return [f"parallel.cp={cp}", "parallel.pp=1", "parallel.dp=1", "schedule=1f1b",
            f"pipeline.num_microbatches={args.microbatches}", f"data.batch_size={args.batch}",
            f"data.seq_len={args.seq}", f"model.block_size={args.seq}", "data.vocab_size=64",
            f"model.n_embd={args.width}", f"model.n_head={args.heads}", f"model.n_layer={args.layers}",
            f"train.max_steps={args.steps + 2}", "metrics.tensorboard=false", "metrics.progress_bar=false",
            "metrics.memory_steps=[1]", "train.eval_every=0", f"train.run_dir={run_dir}"]


def ring_times(args: argparse.Namespace, cp: int) -> dict[str, float]:
    """Median seconds of one attention layer's ring forward + backward, overlapped and serial, and
    of its exchanges alone (alternating rounds; the slowest rank's)."""
    comm = P2PComm(None, torch.device("cpu"), timeout_s=300)
    ring = ring_attention.RingComm(comm)
    b, h, d = args.batch // args.microbatches, args.heads, args.width // args.heads
    local = args.seq // cp
    gen = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(b, h, local, d, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, local, d, generator=gen)

    def attention(overlap: bool) -> None:
        ring_attention.OVERLAP = overlap
        try:
            ring_attention.ring_attention(q, k, v, ring, args.seq).backward(grad)
        finally:
            ring_attention.OVERLAP = True

    def exchanges() -> None:  # what the forward and backward pass round: n - 1 key/value blocks, n gradient pairs
        kv = torch.stack([k.detach(), v.detach()])
        for _ in range(cp - 1):
            kv = ring.pass_on(kv, "benchmark key/value block")()
        for _ in range(cp - 1):
            kv = ring.pass_on(kv, "benchmark key/value block")()
        for _ in range(cp):
            kv = ring.pass_on(kv, "benchmark gradients")()

    ways = {"overlapped": lambda: attention(True), "serial": lambda: attention(False), "exchanges": exchanges}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, run in ways.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
    return {name: statistics.median(ts) for name, ts in times.items()}


@gloo_worker()
def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    cp = world
    trainer = build_run(compose(overrides(args, cp, os.path.join(args.tmp, f"cp{cp}"))), torch.device("cpu"))
    times = timed_train_steps(trainer, args.steps)
    measured = trainer.loop.memory.peak
    predicted = trainer.plan.layout.prediction.memory[0].peak
    ring = ring_times(args, cp) if cp > 1 else {}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (rank, measured.activations, predicted.activations, times, ring))
    trainer.close()
    if rank == 0:
        queue.put(everyone)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def table(results: dict[int, list], args: argparse.Namespace) -> str:
    """One line per cp: the largest rank's activation peak measured and predicted, its ratio to
    cp = 1's, the step time and the ring's timings and hidden share."""
    head = (f"GPT {args.layers} x {args.width}, {args.heads} heads, seq {args.seq}, batch {args.batch}, m "
            f"{args.microbatches}, float32; activations: the largest rank's step-1 peak; ring: one layer's forward + "
            f"backward, medians of {args.rounds} rounds; hidden = (serial - overlapped) / exchanges (module docstring)")
    lines = [head, "", "| cp | activations MB measured | predicted | / cp=1 | 1/cp | step ms | ring ms overlapped | "
             "serial | exchanges | hidden |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = None
    for cp, everyone in sorted(results.items()):
        measured, predicted = max(e[1] for e in everyone), max(e[2] for e in everyone)
        base = measured if cp == 1 else base
        slowest = [max(e[3][k] for e in everyone) for k in range(args.steps)]
        ring = everyone[0][4]
        if ring:
            hidden = min(1.0, max(0.0, (ring["serial"] - ring["overlapped"]) / ring["exchanges"]))
            cells = (f"{1e3 * ring['overlapped']:.2f} | {1e3 * ring['serial']:.2f} | {1e3 * ring['exchanges']:.2f} | "
                     f"{100 * hidden:.0f}%")
        else:
            cells = "- | - | - | -"
        ratio = f"{measured / base:.3f}" if base else "n/a"
        lines.append(f"| {cp} | {_mb(measured)} | {_mb(predicted)} | {ratio} | {1 / cp:.3f} | "
                     f"{1e3 * statistics.median(slowest):.1f} | {cells} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="context-parallel degrees")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (2 x every cp divides it)")
    parser.add_argument("--batch", type=int, default=2, help="global batch (rows)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--width", type=int, default=64, help="model.n_embd")
    parser.add_argument("--heads", type=int, default=4, help="model.n_head")
    parser.add_argument("--layers", type=int, default=2, help="model.n_layer")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per degree")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the ring timing")
    args = parser.parse_args()
    args.pp = 1  # world = cp
    results = spawn_per_degree(worker, args, args.cps, "cp")
    report("parallel.cp: activation memory per rank and the ring's hidden share", table(results, args), args.out)


if __name__ == "__main__":
    main()
