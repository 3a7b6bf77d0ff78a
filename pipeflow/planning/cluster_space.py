"""The cluster planner's search: every (tp, pp, dp, mesh order, schedule, v, micro-batch size,
recomputation, sharding) for a model on a described cluster, pruned in closed form, a shortlist
simulated (`pipeflow.planning.cluster_search.predict`).

Pruning: a layout whose parameters, gradients and optimizer state alone, or with the fewest
activations its schedule can hold (min(m, p) micro-batches of its first rank's stages; GPipe m),
exceed the memory capacity is dropped; the rest are ranked by a closed-form estimate (the rank's
compute x the schedule's unit-cost makespan over its busy time, from the registry's closed
forms; 1F1B's where a schedule has none, plus the dp reduction and the optimizer) and simulated
in that order until no estimate left can beat the shortlist (branch and bound).  Sequence parallelism is always on with tp > 1 (it only saves memory and time here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

from pipeflow.errors import ConfigError, PartitionError, ScheduleError
from pipeflow.planning.cluster_search import (HOLD_ALL, ORDERS, Layout, Prediction, Workload, optimizer_s, placement_of,
                                              predict, rank_layers, rank_share, reduction_s, stage_ranges, tp_link)
from pipeflow.planning.costs.expert import split_expert_profiles
from pipeflow.planning.costs.roofline import Efficiency, Placement, profiles_at
from pipeflow.planning.hardware import Cluster
from pipeflow.runtime.parallel.expert_parallel import check_expert_parallel
from pipeflow.schedules import LAYOUTS, SCHEDULES

CLUSTER_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")


@dataclass(frozen=True)
class ClusterSpace:
    """What the cluster search tries (None: everything that fits the model and the GPUs)."""

    gpus: int
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = CLUSTER_SCHEDULES
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    microbatches: tuple[int, ...] | None = None  # plan.microbatches: allowed m per replica
    max_chunks: int = 4
    recompute: tuple[bool, ...] = (False, True)
    shards: tuple[str, ...] = ("none", "optimizer", "full")
    orders: tuple[tuple[str, ...], ...] = ORDERS
    ep: tuple[int, ...] | None = None  # an MoE model's expert degrees (None: each dividing dp, up to its experts)
    shortlist: int = 12  # layouts kept (the fastest simulated that fit)
    max_simulated: int = 40  # simulations at most (an estimate no lower than the shortlist's slowest stops sooner)


@dataclass(frozen=True)
class Counts:
    """How many layouts the search estimated, pruned by memory and simulated."""

    estimated: int
    pruned: int
    simulated: int


def search_cluster(work: Workload, cluster: Cluster, space: ClusterSpace, capacity_bytes: float,
                   eff: Efficiency = Efficiency()) -> tuple[list[Prediction], Counts]:
    """The ``space.shortlist`` fastest simulated layouts that fit `capacity_bytes` per GPU, fastest
    first, and the search's counts.  Layouts are simulated in the order of their estimates (lower
    bounds in closed form) until the next estimate cannot beat the shortlist's slowest, or
    ``space.max_simulated`` simulations.

    Raises:
        ConfigError: no tp x pp divides the GPUs (or the pinned degrees do not).
    """
    check_fits_somewhere(work, space.gpus, capacity_bytes)
    estimates: list[tuple[float, Layout]] = []
    pruned = 0
    cache: dict = {}
    for layout in _layouts(work, cluster, space):
        got = _estimate(work, layout, cluster, eff, capacity_bytes, cache)
        if got is None:
            pruned += 1
        else:
            estimates.append((got, layout))
    if not estimates and pruned == 0:
        raise ConfigError(f"no layout of plan.gpus={space.gpus}: tp x pp must divide it and dp = gpus / (tp pp) "
                          f"divide data.batch_size={work.global_batch}")
    estimates.sort(key=lambda e: (e[0], e[1].order != ORDERS[0]))  # ties: today's order first
    picks: list[Prediction] = []
    simulated = 0
    orderless: dict[Layout, float] = {}  # a layout whose mesh orders place every group alike: simulated once
    for estimate, layout in estimates:
        if simulated >= space.max_simulated or (len(picks) >= space.shortlist and estimate >= picks[-1].step_s):
            break  # the estimates left cannot beat the shortlist (they bound the step from below)
        if orderless.setdefault(replace(layout, order=()), estimate) == estimate and layout.order != ORDERS[0] \
                and replace(layout, order=ORDERS[0]) in {p.layout for p in picks}:
            continue
        simulated += 1
        try:
            pred = predict(work, layout, cluster, eff)
        except (ScheduleError, PartitionError, ConfigError):
            continue
        if pred.memory_bytes <= capacity_bytes:
            picks.append(pred)
            picks.sort(key=lambda p: (p.step_s, p.memory_bytes))
            del picks[space.shortlist:]
    picks.sort(key=lambda p: (p.step_s, p.memory_bytes))
    return picks, Counts(len(estimates) + pruned, pruned, simulated)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(work: Workload, cluster: Cluster, space: ClusterSpace) -> Iterator[Layout]:
    layers = len(work.shapes)
    tps = space.tp or tuple(t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_host)
    for tp in tps:
        for pp in space.pp or _divisors(space.gpus // tp if space.gpus % tp == 0 else 0):
            if space.gpus % (tp * pp) or pp > layers:
                continue
            dp = space.gpus // (tp * pp)
            if work.global_batch % dp:
                continue
            for b in space.microbatch_sizes:
                if (work.global_batch // dp) % b:
                    continue
                m = work.global_batch // (dp * b)
                if space.microbatches is not None and m not in space.microbatches:
                    continue
                for name, v in _schedules(space, pp, layers):
                    for recompute in space.recompute:
                        for shard in space.shards if dp > 1 else ("none",):
                            for order in space.orders if dp > 1 and pp > 1 else space.orders[:1]:
                                for ep in _expert_degrees(work, space, dp, tp, shard):
                                    yield Layout(tp, pp, dp, name, v, b, recompute, tp > 1, False, shard, order,
                                                 ep=ep)


def _expert_degrees(work: Workload, space: ClusterSpace, dp: int, tp: int = 1, shard: str = "none") -> tuple[int, ...]:
    """The ep degrees to try at `dp`: 1 for a dense model; else each of ``space.ep`` (or every
    divisor of dp up to the experts of a layer) dividing dp that the runtime runs beside `tp` and
    `shard` (:func:`~pipeflow.runtime.parallel.expert_parallel.check_expert_parallel`: ep > 1
    without tp and without ``parallel.shard``); none where a pinned ep cannot run there."""
    experts = max((s.experts for s in work.shapes), default=0)
    if not experts:
        return (1,)
    degrees = tuple(e for e in (space.ep or _divisors(dp))
                    if dp % e == 0 and (space.ep or e <= experts) and _runs_experts(e, dp, tp, shard))
    return degrees if space.ep else (degrees or (1,))


def _runs_experts(ep: int, dp: int, tp: int, shard: str) -> bool:
    try:
        check_expert_parallel(ep, dp, tp, shard, None)
    except ConfigError:
        return False
    return True


def check_fits_somewhere(work: Workload, gpus: int, capacity_bytes: float) -> None:
    """Refuse, before any layout is split, a model whose parameters, gradients and optimizer state
    alone exceed `capacity_bytes` per GPU even spread evenly over all `gpus` (the least any
    layout holds per GPU: tp and pp split the weights at most `gpus` ways, and no sharding
    divides them further).

    Raises:
        ConfigError: naming the parameters, the bytes per GPU and the GPUs it would need.
    """
    params = math.fsum(shape.params for shape in work.shapes)
    total = params * work.dp_bytes()[0] * (2 + work.optimizer_factor)
    if total / gpus > capacity_bytes:
        need = math.ceil(total / capacity_bytes)
        raise ConfigError(f"the model has {params / 1e9:,.1f} B parameters: their weights, gradients and optimizer "
                          f"state are {total / 1e12:,.1f} TB, {total / gpus / 1e9:,.0f} GB per GPU even spread over "
                          f"all plan.gpus={gpus}, over the {capacity_bytes / 1e9:g} GB each can hold; plan for at "
                          f"least plan.gpus={need:,} or a smaller model")


def _schedules(space: ClusterSpace, pp: int, layers: int) -> Iterator[tuple[str, int]]:
    for name in space.schedules:
        needed = LAYOUTS[name][0]
        if pp == 1 and name != "1f1b":
            continue  # one rank: every schedule is gradient accumulation
        for v in (needed,) if needed is not None else range(2, space.max_chunks + 1):
            if pp * v <= layers:
                yield name, v


def _estimate(work: Workload, layout: Layout, cluster: Cluster, eff: Efficiency, capacity: float,
              cache: dict) -> float | None:
    """The closed-form step estimate of `layout`, or None when it cannot fit `capacity` (`cache`
    keeps the layers' costs per (tp, b, recompute) and the balanced splits per stage count)."""
    p, v, b = layout.pp, layout.v, layout.microbatch_size
    key = (layout.tp, b, layout.recompute, layout.sequence_parallel, tp_link(cluster, layout), layout.ep)
    if key not in cache:
        cache[key] = profiles_at(work.shapes, b, Placement(key[0], key[3], key[2], work.dtype, key[4], ep=key[5],
                                                           param_bytes=work.param_bytes),
                                 cluster, eff)
    profiles = cache[key]
    if layout.ep > 1:  # a rank's share of the experts (its exchanges left out: the estimate stays a lower bound)
        profiles = cache.get((key, "ep", layout.ep)) or cache.setdefault(
            (key, "ep", layout.ep), split_expert_profiles(profiles, [s.expert_params for s in work.shapes], layout.ep))
    m = work.global_batch // (layout.dp * b)
    try:
        ranges = cache.get((key, p * v)) or cache.setdefault((key, p * v), stage_ranges(profiles, p * v))
    except PartitionError:
        return None
    layers_of = rank_layers(ranges, placement_of(layout))
    compute = [math.fsum(profiles[i].forward_s + profiles[i].backward_s for i in layers) for layers in layers_of]
    params = max(math.fsum(profiles[i].param_bytes for i in layers) for layers in layers_of)
    state = params * (2 + work.optimizer_factor / (layout.dp if layout.shard != "none" else 1))
    held = m if layout.schedule in HOLD_ALL else min(m, p)  # micro-batches of all its stages rank 0 holds at least
    first = math.fsum(profiles[i].activation_bytes for i in layers_of[0])
    if state + held * first > capacity:
        return None
    form = SCHEDULES[layout.schedule].closed_form or SCHEDULES["1f1b"].closed_form
    unit = form.makespan(p, m, v) if form is not None else None
    ratio = unit / (3 * v * m) if unit else (m + p - 1) / m
    share = rank_share(work, profiles, layers_of, layout.ep)
    return ratio * m * max(compute) + reduction_s(share.params, layout, cluster, eff, share.units, share.experts,
                                                  *work.dp_bytes()) \
        + optimizer_s(share.params, layout, cluster, eff, share.experts)


def pinned(space: ClusterSpace, tp: int | None, pp: int | None, ep: int | None = None) -> ClusterSpace:
    """`space` with tp, pp and ep pinned where given (``parallel.tp`` > 1, ``parallel.pp``,
    ``parallel.ep`` > 1)."""
    return replace(space, tp=(tp,) if tp else space.tp, pp=(pp,) if pp else space.pp, ep=(ep,) if ep else space.ep)
