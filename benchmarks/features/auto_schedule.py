"""``schedule=auto`` against the built-in schedules on uneven sleep-stages, side by side in one run.

    python benchmarks/features/auto_schedule.py --ranks 4 --microbatches 8 --steps 10 --repeats 5

A model of `--layers` sleep layers (F, B and W each `--ms` of wall time, without using the CPU)
whose last quarter costs `--heavy` times as much (a heavy head, say), split into equal layer
counts per stage: with v chunks per rank each stage holds 1/v of a rank's share, so every
placement does the same total work.  Every built-in schedule that holds at most `--limit`
micro-batches of a rank's share (default p, 1F1B's) and ``auto`` (synthesised for these stage
costs under that limit) run round robin, step by step, `--repeats` times; the table gives the
median step of the slowest rank beside the simulated makespan, and auto over the best built-in.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import alternate_rounds, benchmark_parser, gloo_worker, medians, report, spawn_ranks  # noqa: E402
from benchmarks.sleep_tools import sleep_batch  # noqa: E402
from pipeflow.models.sleep import SleepLayer, sleep_loss  # noqa: E402
from pipeflow.models.spec import LayerSpec, ModelSpec  # noqa: E402
from pipeflow.planning.partition import partition_layers  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.runtime.posting import Posting  # noqa: E402
from pipeflow.runtime.stage import build_stages  # noqa: E402
from pipeflow.runtime.transport import P2PComm  # noqa: E402
from pipeflow.schedules import SCHEDULES, build_schedule, simulate, synthesize  # noqa: E402
from pipeflow.schedules.auto import StageCosts  # noqa: E402
from pipeflow.schedules.memory import rank_peaks  # noqa: E402


def layer_ms(args: argparse.Namespace) -> list[float]:
    """Each layer's cost (F = B = W): the last quarter `--heavy` times the others'."""
    heavy_from = args.layers - args.layers // 4
    return [args.ms * (args.heavy if k >= heavy_from else 1.0) for k in range(args.layers)]


def candidates(p: int, m: int, args: argparse.Namespace) -> dict[str, object]:
    """The built-in schedules within the memory limit, and auto for the uneven stage costs."""
    costs_ms = layer_ms(args)
    chosen = {}
    for name in SCHEDULES:
        if name == "auto":
            continue
        try:
            schedule = build_schedule(name, p, m)
        except Exception:  # noqa: BLE001 - a count or size this schedule refuses
            continue
        v = schedule.num_stages // p
        if args.layers % schedule.num_stages == 0 and max(rank_peaks(schedule)) / v <= args.limit:
            chosen[name] = schedule
    v = 2
    ranges = partition_layers(args.layers, p * v)
    per_stage = [sum(costs_ms[i] for i in r) / 1e3 for r in ranges]
    synthesis = synthesize(p, m, v, StageCosts(tuple(per_stage), tuple(per_stage), tuple(per_stage)),
                           comm=args.comm_ms / 1e3, max_activations=args.limit)
    chosen["auto"] = synthesis.chosen.schedule
    return chosen


@gloo_worker()
def worker(rank: int, p: int, port: int, args: argparse.Namespace, queue) -> None:
    m = args.microbatches
    costs_ms = layer_ms(args)
    spec = ModelSpec("uneven-sleep", [LayerSpec(f"sleep.{k}", SleepLayer, (c, c, c)) for k, c in enumerate(costs_ms)],
                     loss_fn=sleep_loss)
    comm = P2PComm(None, torch.device("cpu"), timeout_s=300)
    comm.warmup()
    pipes, makespans = {}, {}
    for name, schedule in candidates(p, m, args).items():
        ranges = partition_layers(args.layers, schedule.num_stages)
        stages = build_stages(spec, ranges, schedule.stages_of(rank))
        pipes[name] = (Pipeline(stages, schedule, comm, posting=Posting(True)), schedule.num_stages)
        stage_s = [sum(costs_ms[i] for i in r) / 1e3 for r in ranges]
        makespans[name] = simulate(schedule, costs=lambda a, c=stage_s: c[a.stage], comm_latency=args.comm_ms / 1e3).makespan
    def step_of(pipe: Pipeline, S: int) -> Callable[[int], Callable[[], Any]]:
        def prepare(_: int) -> Callable[[], Any]:
            inputs, targets = sleep_batch(m)
            return lambda: pipe.run(inputs if 0 in pipe.stages else None, targets if S - 1 in pipe.stages else None)
        return prepare

    times = alternate_rounds({name: step_of(pipe, S) for name, (pipe, S) in pipes.items()},
                             args.steps * args.repeats, warmup=args.warmup)
    if rank == 0:
        queue.put({name: (median, makespans[name]) for name, median in medians(times).items()})


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16, help="sleep layers (a multiple of every stage count)")
    parser.add_argument("--ms", type=float, default=5.0, help="F = B = W of a light layer")
    parser.add_argument("--heavy", type=float, default=2.0, help="cost factor of the last quarter of the layers")
    parser.add_argument("--comm-ms", type=float, default=0.3,
                        help="one hand-off between ranks, for auto's synthesis and every makespan (gloo here: ~0.3 ms)")
    parser.add_argument("--limit", type=float, default=None, help="micro-batches of a rank's share (default p)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    args.limit = float(args.ranks) if args.limit is None else args.limit
    results = spawn_ranks(worker, args)
    best = min((name for name in results if name != "auto"), key=lambda n: results[n][0])
    rows = [
        f"{args.layers} sleep layers, the last quarter x{args.heavy:g} ({args.ms:g} ms F = B = W otherwise), "
        f"p = {args.ranks}, m = {args.microbatches}, memory limit {args.limit:g} micro-batches of a rank's share, "
        f"{args.comm_ms:g} ms a hand-off; "
        f"median step of the slowest rank over {args.steps * args.repeats} steps each, round robin",
        "",
        "| schedule | median step (ms) | simulated makespan (ms) | measured / simulated | / best built-in |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, (step_s, makespan) in sorted(results.items(), key=lambda item: item[1][0]):
        rows.append(f"| `{name}` | {1e3 * step_s:.1f} | {1e3 * makespan:.1f} | {step_s / makespan:.3f} | "
                    f"{step_s / results[best][0]:.3f} |")
    report("schedule=auto on uneven sleep-stages", "\n".join(rows), args.out)


if __name__ == "__main__":
    main()
