"""What micro-batches of different shapes cost the runtime, side by side in one run.

    python benchmarks/features/variable_shapes.py --ranks 4 --microbatches 8 --steps 30 --repeats 5

The default job's GPT on p gloo ranks, 1F1B, m micro-batches, three pipelines over the same
stages, run round robin, step by step (the slowest rank's step time, medians):

- ``variable``: every micro-batch its own sequence length (``per_microbatch`` shapes: each step
  the metadata flows down the stages, one small message per stage boundary);
- ``given``: the same lengths with their plan given in advance (learned once, never exchanged
  again), so attention's L^2 and the pipeline's real imbalance are the same as in ``variable``
  and the ratio is the cost of learning shapes per step;
- ``renegotiate`` against ``per-step``: one length per step for all of its micro-batches,
  changing every step, served by ``comm.shapes=per_step`` (a broadcast per step, the shape
  chain again when it changed) and by ``per_microbatch`` shapes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, gloo_worker, medians, report, slowest_seconds, spawn_ranks  # noqa: E402
from pipeflow.models import build_gpt  # noqa: E402
from pipeflow.planning.partition import partition_layers  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.runtime.posting import Posting  # noqa: E402
from pipeflow.runtime.stage import build_stages  # noqa: E402
from pipeflow.runtime.transport import P2PComm  # noqa: E402
from pipeflow.schedules import build_schedule  # noqa: E402

VOCAB = 64


def batch(lengths: list[int], rows: int, step: int) -> tuple[list[tuple[torch.Tensor]], list[torch.Tensor]]:
    """Micro-batches of `rows` sequences of the given lengths (tokens seeded by step)."""
    gen = torch.Generator().manual_seed(step)
    tokens = [torch.randint(VOCAB, (rows, n + 1), generator=gen) for n in lengths]
    return [(t[:, :-1],) for t in tokens], [t[:, 1:] for t in tokens]


def timed(pipe: Pipeline, data: tuple, weights: list[float]) -> float:
    """One training step; the slowest rank's seconds."""
    last = pipe.schedule.num_stages - 1
    inputs = data[0] if 0 in pipe.stages else None
    targets = data[1] if last in pipe.stages else None
    took, _ = slowest_seconds(lambda: pipe.run(inputs, targets, loss_weights=weights))
    for stage in pipe.stages.values():
        for p in stage.parameters():
            p.grad = None
    return took


@gloo_worker()
def worker(rank: int, p: int, port: int, args: argparse.Namespace, queue) -> None:
    m, seq = args.microbatches, args.seq_len
    spec = build_gpt(vocab_size=VOCAB, block_size=seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    schedule = build_schedule("1f1b", p, m)
    stages = build_stages(spec, partition_layers(len(spec.layers), p), schedule.stages_of(rank))
    comm = P2PComm(None, torch.device("cpu"), timeout_s=300)
    comm.warmup()
    posting = Posting(True)  # recvs a step ahead in every pipeline: only the shape handling differs
    pipes = {name: Pipeline(stages, schedule, comm, shapes, posting=posting)
             for name, shapes in (("variable", "per_microbatch"), ("given", "per_microbatch"),
                                  ("renegotiate", "per_step"), ("per-step", "per_microbatch"))}
    lengths = [seq - (k * seq) // (2 * m) for k in range(m)]  # seq down to about seq / 2
    per_step = [seq - (k * seq) // 8 for k in range(4)]  # one length a step, cycling
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for step in range(args.warmup + args.steps * args.repeats):
        for name, pipe in pipes.items():
            ls = lengths if name in ("variable", "given") else [per_step[step % len(per_step)]] * m
            t = timed(pipe, batch(ls, args.rows, step), [n / sum(ls) for n in ls])  # rows alike: tokens ~ length
            if name == "given" and step == 0:  # the plan is known from now on: never exchanged again
                pipe.shapes.prepare = lambda inputs, count: None  # type: ignore[method-assign]
            if step >= args.warmup:
                times[name].append(t)
    if rank == 0:
        queue.put(medians(times))


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    medians = spawn_ranks(worker, args)
    v, g, r, s = (1e3 * medians[k] for k in ("variable", "given", "renegotiate", "per-step"))
    text = "\n".join([
        f"GPT {args.layers} blocks x {args.width}, p = {args.ranks}, 1F1B, m = {args.microbatches}, "
        f"{args.rows} rows x up to {args.seq_len} tokens per micro-batch; median step (slowest rank), "
        f"{args.steps * args.repeats} steps each, round robin",
        "",
        "| workload | pipeline | median step (ms) | ratio |",
        "| --- | --- | --- | --- |",
        f"| lengths differ within a step | per-micro-batch shapes, learned every step | {v:.2f} | {v / g:.3f} |",
        f"| lengths differ within a step | the same plan given in advance | {g:.2f} | 1 |",
        f"| one length a step, changing | per-micro-batch shapes | {s:.2f} | {s / r:.3f} |",
        f"| one length a step, changing | comm.shapes=per_step (broadcast, renegotiate) | {r:.2f} | 1 |",
    ])
    report("Variable shapes", text, args.out)


if __name__ == "__main__":
    main()
