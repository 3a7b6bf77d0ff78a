"""DualPipeV with its pairs overlapped (``pipeline.overlap_pairs``) against the same pairs run F then B,
on stages whose communication is a real wait, beside the simulator's prediction for both.

Four gloo processes: pp 2 x dp 2, the dp pair of each stage its ep group.  Every stage is three
layers: a sleep layer (F ``--forward-ms``/2, B ``--backward-ms``/2, W ``--weight-ms``), an
exchange layer that sends ``--exchange-mb`` MB through the ep group's ``all_to_all``
(pipeflow's MoE exchange, :class:`~pipeflow.runtime.parallel.expert_parallel.AllToAll`: once in forward,
once in backward) and another sleep layer (F/2, B/2).  The sleep leaves the cores free, so the
all_to_all is the only real work: in an overlapped pair it proceeds while the other micro-batch's
action sleeps.  Both settings run in alternating rounds in one process group; the table gives
the median step (the slowest rank's) of each and the ratio, and the prediction: the simulator
fed the per-action costs and exchanges measured on the F-then-B rounds (means of the recorded
events: each F and B with its all_to_all inside, the all_to_all alone; the P2P latency), timing
the overlapped pairs as the runtime runs them (:func:`~pipeflow.schedules.sim_engine.overlapped_pair`).

    python benchmarks/features/dualpipev_overlap.py --rounds 9 --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_ranks  # noqa: E402


class Exchange(nn.Module):
    """x -> x, sending `numel` floats through the ep group's all_to_all in forward and backward."""

    def __init__(self, numel: int, group: Any, recorder: Any) -> None:
        from pipeflow.runtime import overlap

        super().__init__()
        self.numel, self.group, self.recorder = numel, group, recorder
        overlap.mark_communicating(self)  # its all_to_all is a point where an overlapped pair hands over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Exchange a payload that depends on x, so its gradient comes back the same way."""
        from pipeflow.runtime.parallel.expert_parallel import AllToAll

        payload = x.sum().reshape(1).expand(self.numel).contiguous()
        out = AllToAll.apply(payload, None, None, self.group, self.recorder, "payload")
        return x + out[:1].sum() * 0


def build(rank: int, args: argparse.Namespace, overlap: bool, recorder: Any, ep_group: Any, pipe_group: Any) -> Any:
    """This rank's Pipeline of dualpipev (p 2) on the exchange stages."""
    from pipeflow.models.sleep import SleepLayer
    from pipeflow.runtime.pipeline import Pipeline
    from pipeflow.runtime.stage import Stage
    from pipeflow.runtime.transport import P2PComm
    from pipeflow.schedules import build_schedule

    schedule = build_schedule("dualpipev", 2, args.microbatches)
    comm = P2PComm(pipe_group, torch.device("cpu"), timeout_s=120.0)
    half_f, half_b = args.forward_ms / 2, args.backward_ms / 2
    numel = int(args.exchange_mb * 1e6 / 4)
    stages = {}
    for s in schedule.stages_of(comm.rank):
        layers = [SleepLayer(half_f, half_b, args.weight_ms), Exchange(numel, ep_group, recorder),
                  SleepLayer(half_f, half_b, 0.0)]
        stages[s] = Stage(s, schedule.num_stages, layers, loss_fn=lambda out, y: out.pow(2).mean())
    return Pipeline(stages, schedule, comm, recorder=recorder, overlap_pairs=overlap)


