"""The simulator: interprets the lowered programs step by step, exactly as the runtime does
(post a step's ops, wait for its ``waits``, compute, wait for its ``after``), proves them correct
and measures time and memory."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeflow.errors import DeadlockError, ScheduleError
from pipeflow.schedules.ir import ACTIVATION, BACKWARD, FORWARD, KINDS, WEIGHT, Action, CommOp
from pipeflow.schedules.ir import PipelineSchedule, Program, Step
from pipeflow.schedules.lowering import lower, recvs_needed
from pipeflow.schedules.offload import Group, HostLink, OffloadCosts, OffloadPlan, plan_offload

CostFn = Callable[[Action], float]
Costs = Mapping[str, float] | CostFn
DEFAULT_COSTS: dict[str, float] = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}
Channel = tuple[int, int]  # (src rank, dst rank)
TransferFn = Callable[[CommOp], float]  # seconds from both sides posted to an op's completion
_GRID_FULL = 24  # programs up to this many steps are drawn whole in a deadlock grid
_GRID_RADIUS = 3  # otherwise: this many steps either side of each stuck step
_MAX_PROBLEMS = 8  # problems listed in one error message


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
    """

    transfer: TransferFn | None = None
    step_overhead: Sequence[float] = ()
    post: Sequence[float] = ()
    start: Sequence[float] = ()
    offload: OffloadCosts | None = None

    def of(self, what: Sequence[float], r: int) -> float:
        """`what`'s value for rank r (0 where not given)."""
        return float(what[r]) if r < len(what) else 0.0


def simulate(
    schedule: PipelineSchedule,
    programs: list[Program] | None = None,
    costs: Costs | None = None,
    comm_latency: float = 0.0,
    posting: str = "rendezvous",
    microbatch_sizes: Sequence[float] | None = None,
    runtime: RuntimeCosts | None = None,
    shard: bool = False,
    shard_cost: float = 0.0,
    offload: OffloadCosts | None = None,
) -> SimResult:
    """Interpret the per-rank programs as the runtime does, checking and measuring them.

    Each step of a rank posts its ops together, waits for its ``waits`` (each op meets its
    counterpart: the k-th send on a directed rank pair meets the k-th recv there), computes,
    then waits for its ``after``.  An op posted at t whose counterpart is posted at t' completes
    at max(t, t') + `comm_latency`; a wait ends when its last op completes.

    Args:
        schedule: the schedule (placement, sizes, training or not).
        programs: per-rank programs; ``lower(schedule, posting)`` when None.
        costs: time per kind (``{"F": 1, "B": 1, "W": 1}`` by default, missing kinds default too)
            or a function of the Action.  A B with ``backward_weights`` costs B + W.
        comm_latency: added to the completion of every op.
        posting: the lowering option when `programs` is None (``rendezvous``, ``group``,
            ``at_step``, ``ahead``; see :mod:`~pipeflow.schedules.lowering`).  The relaxed
            options only post earlier and wait later than rendezvous, so a program that runs
            under rendezvous runs under them too, never later.
        microbatch_sizes: each micro-batch's activation size (variable lengths: its tokens),
            weighing it in ``peak_memory``; default 1 each.
        runtime: the runtime's own costs (per-op transfer, per-step overhead, posting, start
            offsets; :class:`RuntimeCosts`); its ``transfer`` replaces `comm_latency`.
        shard: with `programs` None, lower with shard points (``lower(..., shard=True)``).
        shard_cost: time of one stage's reduce-scatter and reshard (``reshard``: the rank is
            busy with it right after posting the step's ops) and of one stage's all-gather
            (``unshard``, started after those; the action starts no earlier than its end).
            Programs with shard points are checked: every stage of a rank unsharded once at or
            before its first action and resharded once after its last.
        offload: each group's bytes and the host link (default: the `runtime`'s), timing the programs' offload marks
            (``Step.offload``/``reload``, :mod:`~pipeflow.schedules.offload`): a group's copy to
            the host starts when its F ends and the device-to-host link is free, its copy back
            when its reload step starts (before its ops are posted), the link is free and the
            first copy is done; its B
            starts no earlier than that end.  Copies on a link that is not ``overlapped`` take the
            rank's own time.  None: the marks cost nothing.  Marks are checked: each group
            offloaded at its F, reloaded once after that and at or before its B.

    Returns:
        The :class:`SimResult`.

    Raises:
        ScheduleError: missing, duplicated, misplaced or misordered actions or transfers,
            unmatched comm ops, or a violated data dependency.
        DeadlockError: the programs stop progressing; ``grid`` shows where each rank is stuck.
    """
    if comm_latency < 0:
        raise ScheduleError(f"comm_latency must be >= 0, got {comm_latency}")
    if shard_cost < 0:
        raise ScheduleError(f"shard_cost must be >= 0, got {shard_cost}")
    programs = lower(schedule, posting, shard=shard) if programs is None else programs
    _check_programs(schedule, programs)
    _check_channel_counts(programs)
    sizes = list(microbatch_sizes) if microbatch_sizes is not None else [1.0] * schedule.num_microbatches
    if len(sizes) != schedule.num_microbatches:
        raise ScheduleError(f"got {len(sizes)} micro-batch sizes for {schedule.num_microbatches} micro-batches")
    runtime = runtime or RuntimeCosts()
    if runtime.transfer is None:
        runtime = RuntimeCosts(lambda op: comm_latency, runtime.step_overhead, runtime.post, runtime.start,
                               runtime.offload)
    offload = offload if offload is not None else runtime.offload
    return _Simulation(schedule, programs, _cost_function(costs), runtime, sizes, shard_cost, offload).run()


