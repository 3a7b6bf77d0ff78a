"""Lowering: a schedule (actions per rank) becomes programs (batched comm call + compute per step).

Step k of rank r posts, in one batched call, the sends produced by action k-1 and the recvs
needed by action k (Megatron's ``send_forward_recv_backward`` pairing), then runs action k.
A final step flushes the sends of the last action.  Transfers between two stages held by the
same rank need no communication and produce no op.

Under rendezvous semantics (a batch completes once every op in it has met its counterpart) that
simple pairing deadlocks for some schedules (interleaved and V-shaped ones at small p): a
sender can wait for a recv that its peer only posts after waiting for the sender.  So a recv
may be posted *earlier* than its consumer's step, at a step chosen from a dry run with unit
costs (F = B = W = 1, a full backward 2) in which every rank runs its actions in order, as soon
as their inputs exist (no rendezvous).  Call a step's *window* the time between the end of the
previous action (when the step's batch is posted) and the start of its own action.  A transfer
whose sender step X (right after the producer) and receiver step Y (at or before the consumer)
have overlapping windows completes without stalling either rank, so the recv goes to the latest
such Y; if there is none, to the latest Y posted no later than X's action starts.

Why this cannot deadlock: let e(Z) be the dry-run end time of step Z's action (a flush step
ends just after its producer).  A batch waits only for its own rank's previous step and, for
each op, for the step before its counterpart's step.  The placement guarantees
e(step before Y) <= start(X) < e(X) and e(producer) <= start(Y) < e(Y) (in the fallback,
e(Y) > start(X) >= e(producer) because the next step on Y's rank did not qualify), so every
wait points to a strictly earlier e: no cycle.  Keeping FIFO order per directed rank pair only
moves recvs earlier, which keeps both inequalities.  When the dry run cannot finish (the
schedule itself has a dependency cycle), the affected recvs stay at their consumer's step and
the simulator reports the deadlock with its grid.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

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

Times = list[list[tuple[float, float] | None]]  # [rank][index] -> (start, end) in the dry run


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
        Every send sits in a step after its producing action (the next one unless that would
        stall a rank), every recv in the step of its consuming action or an earlier one; the
        sends and recvs of a channel are posted in the same order (see the module docstring).
    """
    split = {(a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.kind == WEIGHT}
    placed = _placements(schedule, _dry_run(schedule, split))
    programs: list[Program] = []
    for r, actions in enumerate(schedule.actions):
        ops: dict[int, list[tuple[tuple, CommOp]]] = defaultdict(list)
        for k, action in enumerate(actions):
            for op in _safe(sends_produced, action, schedule):
                step, key = placed.get((r, op), (k + 1, (k,)))
                ops[step].append(((0, key, op.peer), op))
            for op in _safe(recvs_needed, action, schedule):
                step, key = placed.get((r, op), (k, (k,)))
                ops[step].append(((1, key, op.peer), op))
        steps: Program = []
        for k, action in enumerate(actions):
            weights = (action.stage, action.microbatch) not in split
            steps.append(Step(_sorted_ops(ops[k]), action, weights))
        if ops[len(actions)]:
            steps.append(Step(_sorted_ops(ops[len(actions)]), None))
        programs.append(steps)
    return programs


def _sorted_ops(keyed: list[tuple[tuple, CommOp]]) -> tuple[CommOp, ...]:
    """Sends before recvs; each channel's ops in the order of its transfers."""
    return tuple(op for _, op in sorted(keyed, key=lambda item: item[0]))


def _safe(ops_of, action: Action, schedule: PipelineSchedule) -> tuple[CommOp, ...]:
    """`ops_of(action)`, or no ops for an action outside the schedule (the simulator names it)."""
    if not 0 <= action.stage < schedule.num_stages:
        return ()
    return ops_of(action, schedule)


def _dependencies(action: Action, num_stages: int) -> list[Action]:
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(FORWARD, i, s - 1)] if s > 0 else []
    if action.kind == BACKWARD:
        return [Action(FORWARD, i, s)] + ([Action(BACKWARD, i, s + 1)] if s < num_stages - 1 else [])
    return [Action(BACKWARD, i, s)]


