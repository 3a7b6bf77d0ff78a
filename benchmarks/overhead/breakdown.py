"""Where pipeflow's time goes on sleep stages, beside a hand-written floor and torch's pipelining.

Sleep stages (one sleep layer per stage: F, B and W each ``--sleep-ms`` of wall time without using
the CPU) make every millisecond beyond the ideal a runtime's.  For each ranks x schedule x
micro-batch count, three contestants run the same layers in alternating rounds in one process
group: pipeflow, ``torch.distributed.pipelining`` (where torch has the schedule; it has no ZB-H1)
the floor -- pipeflow's own lowered program run with nothing but ``batch_isend_irecv`` and
``time.sleep`` (``vs_torch_pipelining.floor_runner``) -- and the floor with the layers: the same
program and calls, each action running the sleep layers through autograd, nothing else
(``layer_floor_runner``: what any runtime training these layers must do).  The first table gives the median steps,
the ideal (the simulator's makespan at the nominal costs) and the ratios; the second splits
pipeflow's and the floor's time per action (means over ranks of counters kept during the timed
rounds, in microseconds):

  sleep late   ``time.sleep`` beyond the nominal (the OS waking late; the floor pays it too)
  stage        an action beyond its sleeps: autograd and the Stage's own Python
  post         the batched ``batch_isend_irecv`` calls
  wait         waiting for transfers: the schedule's own bubble, a peer's lateness, the wake-up
  interpreter  the rest of the step: the program loop, inbox, buffers, shape checks, recording

    python benchmarks/overhead/breakdown.py --ranks 2 4 8 --microbatches 8 32 \\
        --schedules 1f1b interleaved_1f1b zb_h1 zbv --rounds 8 --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, gloo_worker, median_ratio, medians, report, spawn_ranks  # noqa: E402

PARTS = ("sleep late", "stage", "post", "wait", "interpreter")


class Counters:
    """Seconds spent in each part while `on`, for the contestant named by `who`."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.who: str | None = None

    def timed(self, part: str, fn: Callable) -> Callable:
        """`fn` with its time added to `part` of the current contestant (while one is set)."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.who is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.who, part] += time.perf_counter() - start
        return wrapper


def instrument(counters: Counters, pipe: Any) -> None:
    """Count pipeflow's compute actions, batched posts and waits; ``time.sleep`` for everyone."""
    pipe._compute = counters.timed("compute", pipe._compute)
    pipe.comm.post = counters.timed("post", pipe.comm.post)
    pipe.comm.wait = counters.timed("wait", pipe.comm.wait)


def sleeps_of(schedule: Any, rank: int) -> int:
    """The sleeps of rank `rank`'s actions in one step: F, B and W one each, a full B (no W after
    it) two."""
    from pipeflow.schedules.ir import BACKWARD, WEIGHT, Action

    mine = set(schedule.actions[rank])
    return sum(2 if a.kind == BACKWARD and Action(WEIGHT, a.microbatch, a.stage) not in mine else 1 for a in mine)


