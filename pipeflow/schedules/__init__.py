"""Schedules as data: the IR, pure generators, lowering and the simulator (no torch here)."""
from __future__ import annotations

from collections.abc import Callable

from pipeflow.errors import ScheduleError
from pipeflow.schedules.generators import forward_only, gpipe, loop_placement, one_f_one_b
from pipeflow.schedules.ir import Action, CommOp, PipelineSchedule, Program, Step
from pipeflow.schedules.lowering import lower
from pipeflow.schedules.simulator import SimResult, simulate, validate

GENERATORS: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def build_schedule(name: str, num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """Generate the schedule called `name` for p ranks and m micro-batches.

    Raises:
        ScheduleError: for an unknown name (the message lists the valid ones).
    """
    if name not in GENERATORS:
        valid = ", ".join(sorted(GENERATORS))
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {valid} (schedule=<name>)")
    return GENERATORS[name](num_ranks, num_microbatches)


__all__ = [
    "Action",
    "CommOp",
    "GENERATORS",
    "PipelineSchedule",
    "Program",
    "SimResult",
    "Step",
    "build_schedule",
    "forward_only",
    "gpipe",
    "loop_placement",
    "lower",
    "one_f_one_b",
    "simulate",
    "validate",
]
