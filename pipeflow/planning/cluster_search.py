"""A layout on a described cluster, predicted without the cluster: roofline layer costs
(`pipeflow.planning.costs.roofline`) in, the real lowered program simulated, step time and memory out.

Index letters as in `pipeflow.planning.search`: p = pp ranks, m = micro-batches per replica,
v = stages per rank, b = micro-batch size (samples); t = tp ranks, d = dp replicas.

One layout (:func:`predict`): the layers' costs on one of t ranks at b; stages balanced by time
(or given); the schedule's program for p ranks lowered as NCCL runs it (``group``) and simulated,
each pipeline transfer costed on the link between its two ranks' hosts under the mesh order; the
data-parallel gradient reduction (ring, on the dp group's link) and the optimizer's update follow
the pipeline.  Where m is large the program is simulated at two reduced counts a p apart
(:func:`extrapolation_points`) and the steady state extrapolated linearly (exact once the pipeline is full:
tests/test_cluster_plan.py checks it against the full simulation).  Memory: parameters, gradients
and ``optimizer_factor`` bytes of state per parameter byte, sharded as ``shard`` says, plus the
activations the program holds at its peak (`pipeflow.planning.search.rank_memory`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from pipeflow.errors import ConfigError
from pipeflow.planning.balance import balance_contiguous
from pipeflow.planning.costs.expert import ExpertLayers, ExpertLink, expert_profiles
from pipeflow.planning.hardware import Cluster, Link
from pipeflow.runtime.parallel.mesh_order import MeshGrid
from pipeflow.planning.profile import LayerProfile, action_costs
from pipeflow.planning.costs.layer_trace import LayerShape
from pipeflow.planning.costs.roofline import (Efficiency, Placement, beside, model_flops_per_token, profiles_at,
                                              weight_bytes)
from pipeflow.planning.search import rank_memory
from pipeflow.schedules import LAYOUTS, PipelineSchedule, RuntimeCosts, build_schedule, lower, simulate
from pipeflow.schedules.generators import loop_placement, v_placement
from pipeflow.schedules.ir import ACTIVATION, CommOp

ORDERS = (("dp", "pp", "tp"), ("pp", "dp", "tp"))  # outermost first; tp innermost (a host's GPUs); today's first
HOLD_ALL = ("gpipe", "looped_bfs")  # schedules that hold every micro-batch's activations
OPTIMIZER_FACTOR = 6.0  # bytes of fp32 master weights + Adam m and v per 2-byte parameter byte


@dataclass(frozen=True)
class Layout:
    """One way to run the model: degrees, mesh order, schedule, micro-batching, recomputation.

    Attributes:
        tp, pp, dp: the degrees (t x p x d GPUs).
        schedule: the schedule's name; v its stages per rank.
        microbatch_size: b, samples per micro-batch; m = global batch / (d b).
        recompute: activation checkpointing (every layer's forward again in its backward).
        sequence_parallel: with t > 1, norms and boundaries split along the sequence.
        split_boundary: each tp rank sends a tp-th of a boundary's tensor (Megatron's scatter/gather
            over the inter-host link; with sequence parallelism the tensors are split anyway).
        shard: ``none``, ``optimizer`` (ZeRO-1) or ``full`` (FSDP2) over dp.
        order: the mesh order, outermost first (``parallel.order``).
        overlap_dp: the dp traffic runs behind compute as it becomes ready (Megatron's
            ``--overlap-grad-reduce``/``--overlap-param-gather``, bucketed DDP, FSDP's prefetch):
            only what exceeds the compute it can hide behind is exposed (:func:`dp_exposed_s`).
            False: after the pipeline, whole (pipeflow reduces a stage once its last gradient is done).
        dp_every_microbatch: with ``shard=full``, the dp traffic runs for every micro-batch, not
            once a step: FSDP without gradient accumulation's no_sync (each micro-batch gathers
            the parameters again and reduce-scatters its gradients), as Composer's FSDP does.
        ep: expert parallelism within dp (``parallel.ep``): each of ep consecutive dp ranks holds
            1/ep of every MoE layer's routed experts and exchanges its tokens with the others by
            ``all_to_all`` (:mod:`pipeflow.planning.costs.expert`); it must divide dp.
    """

    tp: int
    pp: int
    dp: int
    schedule: str
    v: int
    microbatch_size: int
    recompute: bool = False
    sequence_parallel: bool = False
    split_boundary: bool = False
    shard: str = "none"
    order: tuple[str, ...] = ("dp", "pp", "tp")
    overlap_dp: bool = False
    ep: int = 1
    dp_every_microbatch: bool = False

    @property
    def expert_replicas(self) -> int:
        """How many dp ranks hold the same routed experts: dp / ep."""
        return self.dp // max(1, self.ep)

    def overrides(self, m: int) -> str:
        """Ready-to-paste train.py overrides."""
        parts = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
                 f"schedule={self.schedule}", f"pipeline.num_microbatches={m}"]
        if LAYOUTS[self.schedule][0] is None:
            parts.append(f"schedule.stages_per_rank={self.v}")
        if self.recompute:
            parts.append("pipeline.checkpoint_activations=true")
        if self.sequence_parallel:
            parts.append("parallel.sequence_parallel=true")
        if self.shard != "none":
            parts.append(f"parallel.shard={self.shard}")
        if self.ep > 1:
            parts.append(f"parallel.ep={self.ep}")
        parts.append(f"'parallel.order=[{','.join(self.order)}]'")  # quoted: brackets are a shell glob
        return " ".join(parts)


@dataclass(frozen=True)
class Prediction:
    """What one layout is predicted to do per training step.

    Attributes:
        layout: the layout; num_microbatches: its m per replica.
        step_s: the step: the pipeline, then the dp reduction and the optimizer's update.
        pipeline_s, dp_s, optimizer_s: those three parts.
        bubble: the pipeline's idle fraction.
        memory_bytes: the busiest GPU's peak tensor bytes.
        tokens_per_s: the cluster's training tokens per second.
        model_tflops_per_gpu, mfu: model FLOPs (no recomputation) per second per GPU, and over its dense peak.
        extrapolated: whether the pipeline was simulated at reduced m and extrapolated.
    """

    layout: Layout
    num_microbatches: int
    step_s: float
    pipeline_s: float
    dp_s: float
    optimizer_s: float
    bubble: float
    memory_bytes: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    extrapolated: bool


@dataclass(frozen=True)
class Workload:
    """The training job: the traced layers, sequence length, global batch (sequences), dtype."""

    shapes: Sequence[LayerShape]
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    attention: str = "fused"  # fused (flash kernels, as pipeflow's SDPA) | legacy | unfused (Placement.attention)
    tp_overlap: bool = False  # the tp collectives behind the matmuls (Placement.tp_overlap)
    # bytes a parameter is kept and gathered in, and a gradient reduced in (0: the compute dtype's):
    # pipeflow's are train.param_dtype's (float32 master weights under autocast: 4 each)
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_factor: float = OPTIMIZER_FACTOR  # optimizer state per parameter byte (pipeflow's AdamW: 2)

    def dp_bytes(self) -> tuple[int, int]:
        """Bytes of a parameter as dp gathers it and of a gradient as dp reduces it."""
        return self.param_bytes or weight_bytes(self.dtype), self.grad_bytes or weight_bytes(self.dtype)


@dataclass(frozen=True)
class RankShare:
    """What the busiest pipeline rank holds of the model, as dp moves it: parameters (elements),
    layers (FSDP2's units) and routed-expert parameters (its ep share)."""

    params: float
    units: int
    experts: float


def rank_layers(ranges: Sequence[range], stage_to_rank: Sequence[int]) -> list[list[int]]:
    """The layers each pipeline rank holds: those of its stages under a placement
    (``schedule.stage_to_rank``)."""
    held: list[list[int]] = [[] for _ in range(max(stage_to_rank) + 1)]
    for stage, rank in enumerate(stage_to_rank):
        held[rank].extend(ranges[stage])
    return held


def placement_of(layout: Layout) -> tuple[int, ...]:
    """Stage to rank of `layout`'s schedule by its registered placement (V-shaped or looped),
    without building it (``auto`` may choose either: the looped one is taken)."""
    v_shaped = LAYOUTS[layout.schedule][1] == ("v",)
    return (v_placement if v_shaped else loop_placement)(layout.pp, layout.v)


def rank_share(work: Workload, profiles: Sequence[LayerProfile], held: Sequence[Sequence[int]], ep: int = 1) -> RankShare:
    """The largest share any pipeline rank holds of `held` (:func:`rank_layers`)."""
    return RankShare(max(math.fsum(profiles[i].params for i in layers) for layers in held),
                     max(len(layers) for layers in held),
                     max(math.fsum(work.shapes[i].expert_params for i in layers) for layers in held) / ep)


def _grid(layout: Layout) -> MeshGrid:
    """The layout's mesh: every rank's coordinates under its order (``parallel.order``)."""
    return MeshGrid(layout.dp, layout.pp, layout.tp, tuple(layout.order))


def _pipeline_link(cluster: Cluster, layout: Layout, a: int, b: int) -> Link:
    grid = _grid(layout)
    return cluster.group_link([grid.rank(0, a, 0), grid.rank(0, b, 0)])


def dp_link(cluster: Cluster, layout: Layout) -> Link:
    """The link the dp group of pipeline rank 0, tp rank 0 reduces over."""
    return cluster.group_link(_grid(layout).dp_groups()[0])


def ep_link(cluster: Cluster, layout: Layout, eff: Efficiency) -> ExpertLink:
    """The link the first ep group (ep consecutive ranks of the first dp group) exchanges over,
    at ``network`` of its bandwidth."""
    link = cluster.group_link(_grid(layout).dp_groups()[0][:layout.ep])
    return ExpertLink(link.bandwidth_gbps * 1e9 * eff.network, link.latency_us * 1e-6)


def tp_link(cluster: Cluster, layout: Layout) -> Link:
    """The link the tp group of the first rank runs its collectives over."""
    return cluster.group_link(_grid(layout).tp_groups()[0])


def stage_ranges(profiles: Sequence[LayerProfile], stages: int) -> list[range]:
    """Layers split into `stages` contiguous stages balanced by F + B + W time."""
    return balance_contiguous([p.forward_s + p.input_grad_s + p.weight_grad_s for p in profiles], stages)


@functools.lru_cache(maxsize=64)
def lowered(name: str, p: int, m: int, v: int) -> tuple[PipelineSchedule, list, set]:
    """The schedule, its programs as NCCL runs them (``group``) and its split backwards (cached:
    the search and the extrapolation ask for the same ones again)."""
    schedule = build_schedule(name, p, m, v if LAYOUTS[name][0] is None else None)
    return schedule, lower(schedule, "group"), schedule.split_backwards()


def simulated_pipeline(layout: Layout, m: int, profiles: Sequence[LayerProfile], ranges: Sequence[range],
                       cluster: Cluster, eff: Efficiency,
                       optimizer_factor: float = OPTIMIZER_FACTOR) -> tuple[float, float, list[float]]:
    """The simulated pipeline of `m` micro-batches: makespan, bubble, each rank's peak tensor bytes."""
    schedule, programs, split = lowered(layout.schedule, layout.pp, m, layout.v)
    cost = action_costs(ranges, profiles, schedule, 0.0, split)
    divide = layout.tp if layout.split_boundary and not layout.sequence_parallel else 1
    out_bytes = [profiles[r[-1]].output_bytes / divide for r in ranges]
    links: dict[tuple[int, int], Link] = {}

    def transfer(op: CommOp) -> float:
        a, b = schedule.stage_to_rank[op.src_stage], schedule.stage_to_rank[op.dst_stage]
        if a == b:
            return 0.0
        link = links.get((a, b)) or links.setdefault((a, b), _pipeline_link(cluster, layout, a, b))
        stage = op.src_stage if op.payload == ACTIVATION else op.dst_stage
        return link.latency_us * 1e-6 + out_bytes[stage] / (link.bandwidth_gbps * 1e9 * eff.network)

    sim = simulate(schedule, programs, cost, runtime=RuntimeCosts(transfer=transfer))
    params = [math.fsum(profiles[i].param_bytes for i in r) for r in ranges]
    acts = [math.fsum(profiles[i].activation_bytes for i in r) for r in ranges]
    memory = rank_memory(schedule, params, acts, optimizer_factor, dp=layout.dp, shard=layout.shard)
    return sim.makespan, sim.bubble, memory


STEADY_FROM_P = ("1f1b", "zb_h1")  # linear in m from m = p on (the others: from 2p)


def extrapolation_points(layout: Layout, m: int) -> tuple[int, int] | None:
    """The two reduced micro-batch counts simulated for `m`, or None: simulate m itself.  Both have
    m's remainder modulo p (interleaved 1F1B groups micro-batches by p) and start where the
    schedule's makespan has become linear in m: p for 1F1B and ZB-H1, 2p for the others."""
    p = layout.pp
    if layout.schedule == "interleaved_1f1b" and m % p:
        return None  # its groups of p make the makespan linear only late unless p divides m (as Megatron needs)
    m1 = (p if layout.schedule in STEADY_FROM_P else 2 * p) + m % p
    m2 = m1 + p
    return (m1, m2) if m > m2 else None


def pipeline_at(layout: Layout, m: int, profiles: Sequence[LayerProfile], ranges: Sequence[range],
                cluster: Cluster, eff: Efficiency, extrapolate: bool = True,
                optimizer_factor: float = OPTIMIZER_FACTOR) -> tuple[float, float, float, bool]:
    """Makespan, bubble and peak bytes of `m` micro-batches: simulated, or extrapolated linearly
    from two reduced counts (:func:`extrapolation_points`); and whether it was extrapolated."""
    points = extrapolation_points(layout, m) if extrapolate else None
    if points is None:
        span, bubble, memory = simulated_pipeline(layout, m, profiles, ranges, cluster, eff, optimizer_factor)
        return span, bubble, max(memory), False
    (m1, m2), runs = points, [simulated_pipeline(layout, k, profiles, ranges, cluster, eff, optimizer_factor)
                              for k in points]
    slope = (runs[1][0] - runs[0][0]) / (m2 - m1)
    span = runs[0][0] + slope * (m - m1)
    memory = max(runs[1][2])  # a schedule holds at most about p micro-batches, whatever m
    if layout.schedule in HOLD_ALL:  # ... except those that hold every one
        memory += (max(runs[1][2]) - max(runs[0][2])) / (m2 - m1) * (m - m2)
    busy = (1 - runs[1][1]) * runs[1][0] * (m / m2)  # a rank's busy time grows with m
    return span, max(0.0, 1 - busy / span), memory, True


def predict(work: Workload, layout: Layout, cluster: Cluster, eff: Efficiency = Efficiency(),
            ranges: Sequence[range] | None = None, extrapolate: bool = True) -> Prediction:
    """The step of `layout` for `work` on `cluster` (the module docstring's model).

    Raises:
        ConfigError, ScheduleError, PartitionError: a layout the model or schedule cannot run.
    """
    b = layout.microbatch_size
    m = work.global_batch // (layout.dp * b)
    place = Placement(layout.tp, layout.sequence_parallel, layout.recompute, work.dtype, tp_link(cluster, layout),
                      work.attention, work.tp_overlap, layout.ep, work.param_bytes)
    profiles = profiles_at(work.shapes, b, place, cluster, eff)
    if layout.ep > 1:
        if layout.dp % layout.ep:
            raise ConfigError(f"parallel.ep={layout.ep} does not divide parallel.dp={layout.dp}: expert "
                              "parallelism splits each dp group's experts; choose an ep dividing dp")
        experts = ExpertLayers(tuple(s.expert_params for s in work.shapes), tuple(s.top_k for s in work.shapes))
        profiles = expert_profiles(profiles, experts, layout.ep, ep_link(cluster, layout, eff))
    stages = layout.pp * layout.v
    ranges = list(ranges) if ranges is not None else stage_ranges(profiles, stages)
    span, bubble, memory, extrapolated = pipeline_at(layout, m, profiles, ranges, cluster, eff, extrapolate,
                                                     work.optimizer_factor)
    simulated = (extrapolation_points(layout, m) or (m,))[-1] if extrapolate else m
    owners = lowered(layout.schedule, layout.pp, simulated, layout.v)[0].stage_to_rank
    share = rank_share(work, profiles, rank_layers(ranges, owners), layout.ep)
    rank_params = share.params
    dp_s = reduction_s(rank_params, layout, cluster, eff, share.units, share.experts, *work.dp_bytes())
    if layout.overlap_dp and layout.dp > 1:
        forward = math.fsum(p.forward_s for p in profiles) / layout.pp  # a micro-batch's, per rank
        backward = math.fsum(p.backward_s for p in profiles) / layout.pp
        dp_s = dp_exposed_s(dp_s, layout, m, forward, backward, eff, gather_share(layout, work))
    elif layout.dp_every_microbatch:
        dp_s *= m
    update_s = optimizer_s(rank_params, layout, cluster, eff, share.experts)
    step = span + dp_s + update_s
    tokens = work.global_batch * work.seq_len
    gpus = layout.tp * layout.pp * layout.dp
    flops = model_flops_per_token(work.shapes, work.seq_len) * tokens / step / gpus
    return Prediction(layout, m, step, span, dp_s, update_s, bubble, memory, tokens / step, flops / 1e12,
                      flops / cluster.gpu.peak_flops(work.dtype), extrapolated)


def gather_share(layout: Layout, work: Workload) -> float:
    """The share of the dp traffic's bytes that gathers parameters (each of FSDP2's two gathers;
    ZeRO-1's one), the rest reducing gradients: by the bytes each moves per element."""
    p, g = work.dp_bytes()
    return p / (2 * p + g) if layout.shard == "full" else p / (p + g)


def dp_exposed_s(whole_s: float, layout: Layout, m: int, forward_s: float, backward_s: float,
                 eff: Efficiency = Efficiency(), gather: float | None = None) -> float:
    """The dp traffic's exposed seconds where it overlaps compute (``Layout.overlap_dp``):
    `whole_s` is all of it (:func:`reduction_s`); `forward_s`, `backward_s` one micro-batch's on
    the busiest rank.  Replicas (``none``): the gradients' all-reduce behind the last
    micro-batch's backward.  ZeRO-1: the reduce-scatter there, the parameters' all-gather behind
    the next step's first forward.  FSDP2: the gather behind the forwards, the gather and
    reduce-scatter of the backward behind the backwards.  What hides still costs the compute
    beside it ``eff.overlap`` of its time (:func:`~pipeflow.planning.costs.roofline.beside`);
    a last piece (a layer's worth, 1/16 here) never hides.  `gather`: the share of `whole_s` each
    parameter gather takes (:func:`gather_share`; None: equal bytes, a third for FSDP2, half for ZeRO-1)."""
    if layout.shard == "full":
        ahead = whole_s * (1 / 3 if gather is None else gather)  # the forward's gather; the backward has the rest
        if layout.dp_every_microbatch:  # each micro-batch's behind its own compute
            return m * (beside(ahead, forward_s, eff) + beside(whole_s - ahead, backward_s, eff) + whole_s / 16)
        # once a step, as pipeflow's shard points (and at m = 1, FSDP's)
        return beside(ahead, m * forward_s, eff) + beside(whole_s - ahead, m * backward_s, eff) + whole_s / 16
    if layout.shard == "optimizer":
        ahead = whole_s * (1 / 2 if gather is None else gather)
        return beside(whole_s - ahead, backward_s, eff) + beside(ahead, forward_s, eff) + whole_s / 16
    return beside(whole_s, backward_s, eff) + whole_s / 16


def optimizer_s(rank_params: float, layout: Layout, cluster: Cluster, eff: Efficiency,
                expert_params: float = 0.0) -> float:
    """Seconds of AdamW's update: about 32 bytes read and written per parameter (fp32 master
    weight, m, v, the gradient) at the memory bandwidth, when sharded on a dp-th of them, and of
    the rank's `expert_params` (its ep-th of the routed experts) on a share of the dp / ep ranks
    that hold the same experts."""
    sharded = layout.shard != "none"
    same = layout.expert_replicas
    held = (rank_params - expert_params) / (layout.dp if sharded else 1) + expert_params / (same if sharded else 1)
    return 32.0 * held / (cluster.gpu.memory_bandwidth_gbps * 1e9)


def reduction_s(rank_params: float, layout: Layout, cluster: Cluster, eff: Efficiency, units: int = 1,
                expert_params: float = 0.0, param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Seconds of a step's dp traffic on the dp group's link: a ring all-reduce of `grad_bytes`
    gradients (ZeRO-1: their reduce-scatter and an all-gather of `param_bytes` parameters; FSDP2:
    two gathers and the reduce-scatter); of them, the rank's `expert_params` among the dp / ep
    ranks holding the same experts only.
    FSDP2 pays the ring's latency (:meth:`~pipeflow.planning.hardware.Cluster.ring_latency_s`) in
    each of its three collectives per unit (the rank's `units` layers); the others one link
    latency: their buckets' count is the stack's choice, and a dp group of one GPU per host runs
    NCCL's PAT all-gather and reduce-scatter (log n steps, NCCL 2.23) rather than the ring."""
    d = layout.dp
    if d <= 1:
        return 0.0
    group, link = _grid(layout).dp_groups()[0], dp_link(cluster, layout)
    if layout.shard == "full":
        latency = 3 * units * cluster.ring_latency_s(group)
    else:
        latency = link.latency_us * 1e-6
    per_element = {"full": 2 * param_bytes + grad_bytes, "optimizer": param_bytes + grad_bytes}.get(
        layout.shard, 2 * grad_bytes)
    same = layout.expert_replicas
    moved = (d - 1) / d * (rank_params - expert_params) + (same - 1) / same * expert_params
    return per_element * moved / (link.bandwidth_gbps * 1e9 * eff.network) + latency
