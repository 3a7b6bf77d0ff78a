"""The simulator's static checks of lowered programs, before anything runs: every action on its
rank and in range, each required once, B/W splits consistent, every op posted and waited once,
shard points and offload marks where they belong, and every channel's sends paired with recvs."""
from __future__ import annotations

from collections import defaultdict

from pipeflow.errors import ScheduleError
from pipeflow.schedules.ir import BACKWARD, FORWARD, KINDS, WEIGHT, Action, CommOp, PipelineSchedule, Program
from pipeflow.schedules.offload import Group

_MAX_PROBLEMS = 8  # problems listed in one error message


def _raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        listed = problems[:_MAX_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise ScheduleError(f"{what}:\n  " + "\n  ".join(listed))


def check_programs(schedule: PipelineSchedule, programs: list[Program]) -> None:
    """Placement, ranges and completeness of the actions and ops, before anything runs.

    Raises:
        ScheduleError: every problem found, listed (at most a few of each kind).
    """
    if len(programs) != schedule.num_ranks:
        raise ScheduleError(f"got {len(programs)} programs for {schedule.num_ranks} ranks")
    where: dict[Action, list[str]] = defaultdict(list)
    problems: list[str] = []
    for r, program in enumerate(programs):
        for k, step in enumerate(program):
            problems += [_op_problem(schedule, r, k, op) for op in step.ops]
            if step.action is not None:
                problems.append(_action_problem(schedule, r, k, step.action))
                where[step.action].append(f"rank {r} step {k}")
    name = repr(schedule.name)
    _raise_problems(f"invalid programs for schedule {name}", [p for p in problems if p])
    _raise_problems(f"incomplete schedule {name}", _completeness_problems(schedule, where))
    _raise_problems(f"inconsistent backward steps in {name}", _split_problems(programs, where))
    _raise_problems(f"inconsistent waits in {name}", [p for r, program in enumerate(programs) for p in _wait_problems(r, program)])
    if any(step.unshard or step.reshard for program in programs for step in program):
        _raise_problems(f"misplaced shard points in {name}",
                        [p for r, program in enumerate(programs) for p in _shard_problems(r, program)])
    if any(step.offload or step.reload for program in programs for step in program):
        _raise_problems(f"misplaced offload marks in {name}",
                        [p for r, program in enumerate(programs) for p in _offload_problems(schedule, r, program)])


def _offload_problems(schedule: PipelineSchedule, r: int, program: Program) -> list[str]:
    """Each offloaded group of rank r offloaded once, at the step of its own F, and reloaded once,
    after that step and at or before its B; nothing reloaded that was not offloaded."""
    if not schedule.training:
        return [f"rank {r}: a forward-only program offloads nothing (it keeps no activations)"]
    offloaded: dict[Group, list[int]] = defaultdict(list)
    reloaded: dict[Group, list[int]] = defaultdict(list)
    backward_at: dict[Group, int] = {}
    problems = []
    for k, step in enumerate(program):
        a = step.action
        for g in step.offload:
            offloaded[g].append(k)
            if a is None or a.kind != FORWARD or (a.stage, a.microbatch) != g:
                problems.append(f"rank {r} step {k}: offloads stage {g[0]} micro-batch {g[1]} after "
                                f"{a if a is not None else 'no action'}, not after its F")
        for g in step.reload:
            reloaded[g].append(k)
        if a is not None and a.kind == BACKWARD:
            backward_at[(a.stage, a.microbatch)] = k
    for g in sorted(set(offloaded) | set(reloaded)):
        where = f"rank {r}: stage {g[0]} micro-batch {g[1]}"
        if len(offloaded[g]) != 1 or len(reloaded[g]) != 1:
            problems.append(f"{where} is offloaded at steps {offloaded[g]} and reloaded at steps {reloaded[g]}; "
                            "expected once each")
        elif not offloaded[g][0] < reloaded[g][0] <= backward_at.get(g, -1):
            problems.append(f"{where} is reloaded at step {reloaded[g][0]}; expected after its F (step "
                            f"{offloaded[g][0]}) and at or before its B (step {backward_at.get(g)})")
    return problems


def _shard_problems(r: int, program: Program) -> list[str]:
    """Each stage of rank r unsharded once, at or before its first action, and resharded once,
    after its last; no shard point for a stage the rank does not run."""
    acting: dict[int, list[int]] = defaultdict(list)
    unshard: dict[int, list[int]] = defaultdict(list)
    reshard: dict[int, list[int]] = defaultdict(list)
    for k, step in enumerate(program):
        if step.action is not None:
            acting[step.action.stage].append(k)
        for s in step.unshard:
            unshard[s].append(k)
        for s in step.reshard:
            reshard[s].append(k)
    problems = [f"rank {r}: stage {s} has shard points at steps {unshard[s] + reshard[s]} but no action here"
                for s in sorted(set(unshard) | set(reshard)) if s not in acting]
    for s, steps in sorted(acting.items()):
        if len(unshard[s]) != 1 or unshard[s][0] > steps[0]:
            problems.append(f"rank {r}: stage {s} is unsharded at steps {unshard[s]}; expected once, at or before "
                            f"its first action (step {steps[0]})")
        if len(reshard[s]) != 1 or reshard[s][0] <= steps[-1]:
            problems.append(f"rank {r}: stage {s} is resharded at steps {reshard[s]}; expected once, after "
                            f"its last action (step {steps[-1]})")
    return problems


def _action_problem(schedule: PipelineSchedule, r: int, k: int, action: Action) -> str:
    at = f"rank {r} step {k}: {action}"
    if action.kind not in KINDS or (not schedule.training and action.kind != FORWARD):
        allowed = "F, B, W" if schedule.training else "only F (forward-only schedule)"
        return f"{at}: kind {action.kind!r} not allowed ({allowed})"
    out_of_range = _range_problem(schedule, (action.stage,), action.microbatch)
    if out_of_range:
        return f"{at}: {out_of_range}"
    if schedule.stage_to_rank[action.stage] != r:
        return f"{at}: stage {action.stage} belongs to rank {schedule.stage_to_rank[action.stage]}"
    return ""


def _op_problem(schedule: PipelineSchedule, r: int, k: int, op: CommOp) -> str:
    at, owner = f"rank {r} step {k}: {op.describe()}", schedule.stage_to_rank
    stages = (op.src_stage, op.dst_stage)
    out_of_range = _range_problem(schedule, stages, op.microbatch)
    if out_of_range:
        return f"{at}: {out_of_range}"
    mine, theirs = stages if op.is_send else stages[::-1]  # src_stage is the sender's
    if owner[mine] != r or owner[theirs] != op.peer or op.peer == r:
        return f"{at}: stage {mine} is on rank {owner[mine]}, {theirs} on rank {owner[theirs]}"
    return ""


def _wait_problems(r: int, program: Program) -> list[str]:
    """Every op waited exactly once, at or after the step that posts it, sends in their own step
    (or, for an overlapped pair's first step, in the pair's second: ``Step.paired``)."""
    problems, posted = [], {}
    for k, step in enumerate(program):
        posted.update((op, k) for op in step.ops)
        for op in step.waits + step.after:
            if op not in posted:
                problems.append(f"rank {r} step {k}: waits for '{op.describe()}', which is not posted by then or waited twice")
            elif op.is_send and posted[op] != k and not (step.paired and posted[op] == k - 1):
                problems.append(f"rank {r} step {k}: waits for '{op.describe()}', posted at step {posted[op]}")
            posted.pop(op, None)
    problems += [f"rank {r} step {k}: '{op.describe()}' is posted but never waited for" for op, k in posted.items()]
    return problems


def _range_problem(schedule: PipelineSchedule, stages: tuple[int, ...], microbatch: int) -> str:
    bad = [s for s in stages if not 0 <= s < schedule.num_stages]
    if bad:
        return f"stage {bad[0]} out of range 0..{schedule.num_stages - 1}"
    if not 0 <= microbatch < schedule.num_microbatches:
        return f"micro-batch {microbatch} out of range 0..{schedule.num_microbatches - 1}"
    return ""


def _completeness_problems(schedule: PipelineSchedule, where: dict[Action, list[str]]) -> list[str]:
    problems = []
    required = (FORWARD, BACKWARD) if schedule.training else (FORWARD,)
    for s in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            for kind in KINDS:
                action, found = Action(kind, i, s), where.get(Action(kind, i, s), [])
                owner = schedule.stage_to_rank[s]
                if kind in required and not found:
                    problems.append(f"missing {action} (stage {s} is on rank {owner})")
                elif len(found) > 1:
                    problems.append(f"{action} appears {len(found)} times: {', '.join(found)}")
    return problems


def _split_problems(programs: list[Program], where: dict[Action, list[str]]) -> list[str]:
    problems = []
    for r, program in enumerate(programs):
        for k, step in enumerate(program):
            if step.action is None or step.action.kind != BACKWARD:
                continue
            weight = Action(WEIGHT, step.action.microbatch, step.action.stage)
            if step.backward_weights == (weight in where):
                reason = "is also scheduled" if weight in where else "is never scheduled"
                problems.append(
                    f"rank {r} step {k}: {step.action} has backward_weights="
                    f"{step.backward_weights} but {weight} {reason}"
                )
    return problems


def check_channel_counts(programs: list[Program]) -> None:
    """Every send must meet a recv on its channel, or ops are left over at the end.

    Raises:
        ScheduleError: the channels whose sends and recvs do not pair up, with what is left over.
    """
    posted: dict[tuple[tuple[int, int], bool], list[str]] = defaultdict(list)
    for r, program in enumerate(programs):
        for k, step in enumerate(program):
            for op in step.ops:
                channel = (r, op.peer) if op.is_send else (op.peer, r)
                posted[channel, op.is_send].append(f"rank {r} step {k}: {op.describe()}")
    problems = []
    for src, dst in sorted({channel for channel, _ in posted}):
        sends, recvs = posted[(src, dst), True], posted[(src, dst), False]
        if len(sends) != len(recvs):
            left = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs)) :]
            problems.append(
                f"rank {src} -> rank {dst}: {len(sends)} sends, {len(recvs)} recvs; "
                f"left over: {'; '.join(left)}"
            )
    _raise_problems("unmatched comm ops would be left over at the end", problems)