def _dry_run(schedule: PipelineSchedule, split: set[tuple[int, int]]) -> Times:
    """Unit-cost times of every action when ranks never wait on communication (None: never ran)."""
    actions, S = schedule.actions, schedule.num_stages
    times: Times = [[None] * len(acts) for acts in actions]
    ends: dict[Action, float] = {}
    nxt, clock = [0] * len(actions), [0.0] * len(actions)
    progressed = True
    while progressed:
        progressed = False
        for r, acts in enumerate(actions):
            while nxt[r] < len(acts):
                action = acts[nxt[r]]
                deps = [ends.get(d) for d in _dependencies(action, S)]
                if any(d is None for d in deps):
                    break
                start = max([clock[r]] + deps)
                full = action.kind == BACKWARD and (action.stage, action.microbatch) not in split
                clock[r] = ends[action] = start + (2.0 if full else 1.0)
                times[r][nxt[r]] = (start, clock[r])
                nxt[r], progressed = nxt[r] + 1, True
    return times


def _placements(schedule: PipelineSchedule, times: Times) -> dict[tuple[int, CommOp], tuple]:
    """Where each timed transfer goes: ``{(rank, op): (step, order key)}`` for both its ops.

    A channel (directed rank pair) with any transfer the dry run could not time is left out:
    its sends stay right after their producers and its recvs at their consumers.
    """
    where = {a: (r, k) for r, acts in enumerate(schedule.actions) for k, a in enumerate(acts)}
    windows = [_windows(rank_times) for rank_times in times]
    channels: dict[tuple[int, int], list[tuple[int, CommOp, int, int] | None]] = defaultdict(list)
    for a_rank, acts in enumerate(schedule.actions):
        for a, producer in enumerate(acts):
            for send in _safe(sends_produced, producer, schedule):
                b_rank, c = where.get(_consumer(send), (None, 0))
                timed = b_rank == send.peer and a + 1 < len(windows[a_rank])
                timed = timed and c < len(windows[b_rank])
                channels[a_rank, send.peer].append((a_rank, send, a, c) if timed else None)
    placed: dict[tuple[int, CommOp], tuple] = {}
    for (a_rank, b_rank), transfers in channels.items():
        if None in transfers:
            continue
        for _, send, a, c in transfers:  # type: ignore[misc]
            t, x, y = _meeting(windows[a_rank], a, windows[b_rank], c)
            recv = CommOp("recv", send.payload, send.microbatch, send.src_stage, send.dst_stage, a_rank)
            placed[a_rank, send] = (x, (t, a))
            placed[b_rank, recv] = (y, (t, a))
    return placed


def _consumer(send: CommOp) -> Action:
    kind = FORWARD if send.payload == ACTIVATION else BACKWARD
    return Action(kind, send.microbatch, send.dst_stage)


Windows = list[tuple[float, float]]  # [step] -> (post time, action start); a flush step last


def _windows(rank_times: list[tuple[float, float] | None]) -> Windows:
    """The dry-run window of each step of a rank, as far as the dry run got, plus the flush."""
    windows, post = [], 0.0
    for span in rank_times:
        if span is None:
            return windows
        windows.append((post, span[0]))
        post = span[1]
    return windows + [(post, post)]


def _meeting(a_windows: Windows, a: int, b_windows: Windows, c: int) -> tuple[float, int, int]:
    """(meeting time t, sender step x > a, receiver step y <= c) of one transfer.

    Prefers x = a + 1 and then the latest y; t lies in both windows, so neither rank stalls.
    If no pair of windows overlaps, falls back to x = a + 1 and the latest y posted by the
    time x's action starts (deadlock-free, but one rank waits).
    """
    posts = [post for post, _ in b_windows[: c + 1]]
    for x in range(a + 1, len(a_windows)):
        low, high = a_windows[x]
        if low > b_windows[c][1]:
            break
        y = bisect_right(posts, high) - 1
        if b_windows[y][1] >= low:
            return min(high, b_windows[y][1]), x, y
    high = a_windows[a + 1][1]
    return high, a + 1, max(bisect_right(posts, high) - 1, 0)
