"""Lowering: a schedule (actions per rank) becomes programs (batched comm call + compute per step).

Step k of rank r posts, in one batched call, the sends produced by action k-1 and the recvs
needed by action k (Megatron's ``send_forward_recv_backward`` pairing), then runs action k.
A final step flushes the sends of the last action.  Transfers between two stages held by the
same rank need no communication and produce no op.
"""
from __future__ import annotations

from pipeflow.schedules.ir import (
    ACTIVATION,
    BACKWARD,
    FORWARD,
    GRADIENT,
    WEIGHT,
    Action,
    CommOp,
    PipelineSchedule,
    Program,
    Step,
)


def recvs_needed(action: Action, schedule: PipelineSchedule) -> tuple[CommOp, ...]:
    """The recvs that must complete before `action` can run on its rank."""
    s, i, owner = action.stage, action.microbatch, schedule.stage_to_rank
    if action.kind == FORWARD and s > 0 and owner[s - 1] != owner[s]:
        return (CommOp("recv", ACTIVATION, i, s - 1, s, owner[s - 1]),)
    if action.kind == BACKWARD and s < schedule.num_stages - 1 and owner[s + 1] != owner[s]:
        return (CommOp("recv", GRADIENT, i, s + 1, s, owner[s + 1]),)
    return ()


def sends_produced(action: Action, schedule: PipelineSchedule) -> tuple[CommOp, ...]:
    """The sends that `action` produces for other ranks."""
    s, i, owner = action.stage, action.microbatch, schedule.stage_to_rank
    if action.kind == FORWARD and s < schedule.num_stages - 1 and owner[s + 1] != owner[s]:
        return (CommOp("send", ACTIVATION, i, s, s + 1, owner[s + 1]),)
    if action.kind == BACKWARD and s > 0 and owner[s - 1] != owner[s]:
        return (CommOp("send", GRADIENT, i, s, s - 1, owner[s - 1]),)
    return ()


def lower(schedule: PipelineSchedule) -> list[Program]:
    """Lower every rank's actions into its program of steps.

    Returns:
        ``programs[r]``: rank r's steps, the last one flushing the sends of its last action.
    """
    split = {(a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.kind == WEIGHT}
    programs: list[Program] = []
    for actions in schedule.actions:
        steps: Program = []
        pending: tuple[CommOp, ...] = ()
        for action in actions:
            weights = (action.stage, action.microbatch) not in split
            steps.append(Step(pending + recvs_needed(action, schedule), action, weights))
            pending = sends_produced(action, schedule)
        if pending:
            steps.append(Step(pending, None))
        programs.append(steps)
    return programs
