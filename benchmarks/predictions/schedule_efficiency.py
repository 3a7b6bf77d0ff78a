"""Measured step time of every schedule on sleep-stages vs the simulator's makespan.

Each stage is one sleep layer whose F, B and W cost fixed wall time without using the CPU, so
the ratio measured / simulated is the runtime's overhead (communication, Python, waits) plus
the layers' own overshoot of their nominal time (``time.sleep`` wakes late).  Two more ratios
take that overshoot out: against the makespan simulated with the layer's costs as
`pipeflow.planning.profile` measures them on one rank alone before the run (what the planner would
predict), and against the makespan simulated with each action's time measured in the run:

    python benchmarks/predictions/schedule_efficiency.py --ranks 4 --microbatches 8 16
    python benchmarks/predictions/schedule_efficiency.py --ranks 4 --microbatches 8 --repeats 5  # noisy machine

With --repeats N every schedule is measured N times, round robin (so slow drift of the machine
hits every schedule alike), and the table gives the medians with the range of the ratio.

Runs on gloo/CPU (the default) with `--ranks` processes spawned here; prints a Markdown table
and, with --out, appends it to that file with the command, machine, torch version and date.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from pipeflow.runtime.transport import P2PComm  # noqa: E402
from benchmarks.runner import benchmark_parser, gloo_worker, report, spawn_ranks  # noqa: E402
from benchmarks.sleep_tools import shared_sleep_profile, sleep_batch, sleep_costs  # noqa: E402
from pipeflow.models.sleep import build_sleep  # noqa: E402
from pipeflow.planning.partition import partition_layers  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.runtime.posting import AheadTuner, Posting  # noqa: E402
from pipeflow.planning.profile import LayerProfile  # noqa: E402
from pipeflow.schedules import build_schedule, simulate  # noqa: E402
from pipeflow.runtime.stage import build_stages  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev")


def measure(
    name: str, p: int, m: int, profiled: LayerProfile, args: argparse.Namespace
) -> tuple[float, ...] | None:
    """(median measured step s, simulated makespan s, makespan simulated with the profiled
    layer costs s, makespan simulated with the measured action times s[, median step s of the
    strict-rendezvous runtime]), or None if the schedule is not available.  With
    --compare-strict the two runtimes alternate step by step."""
    try:
        schedule = build_schedule(name, p, m)
    except Exception as exc:  # noqa: BLE001 - a schedule this build lacks, or m it cannot serve
        if dist.get_rank() == 0:
            print(f"skip {name} m={m}: {exc}", file=sys.stderr)
        return None
    S = schedule.num_stages
    spec = build_sleep(S, args.forward_ms, args.backward_ms, args.weight_ms)
    ranges = partition_layers(S, S)
    stages = build_stages(spec, ranges, schedule.stages_of(dist.get_rank()))
    comm = P2PComm(None, torch.device("cpu"), timeout_s=120)
    # the default runtime, and strict rendezvous (every op of a step done before its action)
    pipes = {strict: Pipeline(stages, schedule, comm, posting=Posting(lowering="rendezvous") if strict else None)
             for strict in (False, True)}
    inputs, targets = sleep_batch(m)  # inputs that require grad: stage 0's B costs B too
    inputs = inputs if 0 in stages else None
    targets = targets if S - 1 in stages else None
    modes = (False, True) if args.compare_strict else (False,)
    times: dict[bool, list[float]] = {mode: [] for mode in modes}
    spans = defaultdict(list)
    for step in range(args.warmup + args.steps):
        for strict in modes:
            pipe = pipes[strict]
            pipe.recorder.start()
            dist.barrier()
            start = time.perf_counter()
            pipe.run(inputs, targets)
            end = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(end, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times[strict].append(float(end))
                for event in pipe.recorder.stop() if not strict else ():
                    if event.kind != "comm":
                        spans[event.name].append(event.end - event.start)
    costs = {"F": args.forward_ms / 1e3, "B": args.backward_ms / 1e3, "W": args.weight_ms / 1e3}
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, {a: statistics.median(v) for a, v in spans.items()})
    measured = {a: t for rank_spans in gathered for a, t in rank_spans.items()}
    # A full backward's event covers B and W; the simulator adds cost(W), absent here: 0.
    actual = simulate(schedule, costs=lambda action: measured.get(str(action), 0.0), posting="ahead").makespan
    nominal = simulate(schedule, costs=costs).makespan
    predicted = simulate(schedule, costs=sleep_costs(schedule, profiled)).makespan
    result = (statistics.median(times[False]), nominal, predicted, actual)
    return result + ((statistics.median(times[True]),) if args.compare_strict else ())


@gloo_worker()
def worker(rank: int, p: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    P2PComm(None, torch.device("cpu")).warmup()
    profiled = shared_sleep_profile(args.forward_ms, args.backward_ms, args.weight_ms, args.profile_repeats)
    runs: dict[tuple[str, int], list[tuple[float, ...]]] = {}
    for _ in range(args.repeats):  # each repeat measures every schedule once, so drift hits all alike
        for m in args.microbatches:
            for name in args.schedules:
                result = measure(name, p, m, profiled, args)
                if result is not None:
                    runs.setdefault((name, m), []).append(result)
    if rank == 0:
        queue.put((profiled, [(name, m, *summarize(results)) for (name, m), results in runs.items()]))


def summarize(results: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Field-wise medians over the repeats, then the lowest and highest measured / simulated
    (nominal costs) and measured / simulated (profiled costs)."""
    medians = tuple(statistics.median(field) for field in zip(*results))
    nominal = [measured / ideal for measured, ideal, *_ in results]
    profiled = [measured / predicted for measured, _, predicted, *_ in results]
    return medians + (min(nominal), max(nominal), min(profiled), max(profiled))


