"""Activations offloaded to host memory in the pipeline's gaps (``pipeline.offload=none|auto|all``).

A micro-batch's held activations sit idle between its F and its B; in a pipeline those gaps are
long and known before the step runs.  A *group* is one (stage, micro-batch): what autograd saved
during that F.  An :class:`OffloadPlan` says which groups go to the host right after their F
and, for each, the action before which its copy back is issued (on the same rank, after the F,
at or before the group's B).  :meth:`OffloadPlan.mark` writes that into the lowered steps
(``Step.offload``, ``Step.reload``); the simulator times the copies over a :class:`HostLink`
(device to host after the F, host to device from the reload's step on, the B waiting for it),
the memory model releases a group's bytes after its F and takes them back at its reload, and
the runtime (:mod:`pipeflow.runtime.offload`) runs exactly those copies.

:func:`plan_offload` makes the plan from one simulated timing of the program:

- ``all``: every group of every rank; each reload issued as late as its copy still ends before
  the group's B, or at the B's own step where no step starts early enough (the B then waits for
  the copy, and the group spends the least time back on the device).
- ``auto``: the groups whose copies the gaps hide.  Offloads queue on the device-to-host link in
  F order; reloads are placed as late as possible on the host-to-device link, latest B first,
  each at the last step that starts early enough.  A group is kept when its reload ends before
  its B and it is off the device for a while (its offload ends before its reload starts); the
  plan is then simulated and any group whose B still waits is dropped, until none waits.  On a
  link that is not overlapped (a CPU: the copies take the compute thread's time) no gap hides
  anything and ``auto`` offloads nothing.  Given a memory limit (the device's; the planner's
  ``plan.memory_limit_gb``) that the hidden groups do not bring the prediction under, ``auto``
  adds the other groups, largest first, until it fits: a slower step rather than one that
  does not fit.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeflow.errors import ConfigError
from pipeflow.schedules.ir import BACKWARD, FORWARD, Action, PipelineSchedule, Program

OFFLOAD_MODES = ("none", "auto", "all")
Group = tuple[int, int]  # (stage, micro-batch)
_AUTO_ROUNDS = 8  # simulate-and-drop rounds of auto before it gives up on the rest


@dataclass(frozen=True)
class HostLink:
    """The copy path between a rank's device and host memory.

    Attributes:
        d2h_bytes_per_s: device-to-host bandwidth (pinned memory), bytes per second.
        h2d_bytes_per_s: host-to-device bandwidth, bytes per second.
        latency_s: fixed cost of one group's copy (launching it).
        overlapped: True where copies run beside compute (a CUDA copy engine on its own stream);
            False where they take the compute thread's time (the CPU).
    """

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    latency_s: float = 0.0
    overlapped: bool = True

    def d2h_s(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` to the host."""
        return self.latency_s + nbytes / self.d2h_bytes_per_s if nbytes > 0 else 0.0

    def h2d_s(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` back to the device."""
        return self.latency_s + nbytes / self.h2d_bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class OffloadCosts:
    """What the simulator needs to time a plan's copies: each group's bytes and the link."""

    group_bytes: Callable[[Group], float]
    link: HostLink


@dataclass(frozen=True)
class OffloadPlan:
    """Which groups are offloaded and where each one's reload is issued.

    Attributes:
        mode: the ``pipeline.offload`` it was made for.
        reloads: ``(group, action)`` pairs: the group goes to the host after its F, and its copy
            back is issued at the start of the step that runs `action` (on the group's rank).
    """

    mode: str = "none"
    reloads: tuple[tuple[Group, Action], ...] = ()

    @property
    def groups(self) -> set[Group]:
        """The offloaded (stage, micro-batch) groups."""
        return {g for g, _ in self.reloads}

    def mark(self, program: Program) -> Program:
        """`program` with ``offload`` on the step of each planned group's F and ``reload`` on the
        step of the action its reload precedes (steps the plan does not touch are unchanged)."""
        if not self.reloads:
            return program
        groups = self.groups
        before: dict[Action, list[Group]] = {}
        for g, action in self.reloads:
            before.setdefault(action, []).append(g)
        marked = []
        for step in program:
            a = step.action
            offload = ((a.stage, a.microbatch),) if a is not None and a.kind == FORWARD and (a.stage, a.microbatch) in groups \
                else ()
            reload = tuple(before.get(a, ())) if a is not None else ()
            marked.append(step if not offload and not reload else dataclasses.replace(step, offload=offload,
                                                                                      reload=reload))
        return marked


def check_mode(mode: str) -> str:
    """`mode` if it is one of :data:`OFFLOAD_MODES`.

    Raises:
        ConfigError: naming the valid values.
    """
    if mode not in OFFLOAD_MODES:
        raise ConfigError(f"pipeline.offload={mode!r}; use one of {', '.join(OFFLOAD_MODES)}")
    return mode


def plan_offload(
    schedule: PipelineSchedule,
    mode: str,
    costs: OffloadCosts,
    simulate_plan: Callable[[OffloadPlan], tuple[float, list[list[tuple[float, float, float]]], dict[Group, float]]],
    fits: Callable[[OffloadPlan], bool] | None = None,
) -> OffloadPlan:
    """The plan for `mode` (module docstring).

    Args:
        schedule: the training schedule.
        mode: ``none``, ``auto`` or ``all``.
        costs: each group's offloaded bytes and the host link.
        simulate_plan: simulates the run's programs with a plan, returning (makespan, per rank
            and step ``(post, action start, action end)``, per group how long its B waited for
            its reload): the same simulation as the run's prediction, so the plan is made for the
            costs the run is predicted with.
        fits: whether a plan's predicted memory fits the memory limit (the device's, or
            ``plan.memory_limit_gb``); None: no limit.  Where the hidden groups do not bring the
            prediction under it, ``auto`` adds the fewest of the others, largest first, that
            make it fit (found by bisection: a slower step that fits rather than one that does
            not); where even all of them do not, the hidden groups alone.

    Returns:
        The plan (empty for ``none`` and for a forward-only schedule).
    """
    check_mode(mode)
    if mode == "none" or not schedule.training:
        return OffloadPlan(mode)
    makespan, steps, _ = simulate_plan(OffloadPlan(mode))
    every = [pair for r in range(schedule.num_ranks) for pair in _rank_plan(schedule, r, steps[r], costs, True)]
    if mode == "all":
        return OffloadPlan(mode, tuple(every))
    plan = _hidden(schedule, mode, costs, simulate_plan, makespan, steps) if costs.link.overlapped else OffloadPlan(mode)
    if fits is None or fits(plan):
        return plan
    others = sorted((p for p in every if p[0] not in plan.groups), key=lambda p: -costs.group_bytes(p[0]))

    def grown(k: int) -> OffloadPlan:
        return OffloadPlan(mode, plan.reloads + tuple(others[:k]))

    low, high = 0, len(others)  # more groups off the device hold less: the fewest that fit, by bisection
    if not fits(grown(high)):
        return plan  # nothing fits: no slower step for nothing
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(grown(middle)) else (middle, high)
    return grown(high)


def _hidden(
    schedule: PipelineSchedule, mode: str, costs: OffloadCosts, simulate_plan: Callable, makespan: float,
    steps: list[list[tuple[float, float, float]]],
) -> OffloadPlan:
    """``auto``'s groups: those whose copies the gaps hide, checked by simulating them."""
    plan = OffloadPlan(mode, tuple(pair for r in range(schedule.num_ranks)
                                   for pair in _rank_plan(schedule, r, steps[r], costs, False)))
    for _ in range(_AUTO_ROUNDS):
        if not plan.reloads:
            return plan
        new_makespan, _, waits = simulate_plan(plan)
        late = {g for g, waited in waits.items() if waited > 1e-12}
        if not late and new_makespan <= makespan * (1 + 1e-9) + 1e-12:
            return plan
        drop = late or {max(plan.groups, key=lambda g: costs.group_bytes(g))}
        plan = OffloadPlan(mode, tuple(pair for pair in plan.reloads if pair[0] not in drop))
    return OffloadPlan(mode)


def _rank_plan(
    schedule: PipelineSchedule, r: int, steps: Sequence[tuple[float, float, float]], costs: OffloadCosts,
    everything: bool,
) -> list[tuple[Group, Action]]:
    """One rank's (group, reload-before action) pairs from its timed steps (see the module docstring)."""
    actions = schedule.actions[r]  # step k of the lowered program runs actions[k] (a flush step may follow)
    forward_at = {(a.stage, a.microbatch): k for k, a in enumerate(actions) if a.kind == FORWARD}
    backward_at = {(a.stage, a.microbatch): k for k, a in enumerate(actions) if a.kind == BACKWARD}
    link = costs.link
    d2h_free, offloaded_by = 0.0, {}
    for g, f in sorted(forward_at.items(), key=lambda item: item[1]):
        if g not in backward_at:
            continue
        start = max(steps[f][2], d2h_free)
        d2h_free = offloaded_by[g] = start + link.d2h_s(costs.group_bytes(g))
    plan: list[tuple[Group, Action]] = []
    h2d_start = math.inf  # where the reload placed after this one starts (placing latest B first)
    for g, b in sorted(((g, backward_at[g]) for g in offloaded_by), key=lambda item: -item[1]):
        f, nbytes = forward_at[g], costs.group_bytes(g)
        if nbytes <= 0 and not everything:  # nothing to gain (or bytes unknown: no profiles)
            continue
        duration = link.h2d_s(nbytes)
        latest = min(steps[b][1], h2d_start) - duration  # the latest start that ends before the B
        j = max((k for k in range(f + 1, b + 1) if steps[k][0] <= latest), default=None)
        hidden = j is not None and offloaded_by[g] <= latest and offloaded_by[g] < steps[j][0]
        if not hidden and not everything:
            continue
        if not link.overlapped or j is None:  # the B waits for it anyway: back as late as can be, at the B
            j = b
        begins = max(steps[j][0], offloaded_by[g])
        h2d_start = min(h2d_start, begins)
        plan.append((g, actions[j]))
    return plan


def group_bytes_of(offloadable: Sequence[float], sizes: Sequence[float] | None = None) -> Callable[[Group], float]:
    """Each group's offloaded bytes: its stage's per-micro-batch `offloadable` bytes, times its
    micro-batch's size relative to the profiled one (variable lengths; default 1)."""
    return lambda g: offloadable[g[0]] * (sizes[g[1]] if sizes is not None else 1.0)
