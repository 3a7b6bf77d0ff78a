"""The simulator's engine: every rank's program interpreted step by step as the runtime runs it
(post a step's ops, wait for its ``waits``, compute, wait for its ``after``), ops meeting their
counterparts in channel order, clocks advanced by the costs; what it measured as a
:class:`SimResult`.  A stuck state raises with :mod:`~pipeflow.schedules.deadlock_grid`'s picture."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeflow.errors import DeadlockError, ScheduleError
from pipeflow.schedules.deadlock_grid import cell, deadlock_grid
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action, CommOp, PipelineSchedule, Program, Step
from pipeflow.schedules.link_queue import Bucket, LinkQueues
from pipeflow.schedules.lowering import pair_posts, recvs_needed
from pipeflow.schedules.offload import Group, HostLink, OffloadCosts

CostFn = Callable[[Action], float]
Channel = tuple[int, int]  # (src rank, dst rank)
TransferFn = Callable[[CommOp], float]  # seconds from both sides posted to an op's completion


@dataclass
class SimResult:
    """What one simulated run of the programs measured.

    Attributes:
        makespan: time at which the last rank finishes.
        busy: ``busy[r]``, total compute time of rank r.
        bubble: idle fraction, ``1 - sum(busy) / (p * makespan)``.
        peak_activations: ``peak_activations[r]``, most (stage, micro-batch) pairs on rank r
            whose F has run and last backward (W, or B if no W follows) has not; 0 forward-only.
        peak_memory: ``peak_memory[r]``, the same pairs weighted by their micro-batch's size
            (``microbatch_sizes``; with sizes of 1, ``peak_activations``).
        timeline: ``(rank, action, start, end)`` of every compute action, by start time then rank.
        finish: ``finish[r]``, when rank r's program ends.
        events: ``events[r]``, rank r's ``(kind, name, start, end)`` as the runtime records them
            (``comm`` for a step's post and waits, the action's kind for its compute, ``comm``
            named ``sends of the step done`` for its ``after``), in program order.
        peak_unsharded: ``peak_unsharded[r]``, most stages whose full (gathered) parameters
            rank r holds at once: between a stage's ``unshard`` and ``reshard`` points
            (``parallel.shard=full``); 0 for programs without them.
        shard_timeline: ``(rank, what, start, end)`` of every gather (``unshard 0``) and
            reduction (``reshard 0``) at the programs' shard points; empty without them.
        step_times: ``step_times[r][k]``: (post, action start, action end) of rank r's step k
            (a step without an action: its end twice).
        offloaded_bytes: ``offloaded_bytes[r]``, bytes rank r copies to the host in the step
            (``Step.offload``; each comes back once).
        reload_waits: per offloaded group, how long its B waited for its reload to end.
        offload_ends: per offloaded group, when its copy to the host ends (its device memory is
            free from then on).
    """

    makespan: float
    busy: list[float]
    bubble: float
    peak_activations: list[int]
    timeline: list[tuple[int, Action, float, float]]
    peak_memory: list[float]
    peak_unsharded: list[int] = field(default_factory=list)
    shard_timeline: list[tuple[int, str, float, float]] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    events: list[list[tuple[str, str, float, float]]] = field(default_factory=list)
    step_times: list[list[tuple[float, float, float]]] = field(default_factory=list)
    offloaded_bytes: list[float] = field(default_factory=list)
    reload_waits: dict[Group, float] = field(default_factory=dict)
    offload_ends: dict[Group, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeCosts:
    """What the runtime adds to the compute when it interprets a program (all seconds, per rank).

    Attributes:
        transfer: an op completes this long after both of its sides are posted (default: the
            ``comm_latency`` of :func:`simulate`); a function of the op (its bytes).
        step_overhead: ``step_overhead[r]``, rank r's own time before each program step
            (interpreting it, recording it).
        post: ``post[r]``, rank r's time to post a step's ops (a step that posts none: 0).
        start: ``start[r]``, when rank r's program starts.
        offload: each activation group's bytes and the host link, timing the programs' offload
            marks (``pipeline.offload``; the `offload` argument of :func:`simulate`).
        exchanges: the communication inside an action's cost (an MoE layer's ``all_to_all``) as
            (seconds, how many exchanges): an overlapped pair (``Step.paired``) hides it behind
            the other action's compute (:func:`overlapped_pair`).  None: actions hold none.
        bucket: the :class:`Bucket` an op's transfer goes through (None: the op costs
            ``transfer`` alone, whatever else its link carries).  The transfers of one directed
            pair of ranks share its bucket, in channel order.
    """

    transfer: TransferFn | None = None
    step_overhead: Sequence[float] = ()
    post: Sequence[float] = ()
    start: Sequence[float] = ()
    offload: OffloadCosts | None = None
    exchanges: Callable[[Action], tuple[float, int]] | None = None
    bucket: Callable[[CommOp], Bucket | None] | None = None

    def of(self, what: Sequence[float], r: int) -> float:
        """`what`'s value for rank r (0 where not given)."""
        return float(what[r]) if r < len(what) else 0.0


