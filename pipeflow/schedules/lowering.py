"""Lowering: a schedule (actions per rank) becomes programs (batched comm call + compute per step).

Each step of a rank posts one batched call, waits for all of it, then runs its action (a final
step may only flush sends).  Transfers between two stages held by the same rank need no op.
Every send sits in a step after its producing action, every recv in the step of its consuming
action or an earlier one (the runtime keeps early arrivals in its inbox).

Where exactly: the simulator (and NCCL) complete a batch only once every op in it has met its
counterpart, so a transfer must be posted by both ranks at an instant when both are between
actions.  Take a planned timing (:mod:`~pipeflow.schedules.timing`, unit costs) and call a
step's *window* the interval from its post (the end of the previous action) to the start of
its own action.  For a transfer from producer P (rank A) to consumer C (rank B), the send goes
to the first step X after P whose window overlaps the window of some step Y <= C on B, the
recv to the latest such Y; at an instant t in both windows both batches are posted, so neither
rank stalls and the rendezvous run takes exactly the planned timing.  The asap timing (sends
never wait) is tried first; for GPipe and 1F1B it yields the plain pairing, the sends of the
previous action with the recvs of this one (Megatron's ``send_forward_recv_backward``).  Where
it leaves a transfer no such instant (neighbours busy with 2-unit full backwards offset by one:
interleaved 1F1B, DualPipeV), the rendezvous timing is used, which gives every transfer one.
The plain pairing would deadlock there, or misorder transfers on the channel that carries both
activations and gradients when p = 2 with the V placement.

Why no placement here can deadlock: a batch waits for its rank's previous step and, for each
op, for the step before the counterpart's step.  Let e(Z) be the planned end of step Z's
action (a flush step: just after its post).  Its counterpart Y is posted at e(step before Y)
<= t <= start(X) < e(X), so every wait points to a strictly smaller e: no cycle.  (If no
windows overlap, which the rendezvous timing rules out, X is the step after P and Y the latest
step <= C posted by start(X); both inequalities still hold.)  Per directed rank pair the
transfers are ordered by (t, producer), and X and Y grow with t, so the k-th send meets the
k-th recv.  Channels with a transfer the timing cannot place (an action off its stage's rank,
a dependency cycle in the schedule) keep the plain pairing, and the simulator names the fault.

Posting options.  Where each transfer goes is fixed above; *when* its ops are posted and
waited for is a lowering option, written into every step (``Step.ops``, ``waits``, ``after``):

- ``rendezvous``: each step posts its ops and waits for all of them before its action (what
  the placement argument above proves; strict, for debugging and before/after benchmarks).
- ``group``: one group per step that completes as a whole (NCCL's coalesced batch): waited
  before the action when it holds a recv, after it otherwise.
- ``at_step`` and ``ahead`` (backends whose ops complete one by one, gloo): each recv is waited
  for by the action that consumes it, each send after its step's action; ``ahead`` posts the
  recvs of step k + 1 in step k's call, so data lands while the rank computes.

Each only delays waits and advances posts relative to ``rendezvous``, so the proof carries
over; the simulator checks every option's programs anyway.

Sharded parameters (``lower(..., shard=True)``, ``parallel.shard=full``).  Each stage's
parameters are gathered once per pass and freed once: :func:`shard_points` marks the step of a
stage's first action on its rank with ``unshard`` (its parameters all-gathered before that
action) and the step after its last action with ``reshard`` (its gradients reduce-scattered
over the data-parallel group and its full parameters freed, once that step has posted its ops:
the sends of the stage's last action are on their way first, so the reduction never holds back
the neighbour waiting for them).  In a training pass a stage's last action is its last B or W,
so gradients are reduced once per step, never per micro-batch.

Where this differs from torch.distributed.pipelining (``_add_unshard_reshard``, which keeps up
to three stages of a rank gathered, prefetching the next ones, and reshards a stage only when
it drops out of that window or at the program's end; ``REDUCE_GRAD`` right after the stage's
last backward): here each stage is resharded and reduced in the step after its own last
action, so an early-finishing stage (the first chunk of an interleaved rank) frees its
parameters and reduces its gradients while the rank's other stages still run, and a stage is
gathered at its first action rather than prefetched ahead of it, so a rank holds full
parameters only for stages it has started and not finished (the gather still overlaps the
waits of that step).  The points move no transfer: a program with them runs the same
communication as one without.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections import defaultdict

from pipeflow.errors import ScheduleError
from pipeflow.schedules.ir import (
    ACTIVATION,
    BACKWARD,
    FORWARD,
    GRADIENT,
    Action,
    CommOp,
    PipelineSchedule,
    Program,
    Step,
)
from pipeflow.schedules.offload import OffloadPlan
from pipeflow.schedules.timing import Times, asap, rendezvous


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


POSTINGS = ("rendezvous", "group", "at_step", "ahead")


def lower(schedule: PipelineSchedule, posting: str = "rendezvous", shard: bool = False,
          offload: OffloadPlan | None = None, overlap: bool = False) -> list[Program]:
    """Lower every rank's actions into its program of explicit steps.

    Args:
        schedule: the schedule.
        posting: when ops are posted and waited for, one of :data:`POSTINGS` (module docstring).
        shard: mark where each stage's sharded parameters are gathered and freed
            (:func:`shard_points`; ``parallel.shard=full``).  False leaves the steps as they are.
        offload: mark which groups' activations go to the host after their F and where each
            comes back (``pipeline.offload``; :meth:`OffloadPlan.mark`).  None: no marks.
        overlap: run the schedule's overlapped pairs (``schedule.pairs``) interleaved
            (:func:`pair_steps`; ``pipeline.overlap_pairs``).  False runs each as F then B.

    Returns:
        ``programs[r]``: rank r's steps, the last one flushing the sends of its last action.
        Every send sits in a step after its producing action (the next one unless that would
        stall a rank), every recv in the step of its consuming action or an earlier one; the
        sends and recvs of a channel are posted in the same order (see the module docstring).
    """
    if posting not in POSTINGS:
        raise ScheduleError(f"unknown posting {posting!r}; valid: {', '.join(POSTINGS)}")
    split = schedule.split_backwards()
    sends = [[_safe(sends_produced, a, schedule) for a in acts] for acts in schedule.actions]
    placed = _placements(schedule, sends, split)
    programs: list[Program] = []
    for r, actions in enumerate(schedule.actions):
        ops: list[list[tuple[tuple, CommOp]]] = [[] for _ in range(len(actions) + 1)]
        for k, action in enumerate(actions):
            for op in sends[r][k]:
                step, key = placed.get(_key(r, op), (k + 1, (k,)))
                ops[step].append(((0, key, op.peer), op))
            for op in _safe(recvs_needed, action, schedule):
                step, key = placed.get(_key(r, op), (k, (k,)))
                ops[step].append(((1, key, op.peer), op))
        steps = [
            Step(_sorted_ops(ops[k]), action, (action.stage, action.microbatch) not in split)
            for k, action in enumerate(actions)
        ]
        programs.append(steps + ([Step(_sorted_ops(ops[-1]), None)] if ops[-1] else []))
    if posting != "rendezvous":
        programs = [_repost(program, posting) for program in programs]
    programs = [shard_points(program) for program in programs] if shard else programs
    programs = [offload.mark(program) for program in programs] if offload is not None else programs
    return [pair_steps(program, schedule.pairs_of(r)) for r, program in enumerate(programs)] if overlap else programs


def pair_steps(program: Program, starts: tuple[int, ...]) -> Program:
    """`program` with each overlapped pair (steps k and k + 1 for k in `starts`: an F, then a B of
    another stage and micro-batch) marked ``paired`` and lowered as the runtime runs it:

    - the pair starts once step k has posted its ops and waited for its ``waits``; the recvs of
      step k + 1 that the B consumes are then posted (a batched call of their own: :func:`pair_posts`),
      and the F computes;
    - the B waits for those recvs (step k + 1's ``waits``) when it first computes: at the F's
      first communication point (:mod:`~pipeflow.runtime.overlap`), or at its end;
    - step k + 1's other ops (the F's sends, recvs for later actions) are posted (a batched call)
      as soon as the F ends, while the B may still compute; they and step k's ``after`` are
      waited for once both actions end.

    Posts only move earlier and send waits later; the B's recv waits can move before the F's
    sends are posted, which the simulator checks for every program that runs (as if every action
    had a communication point).  Pairs that are not an F then a B of another stage and
    micro-batch, whose B step gathers or frees sharded parameters, or reloads what the F offloads,
    stay as they are.
    """
    steps = list(program)
    for k in starts:
        if k + 1 >= len(steps) or not _independent(steps[k].action, steps[k + 1].action):
            continue
        first, second = steps[k], steps[k + 1]
        if second.unshard or second.reshard or set(second.reload) & set(first.offload):
            continue  # (the B's reloads are issued when the pair starts: not of what its F offloads)
        needed = tuple(op for op in second.waits if not op.is_send and op.consumer == second.action)
        later = tuple(op for op in second.waits if op not in needed)
        steps[k] = dataclasses.replace(first, after=())
        steps[k + 1] = dataclasses.replace(second, waits=needed, after=first.after + later + second.after, paired=True)
    return steps


def pair_posts(step: Step) -> tuple[tuple[CommOp, ...], tuple[CommOp, ...]]:
    """A paired step's ops as (posted when the pair starts: the recvs its B waits for, posted
    when the F ends: the rest), two batched calls (see :func:`pair_steps`)."""
    return tuple(op for op in step.ops if op in step.waits), tuple(op for op in step.ops if op not in step.waits)


def _independent(first: Action | None, second: Action | None) -> bool:
    """Whether `first` (an F) and `second` (a B) can run interleaved: neither needs the other."""
    if first is None or second is None or first.kind != FORWARD or second.kind != BACKWARD:
        return False
    return (first.stage, first.microbatch) != (second.stage, second.microbatch)


def shard_points(program: Program) -> Program:
    """`program` with each of its stages unsharded at the step of the stage's first action and
    resharded at the step after its last, once the ops of that step are posted (a step with
    neither ops nor action is appended when the last action is the program's last step); see
    the module docstring."""
    first: dict[int, int] = {}
    done: dict[int, int] = {}  # the step after the stage's last action
    for k, step in enumerate(program):
        if step.action is not None:
            first.setdefault(step.action.stage, k)
            done[step.action.stage] = k + 1
    steps = list(program) + ([Step((), None)] if len(program) in done.values() else [])
    return [
        dataclasses.replace(step, unshard=tuple(s for s, at in first.items() if at == k),
                            reshard=tuple(s for s, at in done.items() if at == k))
        if k in first.values() or k in done.values() else step
        for k, step in enumerate(steps)
    ]


def _repost(program: Program, posting: str) -> Program:
    """A rendezvous program with the posts and waits of `posting` (same transfers, same steps)."""
    sends = [tuple(op for op in step.ops if op.is_send) for step in program]
    recvs = [tuple(op for op in step.ops if not op.is_send) for step in program]
    if posting == "group":
        return [Step(step.ops, step.action, step.backward_weights, step.ops if recvs[k] else (), () if recvs[k] else step.ops)
                for k, step in enumerate(program)]
    lead = 1 if posting == "ahead" else 0
    posts = [sends[k] + (recvs[0] if lead and k == 0 else ()) + (recvs[k + lead] if k + lead < len(program) else ())
             for k in range(len(program))]
    consumed_at = {step.action: k for k, step in enumerate(program) if step.action is not None}
    waits: list[list[CommOp]] = [[] for _ in program]
    for k, ops in enumerate(recvs):
        for op in ops:  # waited by its consumer; by the last step if it has none here (the simulator names that)
            waits[consumed_at.get(op.consumer, len(program) - 1)].append(op)
    return [Step(posts[k], step.action, step.backward_weights, tuple(waits[k]), sends[k])
            for k, step in enumerate(program)]


def _sorted_ops(keyed: list[tuple[tuple, CommOp]]) -> tuple[CommOp, ...]:
    """Sends before recvs; each channel's ops in the order of its transfers."""
    if len(keyed) < 2:
        return tuple(op for _, op in keyed)
    return tuple(op for _, op in sorted(keyed, key=lambda item: item[0]))


def _safe(ops_of, action: Action, schedule: PipelineSchedule) -> tuple[CommOp, ...]:
    """`ops_of(action)`, or no ops for an action outside the schedule (the simulator names it)."""
    if not 0 <= action.stage < schedule.num_stages:
        return ()
    return ops_of(action, schedule)


Windows = list[tuple[float, float]]  # [step] -> (post time, action start); the flush step last


def _placements(
    schedule: PipelineSchedule, sends: list[list[tuple[CommOp, ...]]], split: set[tuple[int, int]]
) -> dict[tuple, tuple]:
    """Where each transfer goes: ``{_key(rank, op): (step, order key)}`` for both of its ops.

    Placed from the asap timing when that leaves every transfer a meeting instant (no rank
    ever stalls), else from the rendezvous timing.  A channel (directed rank pair) with a
    transfer that cannot be timed (an action off its stage's rank, a dependency cycle) is left
    out: its sends stay right after their producers and its recvs at their consumers.
    """
    owner = schedule.stage_to_rank
    for r, acts in enumerate(schedule.actions):
        if any(not 0 <= a.stage < len(owner) or owner[a.stage] != r for a in acts):
            return {}
    where = {a: (r, k) for r, acts in enumerate(schedule.actions) for k, a in enumerate(acts)}
    placed, stalls = _place(where, sends, asap(schedule, split))
    if stalls:
        placed, _ = _place(where, sends, rendezvous(schedule, split))
    return placed


def _place(
    where: dict[Action, tuple[int, int]], sends: list[list[tuple[CommOp, ...]]], times: Times
) -> tuple[dict[tuple, tuple], int]:
    """The placements from one timing, and how many of them make a rank stall."""
    windows = [_windows(rank_times) for rank_times in times]
    posts = [[post for post, _ in rank_windows] for rank_windows in windows]
    channels: dict[tuple[int, int], list[tuple[CommOp, int, int] | None]] = defaultdict(list)
    for a_rank, rank_sends in enumerate(sends):
        for a, ops in enumerate(rank_sends):
            for send in ops:
                b_rank, c = where.get(send.consumer, (None, 0))
                timed = b_rank == send.peer and a + 1 < len(windows[a_rank])
                timed = timed and c < len(windows[send.peer])
                channels[a_rank, send.peer].append((send, a, c) if timed else None)
    placed: dict[tuple, tuple] = {}
    stalls = 0
    for (a_rank, b_rank), transfers in channels.items():
        if None in transfers:
            continue
        for send, a, c in transfers:  # type: ignore[misc]
            t, x, y, met = _meeting(windows[a_rank], a, windows[b_rank], posts[b_rank], c)
            placed[_key(a_rank, send)] = (x, (t, a))
            placed[b_rank, False, send.payload, send.microbatch, send.src_stage] = (y, (t, a))
            stalls += not met
    return placed, stalls


def _key(rank: int, op: CommOp) -> tuple:
    """(rank, is_send, payload, micro-batch, source stage): names one end of one transfer."""
    return (rank, op.is_send, op.payload, op.microbatch, op.src_stage)


def _windows(rank_times: list[tuple[float, float] | None]) -> Windows:
    """The window of each step of a rank, as far as the timing got, plus the flush step's."""
    windows, post = [], 0.0
    for span in rank_times:
        if span is None:
            return windows
        windows.append((post, span[0]))
        post = span[1]
    return windows + [(post, post)]


def _meeting(
    a_windows: Windows, a: int, b_windows: Windows, b_posts: list[float], c: int
) -> tuple[float, int, int, bool]:
    """(meeting time t, sender step x > a, receiver step y <= c, stall-free) of one transfer.

    The first sender step whose window overlaps a receiver window up to c, and the latest such
    receiver step; t lies in both windows, so neither rank stalls.  If no windows overlap
    (never with the rendezvous timing), x = a + 1 and y is the latest step posted by the time
    x's action starts: deadlock-free, but the receiver waits.
    """
    for x in range(a + 1, len(a_windows)):
        low, high = a_windows[x]
        if low > b_windows[c][1]:
            break
        y = bisect_right(b_posts, high, 0, c + 1) - 1
        if b_windows[y][1] >= low:
            return min(high, b_windows[y][1]), x, y, True
    high = a_windows[a + 1][1]
    return high, a + 1, max(bisect_right(b_posts, high, 0, c + 1) - 1, 0), False