def table(result: tuple[LayerProfile, list[tuple]], args: argparse.Namespace) -> str:
    """The results as a Markdown table."""
    profiled, rows = result
    ms = lambda seconds: f"{seconds * 1e3:.2f}"  # noqa: E731
    lines = [
        f"F = {args.forward_ms} ms, B = {args.backward_ms} ms, W = {args.weight_ms} ms per stage "
        f"(a full backward costs B + W), p = {args.ranks}, median of {args.steps} steps"
        + (f"; medians of {args.repeats} repeats (every schedule measured once per repeat), "
           f"lowest-highest ratio in brackets" if args.repeats > 1 else ""),
        "",
        f"One sleep layer profiled alone (`pipeflow.planning.profile`, median of {args.profile_repeats}): "
        f"F {ms(profiled.forward_s)} ms, B {ms(profiled.input_grad_s)} ms, W {ms(profiled.weight_grad_s)} ms, "
        f"full backward {ms(profiled.backward_s)} ms.",
        "",
        "| schedule | m | measured step (ms) | simulated, nominal costs (ms) | measured / that "
        "| simulated, profiled costs (ms) | measured / that "
        "| simulated, measured action times (ms) | measured / that |"
        + (" strict rendezvous step (ms) | measured / strict |" if args.compare_strict else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if args.compare_strict else ""),
    ]
    for name, m, measured, ideal, predicted, actual, *strict, low, high, low_p, high_p in rows:
        spread = f" ({low:.3f}-{high:.3f})" if args.repeats > 1 else ""
        spread_p = f" ({low_p:.3f}-{high_p:.3f})" if args.repeats > 1 else ""
        line = (
            f"| {name} | {m} | {measured * 1e3:.1f} | {ideal * 1e3:.1f} | {measured / ideal:.3f}{spread} "
            f"| {predicted * 1e3:.1f} | {measured / predicted:.3f}{spread_p} "
            f"| {actual * 1e3:.1f} | {measured / actual:.3f} |"
        )
        if strict:
            line += f" {strict[0] * 1e3:.1f} | {measured / strict[0]:.3f} |"
        lines.append(line)
    lines += [
        "",
        "measured / nominal is the whole overhead, the layers' overshoot of their nominal time "
        "included. Against the profiled costs (what `python -m pipeflow.plan` would predict from "
        "the same profile) the layers' overshoot when alone is taken out; against the measured "
        "action times (each action's median time in the run fed to the simulator) also what the "
        "four ranks sharing the CPU add to the actions, leaving what the runtime adds between "
        "actions: communication, waits and Python."
        + (" Strict rendezvous (`Posting(lowering='rendezvous')`: every op of a step completes before "
           "its action, nothing posted ahead; the runtime before the optimisations) ran in "
           "alternation with the default runtime, step by step." if args.compare_strict else ""),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=10.0)
    parser.add_argument("--weight-ms", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=AheadTuner().steps_to_decide,
                        help="untimed steps first (default: until comm.post_recvs=auto has chosen)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure every schedule this many times, round robin; report medians and range")
    parser.add_argument("--profile-repeats", type=int, default=21,
                        help="timed runs of the sleep layer profiled alone before the measurement")
    parser.add_argument("--compare-strict", action="store_true",
                        help="alternate each step with the strict-rendezvous runtime and compare")
    args = parser.parse_args()
    report("Schedule efficiency on sleep-stages", table(spawn_ranks(worker, args), args), args.out)


if __name__ == "__main__":
    main()