def simulated_plan(
    schedule: PipelineSchedule,
    mode: str,
    offload: OffloadCosts,
    costs: Costs | None = None,
    posting: str = "rendezvous",
    runtime: RuntimeCosts | None = None,
    microbatch_sizes: Sequence[float] | None = None,
    shard: bool = False,
    fits: Callable[[OffloadPlan], bool] | None = None,
) -> OffloadPlan:
    """``pipeline.offload``'s plan (:func:`~pipeflow.schedules.offload.plan_offload`, with its
    memory check `fits`) for the programs ``lower(schedule, posting, shard)`` simulated with these
    costs (as :func:`simulate`)."""

    def run(plan: OffloadPlan) -> tuple[float, list[list[tuple[float, float, float]]], dict[Group, float]]:
        programs = lower(schedule, posting, shard=shard, offload=plan)
        sim = simulate(schedule, programs, costs, posting=posting, microbatch_sizes=microbatch_sizes,
                       runtime=runtime, offload=offload)
        return sim.makespan, sim.step_times, sim.reload_waits

    return plan_offload(schedule, mode, offload, run, fits)


def validate(schedule: PipelineSchedule, programs: list[Program] | None = None, posting: str = "rendezvous") -> SimResult:
    """Prove `programs` (default ``lower(schedule, posting)``) run each action once, in order, no deadlock.

    Raises:
        ScheduleError: on any problem found (see :func:`simulate`).
        DeadlockError: when the programs cannot make progress.
    """
    return simulate(schedule, programs, posting=posting)


def _cost_function(costs: Costs | None) -> CostFn:
    if callable(costs):
        return costs
    table = {**DEFAULT_COSTS, **(costs or {})}
    return lambda action: float(table[action.kind])


def _step_cost(step: Step, cost: CostFn) -> float:
    action = step.action
    if action is None:
        return 0.0
    if action.kind == BACKWARD and step.backward_weights:
        return cost(action) + cost(Action(WEIGHT, action.microbatch, action.stage))
    return cost(action)


