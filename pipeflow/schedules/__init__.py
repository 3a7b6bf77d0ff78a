"""Schedules as data: the IR, pure generators, lowering and the simulator (no torch here).

A generator registers itself where it is defined (``@register_schedule(name, stages_per_rank=...,
placements=..., closed_form=...)``, see registry.py); importing this package registers the built-in ones.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeflow.errors import ScheduleError
from pipeflow.schedules.custom import load_schedule
from pipeflow.schedules.generators import (
    forward_only,
    gpipe,
    interleaved_1f1b,
    loop_placement,
    looped_bfs,
    one_f_one_b,
    relabel_ranks,
    v_placement,
)
from pipeflow.schedules.ir import Action, CommOp, PipelineSchedule, Program, Step
from pipeflow.schedules.lowering import lower
from pipeflow.schedules.registry import GENERATORS, LAYOUTS, SCHEDULES, ClosedForm, ScheduleEntry, register_schedule
from pipeflow.schedules.simulator import Bucket, RuntimeCosts, SimResult, simulate, validate
from pipeflow.schedules.zero_bubble import dualpipev, interleaved_zb, zb_h1, zbv
from pipeflow.schedules.controllable import v_half, v_min, zb_h2
from pipeflow.schedules.auto import StageCosts, Synthesis, auto, synthesize

PLACEMENTS: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "loop": loop_placement,
    "v": v_placement,
}

DEFAULT_STAGES_PER_RANK = 2  # for the schedules that take any count
CUSTOM = "custom"


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    placement: str | None = None,
    path: str | Path | None = None,
    stage_to_rank: list[int] | tuple[int, ...] | None = None,
) -> PipelineSchedule:
    """Generate the schedule called `name` for p ranks and m micro-batches.

    Args:
        name: a key of :data:`GENERATORS`, or ``custom`` to read `path`.
        num_ranks: p, pipeline ranks.
        num_microbatches: m.
        stages_per_rank: model chunks per rank; None picks the schedule's own (1 for gpipe,
            1f1b, zb_h1; 2 for zbv, dualpipev and, by default, interleaved_1f1b, interleaved_zb,
            looped_bfs).
        placement: ``loop`` or ``v``; None picks the schedule's own.
        path: the schedule file for ``custom`` (see :func:`load_schedule`).
        stage_to_rank: an explicit placement (``schedule.stage_to_rank``); it must rename the
            schedule's own ranks (:func:`relabel_ranks`).

    Raises:
        ScheduleError: for an unknown name (the message lists the valid ones), a stage count,
            placement or micro-batch count the schedule cannot use (the message names the
            valid values), or a custom file that is missing, malformed or disagrees with p, m.
    """
    schedule = _generate(name, num_ranks, num_microbatches, stages_per_rank, placement, path)
    return schedule if stage_to_rank is None else relabel_ranks(schedule, stage_to_rank)


def _generate(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None,
    placement: str | None,
    path: str | Path | None,
) -> PipelineSchedule:
    if name == CUSTOM:
        return _custom(path, num_ranks, num_microbatches, stages_per_rank, placement)
    if name not in SCHEDULES:
        valid = ", ".join(sorted(SCHEDULES) + [CUSTOM])
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {valid} (schedule=<name>)")
    entry = SCHEDULES[name]
    needed, placements = entry.stages_per_rank, entry.placements
    if placement is not None:
        _check_placement(name, placement, placements)
    if needed is None:
        count = DEFAULT_STAGES_PER_RANK if stages_per_rank is None else stages_per_rank
        return entry.generator(num_ranks, num_microbatches, count)
    if stages_per_rank is not None and stages_per_rank != needed:
        raise ScheduleError(
            f"schedule {name!r} needs schedule.stages_per_rank={needed} "
            f"({placements[0]} placement), got {stages_per_rank}"
        )
    return entry.generator(num_ranks, num_microbatches)


def _check_placement(name: str, placement: str, usable: tuple[str, ...]) -> None:
    if placement not in PLACEMENTS:
        valid = ", ".join(PLACEMENTS)
        raise ScheduleError(f"unknown placement {placement!r}; valid: {valid} (schedule.placement)")
    if placement not in usable:
        raise ScheduleError(
            f"schedule {name!r} cannot use schedule.placement={placement}; "
            f"it needs: {', '.join(usable)}"
        )


def _custom(
    path: str | Path | None,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None,
    placement: str | None,
) -> PipelineSchedule:
    if path is None:
        raise ScheduleError("schedule=custom needs the file of actions: set schedule.path=<file>")
    schedule = load_schedule(path)
    found = {
        "parallel.pp (pipeline ranks)": (num_ranks, schedule.num_ranks),
        "pipeline.num_microbatches": (num_microbatches, schedule.num_microbatches),
    }
    if stages_per_rank is not None:
        found["schedule.stages_per_rank"] = (stages_per_rank, schedule.num_stages / schedule.num_ranks)
    for key, (asked, got) in found.items():
        if asked != got:
            raise ScheduleError(f"custom schedule {path} has {key}={got:g}, but {asked} was asked")
    if placement is not None:
        _check_placement(CUSTOM, placement, tuple(PLACEMENTS))
        expected = PLACEMENTS[placement](schedule.num_ranks, schedule.num_stages // schedule.num_ranks)
        if expected != schedule.stage_to_rank:
            raise ScheduleError(
                f"custom schedule {path} places stages on ranks {list(schedule.stage_to_rank)}, "
                f"not by schedule.placement={placement} ({list(expected)})"
            )
    return schedule


__all__ = [
    "Action",
    "Bucket",
    "StageCosts",
    "Synthesis",
    "auto",
    "ClosedForm",
    "CommOp",
    "GENERATORS",
    "LAYOUTS",
    "PLACEMENTS",
    "PipelineSchedule",
    "Program",
    "SCHEDULES",
    "ScheduleEntry",
    "RuntimeCosts",
    "SimResult",
    "Step",
    "build_schedule",
    "dualpipev",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zb",
    "load_schedule",
    "loop_placement",
    "looped_bfs",
    "lower",
    "one_f_one_b",
    "register_schedule",
    "relabel_ranks",
    "simulate",
    "synthesize",
    "v_half",
    "v_min",
    "v_placement",
    "validate",
    "zb_h1",
    "zb_h2",
    "zbv",
]
