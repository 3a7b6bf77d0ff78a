"""The planner's search: rank (schedule x micro-batches x chunks per rank x split) by simulated
step time, under a memory limit.  Pure numbers: per-layer costs in, ranked candidates out.

Index letters as elsewhere: p = pipeline ranks, m = micro-batches, v = stages (chunks) per rank,
S = p * v stages, L = layers, b = micro-batch size (samples).

The per-layer costs are a function of b (`CostModel`), since the planner compares micro-batch
counts: the costs of stage s are the sums over its layers.  A schedule that splits the backward
(has W actions) is charged F, B = ``input_grad_s`` and W = ``weight_grad_s``; the others F and a
full backward ``backward_s``.  A rank's memory is its tensor bytes at their peak
(`pipeflow.schedules.memory.tensor_memory`): its stages' parameters, grads and
``optimizer_factor`` optimizer states, plus the activation bytes it holds, walking its actions
in order (an F adds its stage's activation bytes, the last backward half frees them).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from pipeflow.planning.balance import balance_by_memory, balance_contiguous
from pipeflow.errors import ConfigError, PartitionError, ScheduleError
from pipeflow.planning.partition import partition_layers
from pipeflow.planning.layout import stage_bytes, trainable_bytes
from pipeflow.planning.order_search import HostPlacement, order_steps, pick
from pipeflow.planning.profile import action_costs, stage_costs
from pipeflow.planning.step_model import HostShare, simulate_shared, stage_cpu
from pipeflow.schedules import LAYOUTS, PipelineSchedule, RuntimeCosts, build_schedule, lower, simulate, synthesize
from pipeflow.schedules.auto import AUTO
from pipeflow.schedules.ir import CommOp, Step
from pipeflow.schedules.memory import StageBytes, stage_inflight, tensor_memory
from pipeflow.schedules.offload import HostLink, OffloadCosts, OffloadPlan, group_bytes_of, plan_offload
from pipeflow.schedules.simulator import SimResult
from pipeflow.runtime.parallel.mesh_order import DEFAULT_ORDER, order_text

if TYPE_CHECKING:
    from pipeflow.planning.profile import LayerProfile

CostModel = Callable[[int], Sequence["LayerProfile"]]  # micro-batch size b -> per-layer costs
SPLIT_SEARCHES = ("balanced", "all")


@dataclass(frozen=True)
class SearchSpace:
    """What the planner tries.

    Attributes:
        schedules: schedule names (keys of ``pipeflow.schedules.GENERATORS``).
        microbatches: micro-batch counts m; those not dividing the batch are skipped.
        chunks: stages per rank v tried by the schedules that take any count (v = 1 only when
            it is the sole count: interleaved 1F1B and looped BFS with one chunk are 1F1B and GPipe).
        splits: ``balanced`` (the time-balanced, the memory-balanced and the uniform split) or
            ``all`` (every contiguous split: brute force, for small models).
        max_splits: the most splits ``all`` may try per (schedule, m, v).
        dp, shard: what the memory estimate assumes: ``parallel.dp`` replicas of each stage and
            ``parallel.shard`` (none | optimizer | full; see `rank_memory`).
        offload: ``pipeline.offload`` modes tried with every layout (``plan.offload_modes``): each
            planned for `host_link` (:func:`~pipeflow.schedules.offload.plan_offload`) on the
            layout's own simulation, its copies timed and its groups' bytes released.
        host_link: the device-host link the offload plans assume (``plan.host_link_gbps``).
        hosts: where the run's ranks sit (`pipeflow.planning.order_search`): where they fill
            several hosts, every mesh order (``parallel.order``) is tried with each layout and
            the fastest kept; None (one host): every order alike, ``[dp,pp,tp]``.
        tp: the tensor-parallel degree the layers' costs are one rank of (the orders place it).
    """

    schedules: tuple[str, ...]
    microbatches: tuple[int, ...]
    chunks: tuple[int, ...] = (1, 2, 3, 4)
    splits: str = "balanced"
    max_splits: int = 2000
    dp: int = 1
    shard: str = "none"
    offload: tuple[str, ...] = ("none",)
    host_link: HostLink = HostLink(50e9, 50e9, 10e-6)  # about a PCIe 5.0 x16 link, both ways
    hosts: HostPlacement | None = None
    tp: int = 1


@dataclass(frozen=True)
class StepModel:
    """What a step costs beyond its actions and transfers: the runtime's program and its own time.

    Attributes:
        posting: the lowering the runtime interprets (``rendezvous``, ``group``, ``at_step``,
            ``ahead``): when its recvs are posted and waited.
        step_overhead_s: the runtime's time before each program step.
        post_s: the time to post a step's ops.
        tail_s: what follows the pipeline (data-parallel and grad-norm reductions, the optimizer).
        share: how the ranks share the host's cores (None: each has its own; see
            `pipeflow.planning.step_model.simulate_shared`).
        busy_factor: how much longer a transfer takes while every rank of the host computes
            (with `share`: transfers take the share of the step the host computes between the two).
    """

    posting: str = "rendezvous"
    step_overhead_s: float = 0.0
    post_s: float = 0.0
    tail_s: float = 0.0
    share: HostShare | None = None
    busy_factor: float = 1.0  # a transfer while every rank computes over one between idle ranks

    def runtime(self, num_ranks: int, transfer_s: float) -> RuntimeCosts:
        """The simulator's runtime costs for `num_ranks` ranks and a transfer of `transfer_s`."""
        return RuntimeCosts(lambda op: transfer_s, [self.step_overhead_s] * num_ranks, [self.post_s] * num_ranks)


