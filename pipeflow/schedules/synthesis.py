"""Schedules synthesised by list scheduling under a memory limit (the Zero Bubble paper's heuristic).

Time runs forward; whenever a rank is free it starts the best action it can: a B whose
gradient has arrived (it is on the critical path), else an F whose input has arrived and for
which memory allows, else a pending W (it frees memory and fills what would be a bubble).
Within a kind the earliest micro-batch goes first, and each stage runs each kind in
micro-batch order.  The order in which every rank started its actions is the schedule; the
simulator then lowers and proves it like any other.

Memory is counted as the simulator counts it: a (stage, micro-batch) pair is held from its F
until its W.  A micro-batch *enters* a rank with the F of the rank's lowest stage; entering
keeps ``v_r - 1`` pairs free (v_r = the rank's stage count) for the later stages of micro-batches
already inside, so the oldest micro-batch can always go on and no limit of at least ``v_r``
pairs deadlocks (with v_r <= 2: each later stage runs its Fs in micro-batch order; for more
stages per rank a micro-batch reserves all its pairs when it enters).  Pure, no torch.

Index letters as in :mod:`~pipeflow.schedules.ir`; costs are per (kind, stage).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeflow.errors import ScheduleError
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action, PipelineSchedule

StageCost = Callable[[str, int], float]  # (kind, stage) -> time


@dataclass(frozen=True)
class Policy:
    """Knobs of the list scheduler.

    Attributes:
        limit: pairs each rank may hold (``limit[r]``).
        w_first: run a pending W before an F when the rank already holds this many pairs
            (None: only when no F may run).
        late_stage_first: among ready Fs (and Bs) prefer the higher stage (depth first) rather
            than the earlier micro-batch.
        backward_first: a ready B before a ready F (the critical path first); False: F first
            (more in flight, for stages whose forwards are the bottleneck).
    """

    limit: tuple[int, ...]
    w_first: int | None = None
    late_stage_first: bool = True
    backward_first: bool = True


def unit_stage_cost(kind: str, stage: int) -> float:
    """F = B = W = 1 on every stage."""
    return 1.0


def list_schedule(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    policy: Policy,
    cost: StageCost = unit_stage_cost,
    comm: float = 0.0,
) -> PipelineSchedule:
    """The schedule the list scheduler builds for these stages, costs and memory policy.

    Args:
        name: the schedule's name.
        num_microbatches: m.
        stage_to_rank: the placement, ``stage_to_rank[s]``.
        policy: memory limits and tie-breaks (:class:`Policy`).
        cost: seconds (or units) of each kind on each stage.
        comm: time a transfer between two ranks takes.

    Raises:
        ScheduleError: a rank's limit is below its stage count (no micro-batch could pass).
    """
    p = max(stage_to_rank) + 1
    held = [sum(1 for owner in stage_to_rank if owner == r) for r in range(p)]
    short = [r for r in range(p) if policy.limit[r] < held[r]]
    if short:
        r = short[0]
        raise ScheduleError(
            f"{name}: rank {r} may hold {policy.limit[r]} (stage, micro-batch) activations but holds "
            f"{held[r]} stages; a micro-batch needs one per stage (raise the memory limit)"
        )
    return _ListScheduler(name, num_microbatches, tuple(stage_to_rank), policy, cost, comm).run()


class _ListScheduler:
    """The state of one list-scheduling run (see the module docstring)."""

    def __init__(self, name: str, m: int, owner: tuple[int, ...], policy: Policy, cost: StageCost,
                 comm: float) -> None:
        self.name, self.m, self.owner, self.policy, self.cost, self.comm = name, m, owner, policy, cost, comm
        self.S, self.p = len(owner), max(owner) + 1
        self.stages = [[s for s in range(self.S) if owner[s] == r] for r in range(self.p)]
        self.next = {(k, s): 0 for k in (FORWARD, BACKWARD, WEIGHT) for s in range(self.S)}
        self.ready_at = {Action(FORWARD, i, 0): 0.0 for i in range(m)}  # when an action's inputs are there
        self.inputs: dict[Action, tuple[int, float]] = {}  # inputs arrived so far, the latest's time
        self.live, self.committed = [0] * self.p, [0] * self.p  # pairs held; pairs promised
        self.actions: list[list[Action]] = [[] for _ in range(self.p)]
        self.free_at = [0.0] * self.p
        self.events: list[float] = [0.0]

    def run(self) -> PipelineSchedule:
        remaining = 3 * self.S * self.m
        while remaining:
            if not self.events:
                raise ScheduleError(f"{self.name}: the list scheduler is stuck (a memory limit too tight)")
            t = heapq.heappop(self.events)
            while self.events and self.events[0] <= t:
                heapq.heappop(self.events)
            for r in range(self.p):
                if self.free_at[r] <= t:
                    action = self._choose(r, t)
                    if action is not None:
                        self._start(r, action, t)
                        remaining -= 1
        return PipelineSchedule(self.name, self.p, self.S, self.m, self.owner, self.actions)

    def _candidate(self, kind: str, s: int, t: float) -> Action | None:
        i = self.next[kind, s]
        if i >= self.m:
            return None
        action = Action(kind, i, s)
        return action if self.ready_at.get(action, float("inf")) <= t else None

    def _choose(self, r: int, t: float) -> Action | None:
        order = self.stages[r][::-1] if self.policy.late_stage_first else self.stages[r]
        pending_w = [a for s in self.stages[r] if (a := self._candidate(WEIGHT, s, t))]
        if pending_w and self.policy.w_first is not None and self.live[r] >= self.policy.w_first:
            return min(pending_w, key=lambda a: a.microbatch)
        for kind in (BACKWARD, FORWARD) if self.policy.backward_first else (FORWARD, BACKWARD):
            ready = [a for s in order if (a := self._candidate(kind, s, t)) and self._fits(r, a)]
            if ready:
                return ready[0] if self.policy.late_stage_first else min(ready, key=lambda a: a.microbatch)
        return min(pending_w, key=lambda a: a.microbatch) if pending_w else None

    def _fits(self, r: int, action: Action) -> bool:
        if action.kind != FORWARD:
            return True
        count = len(self.stages[r])
        if action.stage != self.stages[r][0]:  # a later stage of a micro-batch already inside
            return count > 2 or self.live[r] + 1 <= self.policy.limit[r]
        if count > 2:  # reserve every pair of the micro-batch on entry
            return self.committed[r] + count <= self.policy.limit[r]
        return self.live[r] + count <= self.policy.limit[r]

    def _start(self, r: int, action: Action, t: float) -> None:
        end = t + self.cost(action.kind, action.stage)
        self.free_at[r] = end
        heapq.heappush(self.events, end)
        self.actions[r].append(action)
        kind, i, s = action
        self.next[kind, s] += 1
        if kind == FORWARD:
            self.live[r] += 1
            if s == self.stages[r][0]:
                self.committed[r] += len(self.stages[r])
            self._deliver(Action(BACKWARD, i, s), s, end)
            if s + 1 < self.S:
                self._deliver(Action(FORWARD, i, s + 1), s, end)
        elif kind == BACKWARD:
            self._deliver(Action(WEIGHT, i, s), s, end)
            if s > 0:
                self._deliver(Action(BACKWARD, i, s - 1), s, end)
        else:
            self.live[r] -= 1
            self.committed[r] -= 1

    def _deliver(self, consumer: Action, src_stage: int, end: float) -> None:
        """One input of `consumer` is there at `end` (same rank) or `end + comm`; a B below the
        last stage needs two (its own F and the next stage's B)."""
        at = end + (self.comm if self.owner[consumer.stage] != self.owner[src_stage] else 0.0)
        needed = 2 if consumer.kind == BACKWARD and consumer.stage < self.S - 1 else 1
        count, latest = self.inputs.pop(consumer, (0, 0.0))
        count, latest = count + 1, max(latest, at)
        if count < needed:
            self.inputs[consumer] = (count, latest)
            return
        self.ready_at[consumer] = latest
        heapq.heappush(self.events, latest)



def refill_weights(
    schedule: PipelineSchedule, limit: Sequence[int], cost: StageCost = unit_stage_cost, comm: float = 0.0
) -> PipelineSchedule:
    """`schedule` with every backward split and its Ws moved to where they cost least.

    Each rank keeps its order of Fs and Bs; in time, whenever its next F or B cannot start yet
    (its input has not arrived), or it holds `limit[r]` pairs or more, it runs its oldest ready
    W instead.  Fixed patterns put Ws at fixed points, which costs time where stages are uneven;
    this keeps their F/B order (which runs: it is the pattern's) and fills the gaps.  The memory
    limit is a preference here, not a guarantee: measure the result.
    """
    order = [[a for a in acts if a.kind != WEIGHT] for acts in schedule.actions]
    policy = Policy(tuple(limit), w_first=None)
    return _FixedOrder(schedule.name, schedule.num_microbatches, schedule.stage_to_rank, policy, cost, comm,
                       order).run()


class _FixedOrder(_ListScheduler):
    """The list scheduler with each rank's Fs and Bs in a given order; only the Ws move."""

    def __init__(self, name: str, m: int, owner: tuple[int, ...], policy: Policy, cost: StageCost, comm: float,
                 order: list[list[Action]]) -> None:
        super().__init__(name, m, owner, policy, cost, comm)
        self.order, self.position = order, [0] * self.p

    def _choose(self, r: int, t: float) -> Action | None:
        ready_w = [a for s in self.stages[r] if (a := self._candidate(WEIGHT, s, t))]
        oldest_w = min(ready_w, key=lambda a: a.microbatch, default=None)
        if oldest_w is not None and self.live[r] >= self.policy.limit[r]:
            return oldest_w
        k = self.position[r]
        if k < len(self.order[r]) and self.ready_at.get(self.order[r][k], float("inf")) <= t:
            self.position[r] += 1
            return self.order[r][k]
        return oldest_w
