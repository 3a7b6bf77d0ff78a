"""``schedule=auto``: a schedule synthesised for given per-stage F, B, W costs, a transfer cost
and a memory limit, never worse (simulated) than the best built-in schedule that fits the limit.

Candidates: the list scheduler (:mod:`~pipeflow.schedules.synthesis`) on every placement the
stage count allows (loop; and V with 2 stages per rank), each with the limit and with
1F1B's p when that is smaller, both tie-breaks; every registered schedule of the same stage
count and placement; and each of those with its backwards split and its Ws moved into the gaps
that these costs leave (:func:`~pipeflow.schedules.synthesis.refill_weights`).  Each is simulated with the costs (the simulator proves it as it times
it); the fastest whose peak fits the limit wins, ties going to the smaller peak.  Pure, no torch.

Memory as elsewhere: micro-batches of a rank's share = (stage, micro-batch) pairs held / stages
per rank.  With activations offloaded (``pipeline.offload``, the `offload` argument), a pair
counts only while its activations are on the device: each candidate gets its own offload plan
(:func:`~pipeflow.schedules.simulator.simulated_plan`, its copies timed in its makespan) and is
judged by the pairs its plan leaves on the device, so schedules that hold more micro-batches
(larger list-scheduler budgets, GPipe-like orders) can fit the same limit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeflow.errors import ScheduleError
from pipeflow.schedules.generators import _check, loop_placement, v_placement
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action, PipelineSchedule
from pipeflow.schedules.lowering import lower
from pipeflow.schedules.memory import StageBytes, rank_peaks, tensor_memory
from pipeflow.schedules.offload import OffloadCosts
from pipeflow.schedules.registry import SCHEDULES, register_schedule
from pipeflow.schedules.simulator import RuntimeCosts, simulate, simulated_plan
from pipeflow.schedules.timing import dependencies
from pipeflow.schedules.synthesis import Policy, list_schedule, refill_weights

AUTO = "auto"
_EPS = 1e-9
_SIMULATED = 8  # synthesised candidates simulated, the best by the estimate


@dataclass(frozen=True)
class StageCosts:
    """Time of F, B (input gradient) and W (weight gradient) of one micro-batch on each stage.

    A backward that is not split costs B + W (as the simulator charges it).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 1.0, weight: float = 1.0) -> StageCosts:
        """The same costs on every stage."""
        return cls((forward,) * num_stages, (backward,) * num_stages, (weight,) * num_stages)

    def of(self, kind: str, stage: int) -> float:
        """The cost of `kind` (F, B or W) on `stage`."""
        table = {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}[kind]
        return table[stage]

    def action(self, action: Action) -> float:
        """The cost of one action, for :func:`~pipeflow.schedules.simulator.simulate`."""
        return self.of(action.kind, action.stage)


@dataclass(frozen=True)
class Candidate:
    """One schedule considered, with what the simulator measured for it.

    Attributes:
        label: the built-in's name, or ``list scheduler (<placement>, <limit> pairs)``.
        schedule: the schedule itself.
        makespan: simulated time of one step.
        bubble: simulated idle fraction.
        peak: most micro-batches of a rank's share held on any rank.
    """

    label: str
    schedule: PipelineSchedule
    makespan: float
    bubble: float
    peak: float


@dataclass(frozen=True)
class Synthesis:
    """What :func:`synthesize` chose and the best built-in beside it (None if none fits)."""

    chosen: Candidate
    best_builtin: Candidate | None

    def report(self) -> str:
        """Two lines: auto's predicted makespan, bubble and peak, and the best built-in's."""
        lines = [_line("auto", self.chosen)]
        lines.append(_line(f"best built-in ({self.best_builtin.label})", self.best_builtin) if self.best_builtin
                     else "best built-in: none fits the memory limit")
        return "\n".join(lines)


def _line(what: str, c: Candidate) -> str:
    return f"{what}: makespan {c.makespan:.6g}, bubble {c.bubble:.1%}, peak {c.peak:g} micro-batches of a rank's share"


def synthesize(
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int,
    costs: StageCosts | None = None,
    comm: float = 0.0,
    max_activations: float | None = None,
    placement: str | None = None,
    offload: tuple[str, OffloadCosts, Sequence[float]] | None = None,
) -> Synthesis:
    """The fastest schedule (simulated) for these costs that holds at most `max_activations`.

    Args:
        num_ranks: p.
        num_microbatches: m.
        stages_per_rank: v; the costs give p * v stages.
        costs: per-stage F, B, W costs (None: F = B = W = 1).
        comm: transfer time between two ranks (the simulator's ``comm_latency``).
        max_activations: micro-batches of a rank's share each rank may hold (None: p, 1F1B's).
        placement: ``loop`` or ``v`` to restrict the choice, None for either.
        offload: ``(mode, copies, fractions)``: ``pipeline.offload``'s mode, each group's bytes and
            the host link, and per stage the fraction of a micro-batch's activations offloading
            moves; candidates are then planned, timed and held as the module docstring says.

    Returns:
        The :class:`Synthesis`; its chosen schedule is named ``auto``.

    Raises:
        ScheduleError: sizes out of range, costs for another stage count, or a limit below one
            micro-batch of a rank's share.
    """
    _check(num_ranks, num_microbatches)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    costs = costs or StageCosts.uniform(p * v)
    limit = float(p if max_activations is None else max_activations)
    if len(costs.forward) != p * v or len(costs.backward) != p * v or len(costs.weight) != p * v:
        raise ScheduleError(f"auto: costs for {len(costs.forward)} stages, but {p} ranks x {v} stages per rank = {p * v}")
    if limit < 1:
        raise ScheduleError(f"auto: schedule.max_inflight_microbatches={limit:g} is below one micro-batch of a "
                            "rank's share; use >= 1")
    placements = _placements(p, v, placement)
    every_builtin = _builtins(p, m, v, placements)
    # what may hold more than the limit before offloading: offloading decides whether it fits
    reach = float(m) if offload is not None and offload[0] != "none" else limit
    builtins = [_measure(name, s, costs, comm, offload) for name, s in every_builtin if _peak(s) <= reach + _EPS]
    builtins = [c for c in builtins if c.peak <= limit + _EPS]
    pairs = (int(limit * v + _EPS),) * p
    made = _synthesised(p, m, costs, comm, limit, v, placements)
    if reach > limit:
        made += _synthesised(p, m, costs, comm, min(2 * limit, reach), v, placements)
    for name, s in every_builtin:
        if _peak(s) <= 2 * limit:
            made.append((f"{name} with its Ws refilled", refill_weights(s, pairs, costs.of, comm)))
    made = [(label, s) for label, s in made if _peak(s) <= reach + _EPS]
    # simulating proves and times exactly but costs most: only the few the estimate ranks first
    made.sort(key=lambda item: _estimate(item[1], costs, comm))
    found = [_measure(label, s, costs, comm, offload) for label, s in made[:_SIMULATED]]
    found = [c for c in found if c.peak <= limit + _EPS]
    best_builtin = min(builtins, key=_rank, default=None)
    if not found and not builtins:
        raise ScheduleError(f"auto: no schedule holds at most {limit:g} micro-batches of a rank's share; raise "
                            "schedule.max_inflight_microbatches")
    chosen = min(found + builtins, key=_rank)
    named = PipelineSchedule(AUTO, p, p * v, m, chosen.schedule.stage_to_rank, chosen.schedule.actions)
    return Synthesis(Candidate(chosen.label, named, chosen.makespan, chosen.bubble, chosen.peak), best_builtin)


def _rank(c: Candidate) -> tuple[float, float]:
    return (round(c.makespan, 9), c.peak)


def _placements(p: int, v: int, placement: str | None) -> dict[str, tuple[int, ...]]:
    usable = {"loop": loop_placement(p, v)}
    if v == 2:
        usable["v"] = v_placement(p, v)
    if placement is None:
        return usable
    if placement not in usable:
        raise ScheduleError(f"auto cannot use schedule.placement={placement} with {v} stages per rank; "
                            f"usable: {', '.join(usable)}")
    return {placement: usable[placement]}