@gloo_worker(timeout=datetime.timedelta(seconds=600))
def worker(rank: int, ranks: int, port: int, args: argparse.Namespace, queue) -> None:
    """Both settings in alternating rounds; rank 0 puts the row on the queue."""
    from pipeflow.runtime.events import EventRecorder
    from pipeflow.schedules.sim_engine import RuntimeCosts
    from pipeflow.schedules.simulator import simulate

    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # ranks 2d, 2d + 1: replica d's pipeline
    eps = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # each stage's dp pair: its ep group
    recorder = EventRecorder()
    runs = {overlap: build(rank, args, overlap, recorder, eps[rank % 2], pipes[rank // 2]) for overlap in (True, False)}
    schedule = runs[True].schedule
    m = schedule.num_microbatches
    inputs = [(torch.randn(2, 8, requires_grad=True),) for _ in range(m)]
    targets = [torch.zeros(2, 8) for _ in range(m)]
    times: dict[bool, list[float]] = {True: [], False: []}
    events: list[Any] = []
    for k in range(args.warmup + args.rounds):
        for overlap in (k % 2 == 0, k % 2 == 1):  # alternate which goes first
            pipe = runs[overlap]
            dist.barrier()
            record = k >= args.warmup and not overlap
            if record:
                recorder.start()
            start = time.perf_counter()
            pipe.run(inputs if 0 in pipe.stages else None, targets if 0 in pipe.stages else None)
            took = torch.tensor([time.perf_counter() - start])
            if record:
                events.append(recorder.stop())
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
            if k >= args.warmup:
                times[overlap].append(float(took))
            for stage in pipe.stages.values():
                stage.module.zero_grad(set_to_none=True)
    # the costs measured on the F-then-B rounds, the slowest rank's standing for all
    from pipeflow.schedules.ir import Action

    split = schedule.split_backwards()
    by_kind: dict[str, list[float]] = {}
    for step in events:
        for e in step:
            kind = e.kind
            if kind == "B":  # a B of a split backward, or a full one (its W inside)
                action = Action.parse(e.name)
                kind = "B" if (action.stage, action.microbatch) in split else "full B"
            by_kind.setdefault(kind, []).append(e.end - e.start)
    # means, not medians: a step sums its actions, and their spread (a late peer in an all_to_all) adds up
    mine = {kind: statistics.fmean(ds) for kind, ds in by_kind.items() if kind in ("F", "B", "full B", "W", "a2a")}
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, mine)
    latency = _p2p_latency(pipes[rank // 2], rank % 2)
    if rank == 0:
        cost = {kind: max(g.get(kind, 0.0) for g in gathered) for kind in ("F", "B", "full B", "W", "a2a")}
        exchange = cost["a2a"]
        # a full backward costs B + W in the simulator: its B the full one's less the W measured apart
        costs = {"F": cost["F"], "B": cost["full B"] - cost["W"], "W": cost["W"]}
        runtime = RuntimeCosts(transfer=lambda op: latency,
                               exchanges=lambda a: (exchange, 1) if a.kind in ("F", "B") else (0.0, 0))
        predicted = {overlap: simulate(schedule, costs=costs, posting=runs[overlap].posting.for_training(False),
                                       runtime=runtime, overlap=overlap).makespan for overlap in (True, False)}
        queue.put({"times": times, "predicted": predicted, "costs": cost, "latency": latency})


def _p2p_latency(group: Any, me: int, repeats: int = 20) -> float:
    """Half the median round trip of a small tensor between the two pipeline ranks."""
    x, trips = torch.zeros(16), []
    for _ in range(repeats):
        start = time.perf_counter()
        if me == 0:
            dist.send(x, dist.get_global_rank(group, 1), group=group)
            dist.recv(x, dist.get_global_rank(group, 1), group=group)
        else:
            dist.recv(x, dist.get_global_rank(group, 0), group=group)
            dist.send(x, dist.get_global_rank(group, 0), group=group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def table(result: dict, args: argparse.Namespace) -> str:
    """The Markdown table of one run."""
    times, predicted, cost = result["times"], result["predicted"], result["costs"]
    on, off = statistics.median(times[True]), statistics.median(times[False])
    ratios = statistics.median(a / b for a, b in zip(times[True], times[False]))
    lines = [
        f"dualpipev, p 2 x dp 2 (ep 2), m {args.microbatches}; F {args.forward_ms} ms, B {args.backward_ms} ms, "
        f"W {args.weight_ms} ms of sleep per stage, {args.exchange_mb} MB all_to_all in F and in B "
        f"(measured {1e3 * cost['a2a']:.2f} ms each; F {1e3 * cost['F']:.2f}, full B {1e3 * cost['full B']:.2f}, "
        f"B {1e3 * cost['B']:.2f}, W {1e3 * cost['W']:.2f} ms with it; P2P {1e3 * result['latency']:.2f} ms); "
        f"medians of {args.rounds} alternating rounds",
        "",
        "| pipeline.overlap_pairs | measured step (ms) | predicted (ms) | predicted / measured |",
        "| --- | ---: | ---: | ---: |",
    ]
    for overlap, measured in ((True, on), (False, off)):
        lines.append(f"| {str(overlap).lower()} | {1e3 * measured:.1f} | {1e3 * predicted[overlap]:.1f} | "
                     f"{predicted[overlap] / measured:.3f} |")
    lines.append("")
    lines.append(f"overlapped / F-then-B: {ratios:.3f} (median of per-round ratios); predicted "
                 f"{predicted[True] / predicted[False]:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=10.0)
    parser.add_argument("--weight-ms", type=float, default=5.0)
    parser.add_argument("--exchange-mb", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    args.ranks = 4
    result = spawn_ranks(worker, args)
    report("DualPipeV: overlapped pairs against F then B (sleep stages, a real all_to_all)", table(result, args),
           args.out)


if __name__ == "__main__":
    main()
