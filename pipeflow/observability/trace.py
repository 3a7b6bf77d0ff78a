"""Traces of chosen training steps: clocks aligned over the process group, one Chrome-trace
JSON (opens in Perfetto, one track per rank) and one timeline picture per step.

Every rank times its events with its own ``time.perf_counter``;
:func:`~pipeflow.runtime.world.clocks.clock_offsets` measures each clock against rank 0's so that all
events land on rank 0's time axis.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.runtime.parallel.mesh_order import MeshGrid
from pipeflow.observability.figures import pipeline_bubble, step_figures
from pipeflow.runtime.world.clocks import clock_offsets, host_offsets  # noqa: F401 - host_offsets: also read from here
from pipeflow.runtime.events import A2A, COPY_KINDS, SHARD, TimedEvent
from pipeflow.schedules import PipelineSchedule
from pipeflow.schedules.ir import KINDS, Action
from pipeflow.schedules.pictures import draw_timeline

# One traced step of one rank: (pipeline rank, step start, step end, [(kind, name, start, end)])
RankStep = tuple[int, float, float, list[tuple[str, str, float, float]]]


# One rank's checkpoint spans: (step, save | stage | write, start, end), clocks aligned
SaveSpan = tuple[int, str, float, float]
SAVE_NAMES = {"save": "checkpoint save (synchronous)", "stage": "checkpoint staging",
              "write": "checkpoint write (background)"}
WRITER_TID = 3  # the background write's own thread: off the training path


def chrome_trace(steps: dict[int, list[RankStep]], grid: MeshGrid | None = None,
                 saves: Sequence[Sequence[SaveSpan]] = ()) -> dict[str, Any]:
    """A Chrome trace (Perfetto, chrome://tracing) of traced steps, clocks already aligned.

    Args:
        steps: ``steps[step][global rank]`` as gathered by :func:`write_traces`.
        grid: every rank's mesh coordinates (``parallel.order``): with tp > 1 a process is named
            by its (dp, pp, tp) coordinates; None: one pipeline in the default order.
        saves: ``saves[global rank]``: that rank's checkpoint spans (category ``checkpoint``): a
            synchronous save and a background save's staging on the pipeline's thread (training
            waits for them), its write on a thread of its own (``checkpoint writer``).

    Returns:
        ``{"traceEvents": [...]}``: process ``rank r`` per rank (pid = global rank, one thread),
        a complete event (``ph: X``, microseconds) per action, batched call or shard point
        (``unshard 0``, ``reduce-scatter + reshard 0``: category ``shard``), with step,
        micro-batch and stage in ``args``.
    """
    origin = min([start for per_rank in steps.values() for _, start, _, _ in per_rank]
                 + [start for spans in saves for _, _, start, _ in spans], default=0.0)
    events: list[dict[str, Any]] = []
    ranks = {r: pp for per_rank in steps.values() for r, (pp, *_) in enumerate(per_rank)}
    if grid is None:
        num_pp = max(ranks.values(), default=0) + 1
        grid = MeshGrid(max(1, len(ranks) // num_pp), num_pp)
    for r, pp in sorted(ranks.items()):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": grid.label(r)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "pipeline"}})
    lanes: set[tuple[int, int]] = set()
    for step, per_rank in sorted(steps.items()):
        for r, (_, _, _, timed) in enumerate(per_rank):
            computed_to = -math.inf  # an action starting before the last one ended: an overlapped pair's
            for kind, name, start, end in sorted(timed, key=lambda e: e[2]):
                tid = 2 if kind == A2A else 0
                if kind in KINDS:
                    tid, computed_to = (1 if start < computed_to else 0), max(computed_to, end)
                lanes.add((r, tid))
                args: dict[str, Any] = {"step": step}
                if kind in KINDS:
                    action = Action.parse(name)
                    args.update(microbatch=action.microbatch, stage=action.stage)
                elif kind not in (SHARD, A2A) and kind not in COPY_KINDS:
                    args["ops"] = name
                named = kind in KINDS or kind == SHARD or kind in COPY_KINDS
                events.append({
                    "ph": "X", "name": name if named else f"all_to_all {name}" if kind == A2A else "comm", "cat": kind,
                    "pid": r, "tid": tid,
                    "ts": 1e6 * (start - origin), "dur": 1e6 * (end - start), "args": args,
                })
    for r, spans in enumerate(saves):
        for step, kind, start, end in spans:
            tid = WRITER_TID if kind == "write" else 0
            lanes.add((r, tid))
            events.append({"ph": "X", "name": SAVE_NAMES[kind], "cat": "checkpoint", "pid": r, "tid": tid,
                           "ts": 1e6 * (start - origin), "dur": 1e6 * (end - start), "args": {"step": step}})
    threads = {1: "overlapped pair", 2: "all_to_all", WRITER_TID: "checkpoint writer"}
    for r, tid in sorted(lanes):  # the pair's second action, the exchanges and the writer on threads of their own
        if tid:
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": threads[tid]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_step(per_rank: Sequence[RankStep], num_pp: int, title: str, out_path: str) -> str:
    """Draw one measured step like the schedule pictures: F/B/W boxes per pipeline rank, comm
    waits as grey bars, the gathers and reductions of sharded stages (``parallel.shard=full``)
    as purple ones, time in ms from the step's first event."""
    origin = min((s for _, _, _, timed in per_rank for _, _, s, _ in timed), default=0.0)
    boxes, waits, shards, seen = [], [], [], set()
    for pp, _, _, timed in per_rank:
        if pp in seen:  # data-parallel replicas: draw the first one of each pipeline rank
            continue
        seen.add(pp)
        for kind, name, start, end in timed:
            span = (1e3 * (start - origin), 1e3 * (end - origin))
            if kind in KINDS:
                boxes.append((pp, Action.parse(name), *span))
            elif kind != A2A:  # an MoE layer's exchange lies inside its action's box
                (shards if kind == SHARD or kind in COPY_KINDS else waits).append((pp, *span))
    # as wide as the schedule picture would be with unit costs: the span in typical actions
    unit = statistics.median(end - start for *_, start, end in boxes) if boxes else 1.0
    return str(draw_timeline(boxes, num_pp, title, out_path, waits=waits, xlabel="ms", unit=unit, shards=shards))


def write_traces(
    traced: dict[int, tuple[float, float, list[tuple[str, str, float, float]]]],
    pp_rank: int,
    schedule: PipelineSchedule,
    run_dir: str,
    device: torch.device,
    predicted: float,
    writer: Any = None,
    grid: MeshGrid | None = None,
    saves: Sequence[SaveSpan] = (),
) -> None:
    """Gather every rank's traced steps and checkpoint spans (`saves`) to rank 0 (clocks aligned)
    and write ``trace.json`` and ``timeline_step<N>.png`` into `run_dir` (and the pictures into
    TensorBoard).  Collective."""
    offset = clock_offsets(device)[dist.get_rank()]
    mine = {
        step: (pp_rank, start - offset, end - offset, [(k, n, s - offset, e - offset) for k, n, s, e in timed])
        for step, (start, end, timed) in traced.items()
    }
    spans = [(step, kind, start - offset, end - offset) for step, kind, start, end in saves]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((mine, spans), gathered, dst=0)
    if gathered is None:
        return
    traced_by_rank = [g[0] for g in gathered]
    steps = {step: [g[step] for g in traced_by_rank] for step in sorted(set().union(*traced_by_rank))
             if all(step in g for g in traced_by_rank)}
    with open(os.path.join(run_dir, "trace.json"), "w") as f:
        json.dump(chrome_trace(steps, grid, [g[1] for g in gathered]), f)
    for step, per_rank in steps.items():
        figures = [step_figures([TimedEvent(*t) for t in timed], start, end) for _, start, end, timed in per_rank]
        bubble = pipeline_bubble([f.compute_s for f in figures], [f.span_s for f in figures])
        title = (f"measured {schedule.name}, step {step}: p={schedule.num_ranks}, m={schedule.num_microbatches}, "
                 f"bubble {bubble:.1%} (predicted {predicted:.1%})")
        path = draw_step(per_rank, schedule.num_ranks, title, os.path.join(run_dir, f"timeline_step{step}.png"))
        if writer is not None:
            import matplotlib.image

            writer.add_image("timeline", matplotlib.image.imread(path)[..., :3], step, dataformats="HWC")