@dataclass(frozen=True)
class Candidate:
    """One layout and what the simulator predicts for it.

    Attributes:
        schedule: schedule name.
        num_microbatches: m.
        stages_per_rank: v.
        split_points: first layer of stages 1..S-1.
        step_s: predicted step time (simulated makespan) in seconds.
        bubble: predicted idle fraction.
        rank_bytes: predicted peak memory of each pipeline rank, in bytes.
        takes_chunks: whether the schedule takes ``schedule.stages_per_rank`` (any count).
    """

    schedule: str
    num_microbatches: int
    stages_per_rank: int
    split_points: tuple[int, ...]
    step_s: float
    bubble: float
    rank_bytes: tuple[float, ...]
    takes_chunks: bool = False
    max_activations: float | None = None  # schedule=auto: the limit it was synthesised for
    rehearsed_s: float | None = None  # plan.rehearse: the step its run predicted from a rehearsal on this host
    tp: int = 1  # parallel.tp: each stage split over tp ranks (its costs one tp rank's)
    cp: int = 1  # parallel.cp: each sequence split over cp ranks (its costs one cp rank's, the ring's included)
    offload: str = "none"  # pipeline.offload: activations copied to the host in the gaps
    offloaded_groups: int = 0  # how many (stage, micro-batch) groups its plan offloads
    order: tuple[str, ...] = DEFAULT_ORDER  # parallel.order: the mesh order, outermost first

    @property
    def peak_bytes(self) -> float:
        """The largest predicted memory of any rank."""
        return max(self.rank_bytes)

    def overrides(self) -> str:
        """Ready-to-paste Hydra overrides for train.py (shell-quoted split points)."""
        parts = [f"schedule={self.schedule}", f"pipeline.num_microbatches={self.num_microbatches}"]
        if self.tp > 1:
            parts.append(f"parallel.tp={self.tp}")
        if self.cp > 1:
            parts.append(f"parallel.cp={self.cp}")
        if self.takes_chunks:
            parts.append(f"schedule.stages_per_rank={self.stages_per_rank}")
        if self.max_activations is not None:
            parts.append(f"schedule.max_inflight_microbatches={self.max_activations:g}")
        if self.offload != "none":
            parts.append(f"pipeline.offload={self.offload}")
        if self.order != DEFAULT_ORDER:  # quoted: brackets are a shell glob
            parts.append(f"'parallel.order={order_text(self.order)}'")
        points = ",".join(str(i) for i in self.split_points)
        parts.append(f"'pipeline.split_points=[{points}]'")
        return " ".join(parts)


@dataclass
class PlanResult:
    """The ranked candidates (fitting the memory limit, fastest first) and what was left out.

    Attributes:
        candidates: layouts within the memory limit, by predicted step time.
        over_memory: layouts whose busiest rank exceeds the limit.
        skipped: reason -> number of combinations the schedule or the model cannot run.
    """

    candidates: list[Candidate] = field(default_factory=list)
    over_memory: list[Candidate] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def num_skipped(self) -> int:
        """How many combinations were invalid."""
        return sum(self.skipped.values())


def search(
    costs: CostModel,
    num_ranks: int,
    batch_size: int,
    space: SearchSpace,
    memory_limit_bytes: float | None = None,
    optimizer_factor: float = 2.0,
    comm_latency_s: float | Callable[[int], float] = 0.0,
    action_overhead_s: float = 0.0,
    step_model: StepModel | None = None,
) -> PlanResult:
    """Simulate every combination of `space` and rank them by predicted step time.

    Args:
        costs: per-layer costs for a micro-batch of b samples.
        num_ranks: p.
        batch_size: samples per step (per data-parallel replica); m must divide it.
        space: what to try.
        memory_limit_bytes: layouts whose busiest rank needs more go to ``over_memory``.
        optimizer_factor: optimizer state bytes per parameter byte (2 for Adam).
        comm_latency_s: added by the simulator to every step that communicates; a number, or a
            function of the micro-batch size b.
        action_overhead_s: added to every compute action (F, B, W): the runtime's own cost per
            action beyond the layers' (dispatch, bookkeeping, waking up after a wait).
        step_model: the runtime's program and costs beyond the actions (default: rendezvous,
            nothing more); its tail is added to every step.

    Returns:
        The `PlanResult`; invalid combinations are counted in ``skipped`` by reason.

    Raises:
        ConfigError: an unknown schedule or split search, or ``all`` with too many splits.
    """
    if space.splits not in SPLIT_SEARCHES:
        raise ConfigError(f"plan.splits={space.splits!r} is not one of {SPLIT_SEARCHES}")
    result = PlanResult()
    model = step_model or StepModel()
    for name, m, v in _combinations(space):
        takes_chunks = LAYOUTS[name][0] is None
        if batch_size % m:
            _count(result, f"data.batch_size={batch_size} not a multiple of m")
            continue
        profiles = costs(batch_size // m)
        latency = comm_latency_s(batch_size // m) if callable(comm_latency_s) else comm_latency_s
        try:
            schedule = build_schedule(name, num_ranks, m, v if takes_chunks else None)
            programs = lower(schedule, model.posting)
            splits = list(_splits(profiles, schedule, space, optimizer_factor))
        except (ScheduleError, PartitionError) as err:
            _count(result, f"{name}: {str(err).splitlines()[0]}")
            continue
        weighted = schedule.split_backwards()
        for ranges in splits:
            if name == AUTO:  # synthesised for this split's costs, at a few memory limits
                cands = _auto_candidates(num_ranks, m, v, ranges, profiles, optimizer_factor, (latency, action_overhead_s),
                                         model, (space.dp, space.shard), space, memory_limit_bytes)
            else:
                cands = [_evaluate(schedule, programs, ranges, profiles, optimizer_factor,
                                   (latency, action_overhead_s), takes_chunks, weighted, model, (space.dp, space.shard),
                                   (mode, space.host_link), memory_limit_bytes, (space.hosts, space.tp))
                         for mode in space.offload]
            for cand in cands:
                if cand.offload != "none" and not cand.offloaded_groups and "none" in space.offload:
                    continue  # a plan that offloads nothing is the layout without offloading, listed already
                fits = memory_limit_bytes is None or cand.peak_bytes <= memory_limit_bytes
                (result.candidates if fits else result.over_memory).append(cand)
    result.candidates.sort(key=_rank_key)
    result.over_memory.sort(key=_rank_key)
    return result


def _combinations(space: SearchSpace) -> Iterator[tuple[str, int, int]]:
    """(schedule, m, v) to try: a fixed-chunk schedule at its own v, the others at each of
    `space.chunks` (without v = 1 when there are others: one chunk per rank is 1F1B / GPipe)."""
    for name in space.schedules:
        if name not in LAYOUTS:
            raise ConfigError(f"unknown schedule {name!r} in the search; valid: {', '.join(LAYOUTS)}")
        needed = LAYOUTS[name][0]
        chunks = (needed,) if needed is not None else tuple(v for v in space.chunks if v > 1 or len(space.chunks) == 1)
        for m in space.microbatches:
            for v in chunks:
                yield name, m, v


def _rank_key(c: Candidate) -> tuple:
    """Fastest first; then the least memory; then a fixed order so that ties rank the same."""
    return (c.step_s, c.peak_bytes, c.schedule, c.num_microbatches, c.stages_per_rank, c.split_points)


def _count(result: PlanResult, reason: str) -> None:
    result.skipped[reason] = result.skipped.get(reason, 0) + 1


def _splits(
    profiles: Sequence[LayerProfile], schedule: PipelineSchedule, space: SearchSpace, optimizer_factor: float
) -> Iterator[list[range]]:
    """The splits to try for this schedule: balanced ones (deduplicated) or every one."""
    L, S = len(profiles), schedule.num_stages
    if S > L:
        raise PartitionError(f"{S} stages but only {L} layers")
    if space.splits == "all":
        count = math.comb(L - 1, S - 1)
        if count > space.max_splits:
            raise ConfigError(
                f"plan.splits=all would try {count} splits of {L} layers into {S} stages "
                f"(plan.max_splits={space.max_splits}); use plan.splits=balanced"
            )
        for points in itertools.combinations(range(1, L), S - 1):
            bounds = (0, *points, L)
            yield [range(bounds[s], bounds[s + 1]) for s in range(S)]
        return
    seconds = [p.forward_s + _backward_s(p) for p in profiles]
    found = [
        balance_contiguous(seconds, S),
        balance_by_memory([p.param_bytes for p in profiles], [p.activation_bytes for p in profiles],
                          S, stage_inflight(schedule), optimizer_factor),
        partition_layers(L, S),
    ]
    seen: set[tuple[int, ...]] = set()
    for ranges in found:
        key = tuple(r.start for r in ranges)
        if key not in seen:
            seen.add(key)
            yield ranges


def _backward_s(profile: LayerProfile) -> float:
    """Backward seconds of a layer: B + W when measured split, else the full backward."""
    halves = profile.input_grad_s + profile.weight_grad_s
    return halves if halves > 0 else profile.backward_s


def auto_limits(num_ranks: int) -> list[float]:
    """The ``schedule.max_inflight_microbatches`` the planner synthesises ``auto`` for: from a third of
    1F1B's p micro-batches (at least 1) to twice it; ``plan.memory_limit_gb`` then keeps those that fit."""
    p = num_ranks
    return sorted({max(1.0, math.ceil(p / 3)), max(1.0, float(p // 2)), float(p), 2.0 * p})


def _auto_candidates(
    p: int, m: int, v: int, ranges: list[range], profiles: Sequence[LayerProfile], optimizer_factor: float,
    overheads: tuple[float, float], model: StepModel, sharding: tuple[int, str] = (1, "none"),
    space: SearchSpace | None = None, memory_limit_bytes: float | None = None,
) -> list[Candidate]:
    costs = stage_costs(ranges, profiles)
    modes = space.offload if space is not None else ("none",)
    link = space.host_link if space is not None else None
    out = []
    for limit in auto_limits(p):
        schedule = synthesize(p, m, v, costs, overheads[0], limit).chosen.schedule
        for mode in modes:
            cand = _evaluate(schedule, lower(schedule, model.posting), ranges, profiles, optimizer_factor, overheads,
                             True, schedule.split_backwards(), model, sharding, (mode, link), memory_limit_bytes,
                             (space.hosts, space.tp) if space is not None else (None, 1))
            out.append(replace(cand, max_activations=limit))
    return out


def _evaluate(
    schedule: PipelineSchedule, programs: list, ranges: list[range], profiles: Sequence[LayerProfile],
    optimizer_factor: float, overheads: tuple[float, float], takes_chunks: bool,
    weighted: set[tuple[int, int]], model: StepModel | None = None, sharding: tuple[int, str] = (1, "none"),
    offload: tuple[str, HostLink | None] = ("none", None), memory_limit_bytes: float | None = None,
    mesh: tuple[HostPlacement | None, int] = (None, 1),
) -> Candidate:
    """Simulate one layout; its step time, bubble and per-rank memory (`weighted`: the
    schedule's `split_backwards()`, computed once per schedule by the caller; `sharding`: dp
    and ``parallel.shard``; `offload`: the ``pipeline.offload`` mode and the host link its plan
    assumes; `memory_limit_bytes`: what ``auto``'s plan offloads more for where its hidden
    groups leave the layout over it; `mesh`: the hosts and the tp degree, whose mesh orders are
    tried where the ranks fill several hosts)."""
    comm_s, action_s = overheads
    model = model or StepModel()
    cost = action_costs(ranges, profiles, schedule, action_s, weighted)
    mode, link = offload
    copies = None
    offloadable = [0.0] * schedule.num_stages
    if mode != "none":
        offloadable = [c.offloadable for c in stage_bytes(ranges, list(profiles), schedule)]
        copies = OffloadCosts(group_bytes_of(offloadable), link or SearchSpace.host_link)

    def run(plan: OffloadPlan | None, transfer: Callable[[CommOp], float] = lambda op: comm_s) -> SimResult:
        marked = programs if plan is None else [plan.mark(program) for program in programs]
        runtime = replace(model.runtime(schedule.num_ranks, comm_s), transfer=transfer, offload=copies)
        if model.share is None:
            return simulate(schedule, marked, cost, runtime=runtime)
        cpu = [stage_cpu(profiles, r) for r in ranges]
        busy = None if model.busy_factor == 1.0 else (lambda op: transfer(op) * model.busy_factor)
        return simulate_shared(schedule, marked, cost, runtime, model.share, lambda action: cpu[action.stage], busy)

    simulated = functools.lru_cache(maxsize=None)(run)  # a plan simulated once, whether timed, checked or ranked

    param_bytes = [math.fsum(profiles[i].param_bytes for i in r) for r in ranges]
    trains = [trainable_bytes(profiles, r) for r in ranges]  # a LoRA run: gradients, AdamW state of its adapters
    act_bytes = [math.fsum(profiles[i].activation_bytes for i in r) for r in ranges]
    plan = None
    if copies is not None:
        def timed(candidate_plan: OffloadPlan) -> tuple:
            got = simulated(candidate_plan)
            return got.makespan, got.step_times, got.reload_waits

        def fits(candidate_plan: OffloadPlan) -> bool:
            return max(rank_memory(schedule, param_bytes, act_bytes, optimizer_factor, dp=sharding[0], shard=sharding[1],
                                   offload=(candidate_plan, offloadable, simulated(candidate_plan)),
                                   trainable=trains)) <= memory_limit_bytes

        plan = plan_offload(schedule, mode, copies, timed, fits if memory_limit_bytes is not None else None)
    sim, order, after_s = simulated(plan), DEFAULT_ORDER, 0.0
    hosts, tp = mesh
    if hosts is not None and hosts.spans(sharding[0] * schedule.num_ranks * tp):  # each order on the hosts' links
        grads = [p if t is None else t for p, t in zip(param_bytes, trains)]
        chosen = pick(order_steps(schedule, ranges, profiles, sharding[0], tp, hosts, grads,
                                  lambda transfer: run(plan, transfer)))
        sim, order, after_s = chosen.sim, chosen.order, chosen.dp_s + chosen.tp_s
    return Candidate(
        schedule=schedule.name, num_microbatches=schedule.num_microbatches,
        stages_per_rank=schedule.num_stages // schedule.num_ranks,
        split_points=tuple(r.start for r in ranges[1:]), step_s=sim.makespan + model.tail_s + after_s, bubble=sim.bubble,
        rank_bytes=tuple(rank_memory(schedule, param_bytes, act_bytes, optimizer_factor, weighted,
                                     dp=sharding[0], shard=sharding[1],
                                     offload=None if plan is None else (plan, offloadable, sim), trainable=trains)),
        takes_chunks=takes_chunks, offload=mode, offloaded_groups=0 if plan is None else len(plan.reloads), order=order,
    )


def rank_memory(
    schedule: PipelineSchedule, param_bytes: Sequence[float], act_bytes: Sequence[float],
    optimizer_factor: float = 2.0, weighted: set[tuple[int, int]] | None = None,
    microbatch_sizes: Sequence[float] | None = None, dp: int = 1, shard: str = "none",
    offload: tuple[OffloadPlan, Sequence[float], SimResult] | None = None,
    trainable: Sequence[float | None] | None = None,
) -> list[float]:
    """Peak tensor bytes of each rank (`pipeflow.schedules.memory.tensor_memory`, comm buffers
    left out): its stages' parameters, grads (from their first backward on) and optimizer state
    under `shard` over `dp` replicas (``optimizer``: the state / dp; ``full``: all three / dp
    between steps, the unsharded parameters and gradients added during the step), plus the activation bytes held, sampled after every action
    in its order.  `weighted` is accepted for callers that have ``schedule.split_backwards()``
    (unused).  `microbatch_sizes`: each micro-batch's size relative to the one `act_bytes` was
    profiled on (variable lengths: its tokens over the sample's); which micro-batches are in
    flight together then matters.  `offload`: ``pipeline.offload``'s plan, each stage's
    offloadable bytes per micro-batch and the simulated run of the plan (when each copy to the
    host ends): the groups' bytes leave the device and come back as planned.  `trainable`: each
    stage's bytes of parameters that train (None: all), which alone hold gradients and optimizer state."""
    plan, offloadable, sim = offload if offload is not None else (None, [0.0] * len(param_bytes), None)
    trains = trainable if trainable is not None else [None] * len(param_bytes)
    stages = [StageBytes(p, a, offloadable=o, trainable=t)
              for p, a, o, t in zip(param_bytes, act_bytes, offloadable, trains)]
    marked = None  # with a plan: its marks on the actions alone (no comm ops: comm buffers stay left out)
    if plan is not None:
        marked = [plan.mark([Step((), a) for a in actions]) for actions in schedule.actions]
    memory = tensor_memory(schedule, stages, optimizer_factor, dp, shard, microbatch_sizes=microbatch_sizes,
                           timing=sim, programs=marked)
    return [m.peak.total for m in memory]