@gloo_worker(timeout=datetime.timedelta(seconds=600))
def worker(rank: int, ranks: int, port: int, args: argparse.Namespace, queue) -> None:
    """Every (schedule, m) case on this world; rank 0 puts the rows on the queue."""
    from benchmarks.overhead import vs_torch_pipelining as vs
    from pipeflow.runtime.transport import P2PComm
    from pipeflow.schedules import build_schedule, simulate

    counters = Counters()
    real_sleep = time.sleep
    time.sleep = counters.timed("sleep", real_sleep)  # the sleep layers' and the floor's alike
    P2PComm(None, torch.device("cpu")).warmup()
    layer_args = argparse.Namespace(model="sleep", sleep_ms=args.sleep_ms, batch=args.batch, seq=1, layers_per_stage=1)
    rows = []
    for m in args.microbatches:
        for name in args.schedules:
            schedule = build_schedule(name, ranks, m)
            built = {s: vs.make_layers(layer_args, 8, s) for s in schedule.stages_of(rank)}
            batch = vs.make_batch(layer_args, 8, torch.device("cpu"))
            runners = {"pipeflow": vs.pipeflow_runner(schedule, built, batch, torch.device("cpu"), m)}
            if name in vs.TORCH_SCHEDULES:
                runners["torch"] = vs.torch_runner(name, schedule, {s: copy.deepcopy(ls) for s, ls in built.items()},
                                                   batch, torch.device("cpu"), m)
            runners["floor"] = vs.floor_runner(runners["pipeflow"].pipeline, batch, m, args.sleep_ms,
                                               post=counters.timed("post", dist.batch_isend_irecv),
                                               wait=counters.timed("wait", lambda work: work.wait()))
            runners["floor+layers"] = vs.layer_floor_runner(runners["pipeflow"].pipeline,
                                                            {s: copy.deepcopy(ls) for s, ls in built.items()}, batch, m)
            pipe = runners["pipeflow"].pipeline
            instrument(counters, pipe)
            counters.seconds.clear()
            times: dict[str, list[float]] = {fw: [] for fw in runners}
            for runner in runners.values():  # this rank's own step (the table's: the slowest rank's)
                runner._step = counters.timed("step", runner._step)
            for k in range(args.warmup + args.rounds):
                for fw, runner in runners.items():
                    counters.who = fw if k >= args.warmup else None
                    took, _ = vs.timed(runner, torch.device("cpu"))
                    counters.who = None
                    if k >= args.warmup:
                        times[fw].append(took)
            nominal = args.sleep_ms / 1e3
            ideal = simulate(schedule, costs={"F": nominal, "B": nominal, "W": nominal}).makespan
            actions, sleeps = len(schedule.actions[rank]), sleeps_of(schedule, rank)
            mine = {}
            for fw in ("pipeflow", "floor"):
                s = {part: counters.seconds[fw, part] / args.rounds for part in ("sleep", "compute", "post", "wait", "step")}
                step = s["step"]
                late = s["sleep"] - sleeps * nominal
                stage = max(0.0, s["compute"] - s["sleep"]) if fw == "pipeflow" else 0.0
                inside = s["compute"] if fw == "pipeflow" else s["sleep"]
                rest = step - inside - s["post"] - s["wait"]
                mine[fw] = [late, stage, s["post"], s["wait"], rest]
            per_rank = [None] * ranks
            dist.all_gather_object(per_rank, (mine, actions))
            if rank == 0:
                row = {"p": ranks, "schedule": name, "m": m, "ideal": ideal,
                       **medians(times), "ratio_floor": median_ratio(times["pipeflow"], times["floor"]),
                       "ratio_layers": median_ratio(times["pipeflow"], times["floor+layers"]),
                       "ratio_torch": median_ratio(times["pipeflow"], times["torch"]) if "torch" in times else None,
                       "parts": {fw: [statistics.mean(r[0][fw][j] / r[1] for r in per_rank) for j in range(len(PARTS))]
                                 for fw in ("pipeflow", "floor")}}
                rows.append(row)
                print(f"p={ranks} {name} m={m}: pipeflow/floor {row['ratio_floor']:.3f}", file=sys.stderr, flush=True)
            dist.barrier()
    time.sleep = real_sleep
    if rank == 0:
        queue.put(rows)


def tables(rows: list[dict], args: argparse.Namespace) -> str:
    """The steps table and the per-action breakdown table, Markdown."""
    lines = [f"sleep stages: one layer per stage, F = B = W = {args.sleep_ms:g} ms; medians of {args.rounds} "
             f"alternating rounds after {args.warmup} warm-up; the floor runs pipeflow's own program with "
             "batch_isend_irecv and time.sleep only", "",
             "| ranks | schedule | m | ideal (ms) | floor (ms) | floor + layers (ms) | pipeflow (ms) | torch (ms) "
             "| pipeflow / floor | pipeflow / floor + layers | pipeflow / torch | pipeflow / ideal | floor / ideal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        torch_ms = f"{r['torch'] * 1e3:.1f}" if "torch" in r else "-"
        versus = f"{r['ratio_torch']:.3f}" if r["ratio_torch"] is not None else "- (torch has none)"
        lines.append(f"| {r['p']} | {r['schedule']} | {r['m']} | {r['ideal'] * 1e3:.1f} | {r['floor'] * 1e3:.1f} "
                     f"| {r['floor+layers'] * 1e3:.1f} | {r['pipeflow'] * 1e3:.1f} | {torch_ms} | {r['ratio_floor']:.3f} "
                     f"| {r['ratio_layers']:.3f} | {versus} "
                     f"| {r['pipeflow'] / r['ideal']:.3f} | {r['floor'] / r['ideal']:.3f} |")
    lines += ["", "per action (µs, mean over ranks): pipeflow / floor", "",
              "| ranks | schedule | m | " + " | ".join(PARTS) + " | total over the sleeps |",
              "|" + " --- |" * (4 + len(PARTS))]
    for r in rows:
        mine, floor = r["parts"]["pipeflow"], r["parts"]["floor"]
        cells = " | ".join(f"{a * 1e6:.0f} / {b * 1e6:.0f}" for a, b in zip(mine, floor))
        lines.append(f"| {r['p']} | {r['schedule']} | {r['m']} | {cells} | {sum(mine) * 1e6:.0f} / {sum(floor) * 1e6:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--schedules", nargs="+", default=["1f1b"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--sleep-ms", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds first (default: until comm.post_recvs=auto has chosen)")
    args = parser.parse_args()
    if args.warmup is None:
        from pipeflow.runtime.posting import AheadTuner

        args.warmup = AheadTuner().steps_to_decide
    rows = []
    for ranks in args.ranks:
        rows += spawn_ranks(worker, argparse.Namespace(**{**vars(args), "ranks": ranks}))
    report("Overhead on sleep stages: pipeflow, torch and the floor", tables(rows, args), args.out)


if __name__ == "__main__":
    main()