def _raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        listed = problems[:_MAX_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise ScheduleError(f"{what}:\n  " + "\n  ".join(listed))


def _check_programs(schedule: PipelineSchedule, programs: list[Program]) -> None:
    """Placement, ranges and completeness of the actions and ops, before anything runs."""
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
    """Every op waited exactly once, at or after the step that posts it, sends in their own step."""
    problems, posted = [], {}
    for k, step in enumerate(program):
        posted.update((op, k) for op in step.ops)
        for op in step.waits + step.after:
            if op not in posted:
                problems.append(f"rank {r} step {k}: waits for '{op.describe()}', which is not posted by then or waited twice")
            elif op.is_send and posted[op] != k:
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


def _check_channel_counts(programs: list[Program]) -> None:
    """Every send must meet a recv on its channel, or ops are left over at the end."""
    posted: dict[tuple[Channel, bool], list[str]] = defaultdict(list)
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


class _Posted(NamedTuple):
    rank: int
    step: int
    op: CommOp
    time: float


_Slot = tuple[_Posted, list[_Posted], int]  # (this op, the counterpart queue, index in it)
_POST, _WAIT, _AFTER = range(3)  # the phases of a step


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


class _Simulation:
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
        if phase == _POST:
            self.clock[r] += self.runtime.of(self.runtime.step_overhead, r)
            for g in step.reload:  # issued first; the B waits for the copy's end
                start = max(self.clock[r], self.h2d_free[r], self.offloaded_by.get(g, 0.0))
                end = self.h2d_free[r] = self.reloaded_by[g] = start + self.link.h2d_s(self._group_bytes(g))
                self.events[r].append(("h2d", f"reload {g[0]}:{g[1]}", start, end))
                if not self.link.overlapped:
                    self.clock[r] = end
            self.posted_at[r] = self.clock[r]
            for op in step.ops:
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
        done = self._wait(r, step.waits if phase == _WAIT else step.after)
        if done is None:
            return False
        if phase == _WAIT:  # the gathers started at the rank's clock, after the reductions
            if step.ops or step.waits:
                self.events[r].append(("comm", step.ops_text or "; ".join(str(op) for op in step.waits),
                                       self.posted_at[r], done))
            self._compute(r, k, step, max(done, self.clock[r] + self.shard_cost * len(step.unshard)))
            self.phase[r] = _AFTER
        else:
            if step.after:
                self.events[r].append(("comm", "sends of the step done", self.clock[r], done))
            self.clock[r] = done
            self.next_step[r], self.phase[r] = k + 1, _POST
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
        return max([self.clock[r]] + [max(s[0].time, o.time) + self.transfer(s[0].op) for s, o in zip(slots, others) if o])

    def _waiting_on(self, r: int, k: int) -> list[_Slot]:
        """The posted ops rank r waits for in its current phase of step k."""
        if self.phase[r] == _POST:
            return []
        step = self.programs[r][k]
        return [self.posted[r][op] for op in (step.waits if self.phase[r] == _WAIT else step.after)]

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

    def _compute(self, r: int, k: int, step: Step, start: float) -> None:
        action = step.action
        group = (action.stage, action.microbatch) if action is not None else None
        if action is not None and action.kind == BACKWARD and group in self.reloaded_by:
            ready = max(start, self.reloaded_by[group])
            self.reload_waits[group] = ready - start
            start = ready
        end = start + _step_cost(step, self.cost)
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
        self._check_inputs(r, k, action, start)
        self.finished_at[action] = end
        self.busy[r] += end - start
        self.timeline.append((r, action, start, end))
        self.events[r].append((action.kind, str(action), start, end))
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
            waiting.append(f"rank {r} step {k} ({_cell(self.programs[r][k])}) waits on: {ops}")
        where = ", ".join(f"rank {r} at step {k}" for r, k in stuck.items())
        grid = _deadlock_grid(self.programs, stuck) + "\n" + "\n".join(waiting)
        message = f"deadlock in schedule {self.schedule.name!r}: no rank can progress ({where})"
        raise DeadlockError(message, grid)


def _cell(step: Step) -> str:
    return str(step.action) if step.action is not None else "-"


def _grid_columns(length: int, stuck_steps: list[int]) -> list[int | None]:
    """Step indices to draw; None stands for a run of hidden steps (``...``)."""
    if length <= _GRID_FULL:
        return list(range(length))
    near = {c for k in stuck_steps for c in range(k - _GRID_RADIUS, k + _GRID_RADIUS + 1)}
    shown = sorted(c for c in near if 0 <= c < length)
    columns: list[int | None] = []
    previous = -1
    for c in shown:
        if c != previous + 1:
            columns.append(None)
        columns.append(c)
        previous = c
    return columns + ([None] if previous < length - 1 else [])


def _deadlock_grid(programs: list[Program], stuck: dict[int, int]) -> str:
    """A rank x step text table of the programs, each rank's stuck step marked ``[1F3]``."""
    length = max((len(program) for program in programs), default=0)
    columns = _grid_columns(length, list(stuck.values()))
    rows = [["step"] + ["..." if c is None else str(c) for c in columns]]
    for r, program in enumerate(programs):
        row = [f"rank {r}"]
        for c in columns:
            text = "..." if c is None else _cell(program[c]) if c < len(program) else ""
            row.append(f"[{text}]" if c is not None and stuck.get(r) == c else text)
        rows.append(row)
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    return "\n".join(
        " ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )
