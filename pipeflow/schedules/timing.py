"""Planned timings of a schedule, from which lowering decides where each transfer is posted.

Unit costs: F = B = W = 1, a full backward (no W follows) 2.  Three timings:

* ``asap``: every rank runs its actions in order, each as soon as its inputs exist, as if
  sends never waited (infinite buffers).  A lower bound for any lowering of that order.
* ``alap``: the latest start of every action that keeps the asap makespan (its slack).
* ``rendezvous``: like asap, but a transfer only happens at an instant when sender and
  receiver are both between actions, as in one batched call under rendezvous semantics.  A
  receiver that needs the data waits for the sender; a sender whose receiver is computing
  either waits for it or goes on with its next action (then the receiver may wait), whichever
  costs less against the alap slack.  Every transfer therefore has an instant where both ranks
  are between actions, so a program posting it there runs without stalls and takes exactly
  this timing.

Actions that cannot run (a dependency cycle in the schedule) keep no time (None).
"""
from __future__ import annotations

from collections import defaultdict

from pipeflow.schedules.ir import BACKWARD, FORWARD, Action, PipelineSchedule

Times = list[list[tuple[float, float] | None]]  # [rank][index] -> (start, end)


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions whose results `action` consumes (plain tuples, equal to the Actions)."""
    kind, i, s = action
    if kind == FORWARD:
        return [(FORWARD, i, s - 1)] if s > 0 else []  # type: ignore[list-item]
    if kind == BACKWARD:
        if s < num_stages - 1:
            return [(FORWARD, i, s), (BACKWARD, i, s + 1)]  # type: ignore[list-item]
        return [(FORWARD, i, s)]  # type: ignore[list-item]
    return [(BACKWARD, i, s)]  # type: ignore[list-item]


def unit_cost(action: Action, split: set[tuple[int, int]]) -> float:
    """1 per action; 2 for a backward that also computes weight grads (no W follows)."""
    full = action.kind == BACKWARD and (action.stage, action.microbatch) not in split
    return 2.0 if full else 1.0


def asap(schedule: PipelineSchedule, split: set[tuple[int, int]]) -> Times:
    """Each action as early as its rank and its inputs allow; sends never wait."""
    actions, S = schedule.actions, schedule.num_stages
    times: Times = [[None] * len(acts) for acts in actions]
    ends: dict[Action, float] = {}
    nxt, clock = [0] * len(actions), [0.0] * len(actions)
    progressed = True
    while progressed:
        progressed = False
        for r, acts in enumerate(actions):
            k, start = nxt[r], clock[r]
            while k < len(acts):
                action = acts[k]
                ready = start
                for need in dependencies(action, S):
                    end = ends.get(need)
                    if end is None:
                        break
                    ready = max(ready, end)
                else:
                    start = ends[action] = ready + unit_cost(action, split)
                    times[r][k] = (ready, start)
                    k += 1
                    continue
                break
            progressed = progressed or k > nxt[r]
            nxt[r], clock[r] = k, start
    return times


def alap_starts(schedule: PipelineSchedule, times: Times) -> dict[Action, float]:
    """Latest start of every timed action that keeps the makespan of `times`."""
    S = schedule.num_stages
    spans = {a: span for acts, row in zip(schedule.actions, times) for a, span in zip(acts, row) if span}
    makespan = max((end for _, end in spans.values()), default=0.0)
    successors: dict[Action, list[Action]] = defaultdict(list)
    for acts in schedule.actions:
        for before, after in zip(acts, acts[1:]):
            successors[before].append(after)
    for action in spans:
        for need in dependencies(action, S):
            successors[need].append(action)
    latest: dict[Action, float] = {}
    for action in sorted(spans, key=lambda a: -spans[a][0]):  # successors start later
        end = min([latest[b] for b in successors[action] if b in latest], default=makespan)
        latest[action] = end - (spans[action][1] - spans[action][0])
    return latest


def rendezvous(schedule: PipelineSchedule, split: set[tuple[int, int]]) -> Times:
    """Timing in which every transfer happens when both of its ranks are between actions."""
    return _Rendezvous(schedule, split).run()


class _Rendezvous:
    """Event-driven list scheduling; events are the ends of actions."""

    def __init__(self, schedule: PipelineSchedule, split: set[tuple[int, int]]) -> None:
        self.schedule, self.split = schedule, split
        self.latest = alap_starts(schedule, asap(schedule, split))
        self.owner = schedule.stage_to_rank
        p = len(schedule.actions)
        self.times: Times = [[None] * len(acts) for acts in schedule.actions]
        self.nxt, self.busy_until = [0] * p, [0.0] * p
        self.ends: dict[Action, float] = {}
        self.delivered: set[Action] = set()  # consumers whose remote input has arrived
        self.pending: dict[tuple[int, int], list[Action]] = defaultdict(list)  # by (src, dst)

    def run(self) -> Times:
        t = 0.0
        while True:
            self._meet(t)
            for r in range(len(self.nxt)):
                self._maybe_start(r, t)
            future = [end for end in self.busy_until if end > t]
            if not future:  # every rank done, or stuck on a dependency cycle of the schedule
                return self.times
            t = min(future)

    def _free(self, r: int, t: float) -> bool:
        return self.busy_until[r] <= t

    def _meet(self, t: float) -> None:
        for (src, dst), consumers in self.pending.items():
            if consumers and self._free(src, t) and self._free(dst, t):
                self.delivered.update(consumers)
                consumers.clear()

    def _remote_producer(self, action: Action) -> Action | None:
        for need in dependencies(action, self.schedule.num_stages):
            if 0 <= need[2] < len(self.owner) and self.owner[need[2]] != self.owner[action.stage]:
                return need
        return None

    def _ready(self, r: int, t: float) -> Action | None:
        acts = self.schedule.actions[r]
        if self.nxt[r] >= len(acts):
            return None
        action = acts[self.nxt[r]]
        for need in dependencies(action, self.schedule.num_stages):
            if self.ends.get(need, float("inf")) > t:
                return None
        if self._remote_producer(action) is not None and action not in self.delivered:
            return None
        return action

    def _maybe_start(self, r: int, t: float) -> None:
        if not self._free(r, t):
            return
        action = self._ready(r, t)
        if action is None or self._should_wait(r, action, t):
            return
        end = t + unit_cost(action, self.split)
        self.times[r][self.nxt[r]] = (t, end)
        self.ends[action], self.busy_until[r] = end, end
        self.nxt[r] += 1
        consumer = _remote_consumer(action, self.owner, self.schedule.num_stages)
        if consumer is not None:
            self.pending[r, self.owner[consumer.stage]].append(consumer)

    def _should_wait(self, r: int, action: Action, t: float) -> bool:
        """Wait for a computing receiver whose next action needs our data, if that is cheaper."""
        cost = unit_cost(action, self.split)
        for (src, dst), consumers in self.pending.items():
            if src != r or not consumers or self._free(dst, t):
                continue
            acts, k = self.schedule.actions[dst], self.nxt[dst]
            if k >= len(acts) or acts[k] not in consumers:
                continue
            g = self.busy_until[dst]
            late_if_wait = max(0.0, g - self.latest.get(action, g))
            late_if_go = max(0.0, t + cost - self.latest.get(acts[k], t + cost))
            if (late_if_wait, g - t) < (late_if_go, t + cost - g):
                return True
        return False


def _remote_consumer(action: Action, owner: tuple[int, ...], num_stages: int) -> Action | None:
    """The action on another rank that consumes `action`'s output, if any."""
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD and s < num_stages - 1 and owner[s + 1] != owner[s]:
        return Action(FORWARD, i, s + 1)
    if action.kind == BACKWARD and 0 < s < len(owner) and owner[s - 1] != owner[s]:
        return Action(BACKWARD, i, s - 1)
    return None