def step_cost(step: Step, cost: CostFn) -> float:
    """The compute time of `step`'s action (a B that also computes weight gradients: B + W; none: 0)."""
    action = step.action
    if action is None:
        return 0.0
    if action.kind == BACKWARD and step.backward_weights:
        return cost(action) + cost(Action(WEIGHT, action.microbatch, action.stage))
    return cost(action)


def action_segments(step: Step, cost: CostFn, exchanges: Callable[[Action], tuple[float, int]] | None
                    ) -> list[float]:
    """`step`'s action as alternating compute and communication: ``[c, x, c, ..., c]``, its n
    exchanges (`exchanges` of the action: a full backward's are its B's) evenly spread through
    its compute, or ``[cost]`` when it holds none."""
    total = step_cost(step, cost)
    action = step.action
    if action is None or exchanges is None:
        return [total]
    comm, n = exchanges(action)
    comm = min(max(comm, 0.0), total)
    if n <= 0:
        return [total]
    compute = (total - comm) / (n + 1)
    return [compute] + [comm / n, compute] * n


def overlapped_pair(first: Sequence[float], second: Sequence[float], second_ready: float = 0.0
                    ) -> tuple[float, float, float]:
    """(end of the first action, start of the second, end of both) of an overlapped pair, from its
    start, as the runtime runs it (:mod:`pipeflow.runtime.overlap`): one action computes at a time;
    the one computing reaches a communication point (a `segments` entry at an odd index), starts
    it and hands over to the other, and continues once it is handed back and its communication
    is done.  Communications of the pair share the link, one after the other.  The second
    computes no earlier than `second_ready` (its inputs' arrival).  With no communication this is
    the first action then the second."""
    parts, at, ready = (list(first), list(second)), [0, 0], [0.0, 0.0]
    ends: list[float | None] = [None, None]
    started, now, link, turn = 0.0, 0.0, 0.0, 0
    while ends[0] is None or ends[1] is None:
        if turn == 1 and at[1] == 0:
            started = now = max(now, second_ready)
        now = max(now, ready[turn]) + parts[turn][at[turn]]
        at[turn] += 1
        if at[turn] < len(parts[turn]):  # a communication point: start it, hand over
            begin = max(now, link)
            ready[turn] = link = begin + parts[turn][at[turn]]
            at[turn] += 1
        else:
            ends[turn] = now
        if ends[1 - turn] is None:
            turn = 1 - turn
    return float(ends[0]), started, max(float(ends[0]), float(ends[1]))


class _Posted(NamedTuple):
    rank: int
    step: int
    op: CommOp
    time: float


_Slot = tuple[_Posted, list[_Posted], int]  # (this op, the counterpart queue, index in it)
_POST, _WAIT, _AFTER, _PAIR = range(4)  # the phases of a step (_PAIR: an overlapped pair's B waits to start)


def _counterpart(slot: _Slot) -> _Posted | None:
    """The op matched with the slot's op, or None while it has not been posted."""
    _, theirs, index = slot
    return theirs[index] if index < len(theirs) else None


def _dependencies(action: Action, num_stages: int) -> list[Action]:
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(FORWARD, i, s - 1)] if s > 0 else []
    if action.kind == BACKWARD:
        later = [Action(BACKWARD, i, s + 1)] if s < num_stages - 1 else []
        return [Action(FORWARD, i, s)] + later
    return [Action(BACKWARD, i, s)]


class Simulation:
    """The state of every rank while the programs execute.

    A rank's step goes through three phases: post its ops, wait for ``waits`` and compute, wait
    for ``after``.  Each phase either completes (advancing the rank's clock) or blocks on ops
    whose counterparts are not posted yet.
    """

    def __init__(
        self, schedule: PipelineSchedule, programs: list[Program], cost: CostFn, runtime: RuntimeCosts,
        sizes: list[float], shard_cost: float = 0.0, offload: OffloadCosts | None = None,
    ) -> None:
        p = schedule.num_ranks
        self.offload = offload
        self.link = offload.link if offload is not None else HostLink(math.inf, math.inf)
        self.d2h_free, self.h2d_free = [0.0] * p, [0.0] * p  # when each rank's copy links are free
        self.offloaded_by: dict[Group, float] = {}  # when a group's copy to the host ends
        self.reloaded_by: dict[Group, float] = {}  # when its copy back ends
        self.reload_waits: dict[Group, float] = {}
        self.offloaded_bytes = [0.0] * p
        self.step_times: list[list[tuple[float, float, float]]] = [[] for _ in range(p)]
        self.schedule, self.programs, self.cost, self.sizes = schedule, programs, cost, sizes
        self.runtime, self.transfer = runtime, runtime.transfer
        self.shard_cost = shard_cost
        self.unsharded, self.peak_unsharded = [0] * p, [0] * p  # stages with gathered parameters
        self.shard_timeline: list[tuple[int, str, float, float]] = []
        self.queues: dict[tuple[Channel, bool], list[_Posted]] = defaultdict(list)  # by is_send
        self.next_step, self.phase, self.busy = [0] * p, [_POST] * p, [0.0] * p
        self.clock = [runtime.of(runtime.start, r) for r in range(p)]
        self.events: list[list[tuple[str, str, float, float]]] = [[] for _ in range(p)]
        self.posted_at = [0.0] * p  # when the current step's ops were posted
        self.live, self.peak = [0] * p, [0] * p
        self.held, self.peak_memory = [0.0] * p, [0.0] * p  # the same, weighted by micro-batch size
        self.posted: list[dict[CommOp, _Slot]] = [{} for _ in range(p)]  # posted, not waited for yet
        self.received: list[set[CommOp]] = [set() for _ in range(p)]
        self.finished_at: dict[Action, float] = {}
        self.timeline: list[tuple[int, Action, float, float]] = []
        self.pair_second: list[tuple[float, float] | None] = [None] * p  # (start, end) of a pair's B to come
        self.pair_waited = [False] * p  # the B of the pair to come waited for its recvs at the pair's start
        self.arrivals: dict[Channel, list[float]] = defaultdict(list)  # bucketed transfers' ends, in channel order
        self.links = LinkQueues()

    def run(self) -> SimResult:
        """Advance every rank as far as it goes until all finish; raise on a deadlock."""
        p = self.schedule.num_ranks
        while any(self.next_step[r] < len(self.programs[r]) for r in range(p)):
            progressed = False
            for r in range(p):
                while self._advance(r):
                    progressed = True
            if not progressed:
                self._raise_deadlock()
        makespan = max(self.clock, default=0.0)
        bubble = 1.0 - sum(self.busy) / (p * makespan) if makespan > 0 else 0.0
        self.timeline.sort(key=lambda entry: (entry[2], entry[0]))
        return SimResult(makespan, self.busy, bubble, self.peak, self.timeline, self.peak_memory, self.peak_unsharded,
                         self.shard_timeline, list(self.clock), self.events, self.step_times, self.offloaded_bytes,
                         self.reload_waits, self.offloaded_by)

    def _advance(self, r: int) -> bool:
        k = self.next_step[r]
        if k >= len(self.programs[r]):
            return False
        step, phase = self.programs[r][k], self.phase[r]
        if phase == _PAIR:
            return self._start_pair(r, k, step)
        if phase == _POST:
            self.clock[r] += self.runtime.of(self.runtime.step_overhead, r)
            if not step.paired:  # a paired step's reloads and recvs were issued at the pair's start
                self._reload(r, step)
            self.posted_at[r] = self.clock[r]
            for op in pair_posts(step)[1] if step.paired else step.ops:
                self.posted[r][op] = self._post(_Posted(r, k, op, self.clock[r]))
            if step.ops:
                self.clock[r] += self.runtime.of(self.runtime.post, r)
            # the reductions of stages done (blocking), then the gathers for this action start,
            # one after another (the action waits for the last in the WAIT phase)
            c = self.shard_cost
            for j, s in enumerate(step.reshard):
                self.shard_timeline.append((r, f"reshard {s}", self.clock[r] + j * c, self.clock[r] + (j + 1) * c))
            self.clock[r] += c * len(step.reshard)
            for j, s in enumerate(step.unshard):
                self.shard_timeline.append((r, f"unshard {s}", self.clock[r] + j * c, self.clock[r] + (j + 1) * c))
            self.unsharded[r] += len(step.unshard) - len(step.reshard)
            self.peak_unsharded[r] = max(self.peak_unsharded[r], self.unsharded[r])
            self.phase[r] = _WAIT
            return True
        waits = self._waits(r, step)
        done = self._wait(r, waits if phase == _WAIT else step.after)
        if done is None:
            return False
        if phase == _WAIT:  # the gathers started at the rank's clock, after the reductions
            if step.paired:  # as the runtime records a pair's second: its waits only (its ops went out in the pair)
                if waits:
                    self.events[r].append(("comm", "; ".join(str(op) for op in waits), self.posted_at[r], done))
            elif step.ops or waits:
                self.events[r].append(("comm", step.ops_text or "; ".join(str(op) for op in waits),
                                       self.posted_at[r], done))
            start = max(done, self.clock[r] + self.shard_cost * len(step.unshard))
            following = self.programs[r][k + 1] if k + 1 < len(self.programs[r]) else None
            if following is not None and following.paired and step.action is not None:
                self._open_pair(r, k, following, start)
                return True
            self._compute(r, k, step, start)
            self.phase[r] = _AFTER
        else:
            if step.after:
                self.events[r].append(("comm", "sends of the step done", self.clock[r], done))
            self.clock[r] = done
            self.next_step[r], self.phase[r] = k + 1, _POST
        return True

    def _reload(self, r: int, step: Step) -> None:
        """Issue `step`'s reloads at rank r's clock; the B waits for the copy's end."""
        for g in step.reload:
            start = max(self.clock[r], self.h2d_free[r], self.offloaded_by.get(g, 0.0))
            end = self.h2d_free[r] = self.reloaded_by[g] = start + self.link.h2d_s(self._group_bytes(g))
            self.events[r].append(("h2d", f"reload {g[0]}:{g[1]}", start, end))
            if not self.link.overlapped:
                self.clock[r] = end

    def _waits(self, r: int, step: Step) -> tuple[CommOp, ...]:
        """What rank r waits for before `step`'s action: none for a pair's B that waited at the
        pair's start (:meth:`_start_pair`)."""
        return () if step.paired and self.pair_waited[r] else step.waits

    def _open_pair(self, r: int, k: int, second: Step, start: float) -> None:
        """An overlapped pair starts at `start` (step k's waits done): the paired step's reloads
        are issued and its recvs posted, then (:meth:`_start_pair`) the actions are timed from
        the rank's clock (past the reloads where they take the rank's own time)."""
        self.clock[r] = start
        self._reload(r, second)
        for op in pair_posts(second)[0]:
            self.posted[r][op] = self._post(_Posted(r, k + 1, op, self.clock[r]))
        self.phase[r] = _PAIR

    def _start_pair(self, r: int, k: int, step: Step) -> bool:
        """Time the pair of steps k and k + 1 as the runtime runs it (:func:`overlapped_pair`).
        Where the F has a communication point the B may compute before the F ends, so it waits
        for its recvs first (blocked until their counterparts are posted)."""
        second = self.programs[r][k + 1]
        segments = [action_segments(s, self.cost, self.runtime.exchanges) for s in (step, second)]
        start = self.clock[r]
        if len(segments[0]) == 1:  # no point where the F hands over: F, then the B as usual
            self._compute(r, k, step, start)
            self.phase[r] = _AFTER
            return True
        ready = self._wait(r, second.waits)
        if ready is None:
            return False
        self.pair_waited[r] = True
        first_end, second_start, both_end = overlapped_pair(*segments, max(0.0, ready - start))
        self.pair_second[r] = (start + second_start, start + both_end)
        self._compute(r, k, step, start, end=start + first_end)
        self.phase[r] = _AFTER
        return True

    def _wait(self, r: int, ops: tuple[CommOp, ...]) -> float | None:
        """When rank r's wait for `ops` ends, or None while a counterpart is not posted."""
        slots = [self.posted[r][op] for op in ops]
        others = [_counterpart(slot) for slot in slots]
        if any(other is None for other in others):
            return None
        for op in ops:
            del self.posted[r][op]
            if not op.is_send:
                self.received[r].add(op)
        return max([self.clock[r]] + [self._arrival(s, o) for s, o in zip(slots, others) if o])

    def _arrival(self, slot: _Slot, other: _Posted) -> float:
        """When the transfer of `slot`'s op (its counterpart `other` posted) completes."""
        posted, _, index = slot
        op = posted.op
        if self.runtime.bucket is None or self.runtime.bucket(op) is None:
            return max(posted.time, other.time) + self.transfer(op)
        channel = (posted.rank, op.peer) if op.is_send else (op.peer, posted.rank)
        ends = self.arrivals[channel]
        while len(ends) <= index:  # earlier transfers of the channel first: they queue ahead of it
            send, recv = self.queues[channel, True][len(ends)], self.queues[channel, False][len(ends)]
            bucket = self.runtime.bucket(send.op)
            assert bucket is not None
            ends.append(self.links.through(channel, bucket, max(send.time, recv.time), self.transfer(send.op)))
        return ends[index]

    def _waiting_on(self, r: int, k: int) -> list[_Slot]:
        """The posted ops rank r waits for in its current phase of step k."""
        if self.phase[r] == _POST:
            return []
        step = self.programs[r][k]
        if self.phase[r] == _PAIR:
            return [self.posted[r][op] for op in self.programs[r][k + 1].waits]
        return [self.posted[r][op] for op in (self._waits(r, step) if self.phase[r] == _WAIT else step.after)]

    def _post(self, posted: _Posted) -> _Slot:
        """Queue one op on its channel; the k-th send there meets the k-th recv."""
        r, op = posted.rank, posted.op
        if op.is_send and op.producer not in self.finished_at:
            at = f"rank {r} step {posted.step}"
            raise ScheduleError(f"{at}: {op.describe()} before {op.producer} has run")
        channel = (r, op.peer) if op.is_send else (op.peer, r)
        mine, theirs = self.queues[channel, op.is_send], self.queues[channel, not op.is_send]
        slot = (posted, theirs, len(mine))
        mine.append(posted)
        other = _counterpart(slot)
        if other is not None and not op.matches(other.op):
            raise ScheduleError(
                f"misordered transfer #{slot[2]} from rank {channel[0]} to rank {channel[1]}: "
                f"rank {r} step {posted.step} posts '{op.describe()}' but rank {other.rank} "
                f"step {other.step} posts '{other.op.describe()}'"
            )
        return slot

    def _group_bytes(self, g: Group) -> float:
        return self.offload.group_bytes(g) if self.offload is not None else 0.0

    def _compute(self, r: int, k: int, step: Step, start: float, end: float | None = None) -> None:
        """Run `step`'s action from `start` (to `end` where a pair's timing fixed it)."""
        action = step.action
        group = (action.stage, action.microbatch) if action is not None else None
        if action is not None and action.kind == BACKWARD and group in self.reloaded_by:
            ready = max(start, self.reloaded_by[group])
            self.reload_waits[group] = ready - start
            start = ready
        end = start + step_cost(step, self.cost) if end is None else end
        shown = start  # where the action is drawn from: a pair's B from when it first computed
        if step.paired and self.pair_second[r] is not None:
            second_start, both_end = self.pair_second[r]
            self.pair_second[r], self.pair_waited[r] = None, False
            end, shown = max(both_end, start), min(second_start, start)
        self.clock[r] = end
        self.step_times[r].append((self.posted_at[r], start, end))
        for g in step.offload:  # the copy to the host starts when the F is done and the link free
            nbytes = self._group_bytes(g)
            begin = max(end, self.d2h_free[r])
            done = self.d2h_free[r] = self.offloaded_by[g] = begin + self.link.d2h_s(nbytes)
            self.offloaded_bytes[r] += nbytes
            self.events[r].append(("d2h", f"offload {g[0]}:{g[1]}", begin, done))
            if not self.link.overlapped:
                self.clock[r] = done
        if action is None:
            return
        self._check_inputs(r, k, action, shown)
        self.finished_at[action] = end
        self.busy[r] += end - start
        self.timeline.append((r, action, shown, end))
        self.events[r].append((action.kind, str(action), shown, end))
        if not self.schedule.training:
            return
        size = self.sizes[action.microbatch]
        if action.kind == FORWARD:
            self.live[r] += 1
            self.held[r] += size
            self.peak[r] = max(self.peak[r], self.live[r])
            self.peak_memory[r] = max(self.peak_memory[r], self.held[r])
        elif action.kind == WEIGHT or step.backward_weights:
            self.live[r] -= 1
            self.held[r] -= size

    def _check_inputs(self, r: int, k: int, action: Action, start: float) -> None:
        for need in _dependencies(action, self.schedule.num_stages):
            if self.finished_at.get(need, float("inf")) > start:
                raise ScheduleError(f"rank {r} step {k}: {action} runs before {need} has finished")
        for recv in recvs_needed(action, self.schedule):
            if recv not in self.received[r]:
                raise ScheduleError(
                    f"rank {r} step {k}: {action} runs without its input ({recv.describe()})"
                )

    def _raise_deadlock(self) -> None:
        stuck = {r: k for r, k in enumerate(self.next_step) if k < len(self.programs[r])}
        waiting = []
        for r, k in stuck.items():
            slots = self._waiting_on(r, k)
            ops = "; ".join(s[0].op.describe() for s in slots if _counterpart(s) is None)
            waiting.append(f"rank {r} step {k} ({cell(self.programs[r][k])}) waits on: {ops}")
        where = ", ".join(f"rank {r} at step {k}" for r, k in stuck.items())
        grid = deadlock_grid(self.programs, stuck) + "\n" + "\n".join(waiting)
        message = f"deadlock in schedule {self.schedule.name!r}: no rank can progress ({where})"
        raise DeadlockError(message, grid)
