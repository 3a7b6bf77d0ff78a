"""The plain pairing lowering, the reference the schedule tests hold ``lower()`` against."""
from __future__ import annotations

from pipeflow.schedules import PipelineSchedule, Program, Step
from pipeflow.schedules.lowering import recvs_needed, sends_produced


def pairing_lower(schedule: PipelineSchedule) -> list[Program]:
    """The plain pairing: sends of the previous action + recvs of this one, in one batch, no more."""
    split = {(a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.kind == "W"}
    programs = []
    for actions in schedule.actions:
        steps, pending = [], ()
        for action in actions:
            weights = (action.stage, action.microbatch) not in split
            steps.append(Step(pending + recvs_needed(action, schedule), action, weights))
            pending = sends_produced(action, schedule)
        programs.append(steps + ([Step(pending, None)] if pending else []))
    return programs