def _measure(label: str, schedule: PipelineSchedule, costs: StageCosts, comm: float,
             offload: tuple[str, OffloadCosts, Sequence[float]] | None = None) -> Candidate:
    v = schedule.num_stages // schedule.num_ranks
    if offload is None or offload[0] == "none":
        result = simulate(schedule, costs=costs.action, comm_latency=comm)
        return Candidate(label, schedule, result.makespan, result.bubble, max(result.peak_activations) / v)
    mode, copies, fractions = offload
    plan = simulated_plan(schedule, mode, copies, costs.action, runtime=RuntimeCosts(lambda op: comm))
    programs = lower(schedule, offload=plan)
    result = simulate(schedule, programs, costs.action, comm_latency=comm, offload=copies)
    held = tensor_memory(schedule, [StageBytes(0.0, 1.0, offloadable=f) for f in fractions], programs=programs,
                         timing=result)
    return Candidate(f"{label}, offload={mode}", schedule, result.makespan, result.bubble,
                     max(h.peak.activations for h in held) / v)


def _synthesised(p: int, m: int, costs: StageCosts, comm: float, limit: float, v: int,
                 placements: dict[str, tuple[int, ...]]) -> list[tuple[str, PipelineSchedule]]:
    pairs = {int(limit * v + _EPS), min(int(limit * v + _EPS), p * v)}
    out = []
    for where, owner in placements.items():
        for budget in sorted(pairs):
            for late, backward_first in ((True, True), (False, True), (True, False)):
                policy = Policy((budget,) * p, late_stage_first=late, backward_first=backward_first)
                try:
                    schedule = list_schedule(AUTO, m, owner, policy, costs.of, comm)
                except ScheduleError:  # a budget below a rank's stage count
                    continue
                out.append((f"list scheduler ({where}, {budget} pairs)", schedule))
    return out


def _estimate(schedule: PipelineSchedule, costs: StageCosts, comm: float) -> float:
    """The makespan if every rank ran its actions in order as soon as their inputs arrive
    (sends never wait): a lower bound of the simulated one, cheap enough to rank candidates."""
    split, S, owner = schedule.split_backwards(), schedule.num_stages, schedule.stage_to_rank
    ends: dict[Action, float] = {}
    nxt, clock = [0] * schedule.num_ranks, [0.0] * schedule.num_ranks
    progressed = True
    while progressed:
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while nxt[r] < len(acts):
                action = acts[nxt[r]]
                start = clock[r]
                for need in dependencies(action, S):
                    end = ends.get(Action(*need))
                    if end is None:
                        break
                    start = max(start, end + (comm if owner[need[2]] != r else 0.0))
                else:
                    cost = costs.action(action)
                    if action.kind == BACKWARD and (action.stage, action.microbatch) not in split:
                        cost += costs.of(WEIGHT, action.stage)
                    clock[r] = ends[action] = start + cost
                    nxt[r] += 1
                    progressed = True
                    continue
                break
    return max(clock)


def _peak(schedule: PipelineSchedule) -> float:
    """Most micro-batches of a rank's share any rank holds (from the action order alone)."""
    return max(rank_peaks(schedule)) / (schedule.num_stages // schedule.num_ranks)


def _builtins(p: int, m: int, v: int, placements: dict[str, tuple[int, ...]]) -> list[tuple[str, PipelineSchedule]]:
    """Every registered schedule (but auto) of v stages per rank on one of `placements`."""
    out = []
    for name, entry in SCHEDULES.items():
        if name == AUTO or entry.stages_per_rank not in (None, v):
            continue
        try:
            schedule = entry.generator(p, m) if entry.stages_per_rank is not None else entry.generator(p, m, v)
        except ScheduleError:
            continue
        if schedule.stage_to_rank in placements.values():
            out.append((name, schedule))
    return out


@register_schedule(AUTO, stages_per_rank=None, placements=("loop", "v"))
def auto(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> PipelineSchedule:
    """``schedule=auto`` on unit costs (F = B = W = 1) with 1F1B's memory (p micro-batches);
    a run synthesises it from the profiled costs instead (:func:`synthesize`)."""
    return synthesize(num_ranks, num_microbatches, stages_per_rank).chosen.schedule


def write_schedule(schedule: PipelineSchedule, path: str, header: Sequence[str] = ()) -> None:
    """Write `schedule` as a custom schedule file (``schedule=custom schedule.path=<path>``),
    `header` lines as ``#`` comments first."""
    lines = [f"# {line}" for line in header]
    lines += [f"{' '.join(str(a) for a in acts)}  # rank {r}" for r, acts in enumerate(schedule.actions)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
