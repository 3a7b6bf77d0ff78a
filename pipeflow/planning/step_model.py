"""The whole training step before it runs: the layers' profiles plus what the runtime adds.

The start-of-run prediction and the planner simulate the program the runtime interprets (its
lowering: when recvs are posted and waited) with

    F, B, W          the profiled layers of each stage, plus a measured per-action overhead
                     (an action through the stage's own code path, beyond the layer's work)
    transfer         latency + bytes x per_byte, measured on the pipeline group at start, both
                     directions, at the sizes this model sends; posting a step's ops, measured
    tp collectives   each tp group's all-reduce measured at start, in place of the NVLink-class
                     link the profiles were split over
    ep exchanges     the MoE layers' all_to_alls (`pipeflow.planning.costs.expert`) on the ep
                     groups' link measured at start, in place of the assumed one
    cores shared     where the ranks of a machine need more threads than it has cores (4 ranks on 2
                     cores; emulated hosts, network namespaces of one kernel, share its cores), an
                     action runs slower by the number of threads computing at the same time over
                     the cores (processor sharing, found by iterating the simulation:
                     a lone layer profiled on an idle rank is not what the run sees); transfers,
                     which need the CPUs of both sides, by the step's mean slow-down
    tail             what follows the pipeline: the grad-norm all-reduce (measured), the
                     data-parallel reduction (measured per byte) and the optimizer step (timed on
                     a scratch copy of the rank's parameters)

The runtime's own costs are timed by :mod:`pipeflow.planning.costs.runtime_timing`.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.planning.profile import release_cached_memory
from pipeflow.planning.costs.runtime_timing import measure_action_overhead_s, measure_tail_parts
from pipeflow.runtime.world import hosts
from pipeflow.schedules import PipelineSchedule, Program, RuntimeCosts, SimResult, simulate
from pipeflow.schedules.ir import Action, CommOp
from pipeflow.schedules.offload import OffloadCosts, OffloadPlan

_ITERATIONS = 12  # processor-sharing fixed point: simulations at most


@dataclass(frozen=True)
class HostShare:
    """How the pipeline's ranks share a host's cores.

    Attributes:
        cores: cores the process may run on.
        threads_per_rank: compute threads of a rank (``torch.get_num_threads()``).
        ranks_per_pipeline_rank: processes of the host per pipeline rank simulated (data-parallel
            replicas on the same host compute in step with it).
        device: ``cpu`` (shared cores slow compute down) or an accelerator (they do not).
    """

    cores: int = 1
    threads_per_rank: int = 1
    ranks_per_pipeline_rank: float = 1.0
    device: str = "cpu"

    def slowdown(self, computing: float) -> float:
        """How much slower an action runs while `computing` pipeline ranks (itself included) compute."""
        if self.device != "cpu":
            return 1.0
        return max(1.0, computing * self.ranks_per_pipeline_rank * self.threads_per_rank / self.cores)


def host_share(num_pp: int, device: torch.device) -> HostShare:
    """This machine as the run sees it: its cores, threads per rank, and the ranks that share its
    cores per pipeline rank (:func:`ranks_sharing_cores`; on a CPU, collective where the world has
    several ranks)."""
    cores = hosts.usable_cores()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    kind = torch.device(device).type
    if kind == "cpu" and dist.is_initialized() and dist.get_world_size() > 1:  # accelerators share no cores
        mine = (hosts.machine_id().partition("/net:")[0], tuple(sorted(cores)))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        local = ranks_sharing_cores(every, dist.get_rank(), local)
    return HostShare(len(cores), torch.get_num_threads(), max(1.0, local / max(1, num_pp)), kind)


def ranks_sharing_cores(ranks: Sequence[tuple[str, Sequence[int]]], rank: int, fallback: int) -> int:
    """How many ranks (`rank` included) compute on `rank`'s cores: those on its machine (the same
    boot id: emulated hosts and containers share one kernel) whose cores overlap its own (a
    container pinned to other cores does not count).  `ranks`: each rank's (boot id, cores);
    `fallback` (the launcher's local ranks) where a boot id is unknown."""
    boot, cores = ranks[rank][0], set(ranks[rank][1])
    if boot in ("", "?"):
        return fallback
    return sum(1 for other, theirs in ranks if other == boot and cores.intersection(theirs))


@dataclass(frozen=True)
class StepCosts:
    """The runtime's costs beyond the profiled layers (seconds; see the module docstring).

    Attributes:
        posting: the lowering the runtime interprets.
        latency_s, per_byte_s: a transfer's ``latency_s + bytes * per_byte_s`` between idle ranks.
        busy_latency_s, busy_per_byte_s: the same while every rank of the host computes; the
            simulation takes the share of the step the host computes between the two.
        post_s: posting a step's ops.
        action_overhead_s: added to every F, B, W.
        tail_s: after the pipeline (dp reduction, grad-norm all-reduce, optimizer).
        dp_reduce_s: the dp reduction's part of `tail_s` (the slowest dp group's).
        tp_links: with tp > 1, each tp group's all-reduce measured at start: the layers'
            collectives are costed on their pipeline rank's tp link, not the assumed one.
        ep_links: with ep > 1, the ep groups' all_to_all measured at start
            (`pipeflow.planning.ep_links`): the MoE layers' exchanges are costed on it.
        cp_link: with cp > 1, a pass round the cp ring measured at start: the attention's passes
            are costed on it, less the compute they hide behind (`pipeflow.planning.costs.context`).
        overlap_pairs: ``pipeline.overlap_pairs``: the schedule's overlapped pairs are simulated
            interleaved, the MoE layers' exchanges of each action behind the other's compute.
        share: the host's cores and the ranks sharing them.
        links: where the job spans several hosts, every pair of pipeline ranks measured on its
            own (:mod:`pipeflow.planning.links`): each transfer is costed on its link, plus
            what the host's computing adds (busy minus idle, from the ring figures).
        rehearsed: where the program was rehearsed before the run
            (:mod:`pipeflow.planning.rehearsal`), what the rehearsal calibrated: the prediction
            simulates with its costs instead of the profile and the models above.
    """

    posting: str = "rendezvous"
    latency_s: float = 0.0
    per_byte_s: float = 0.0
    post_s: float = 0.0
    action_overhead_s: float = 0.0
    tail_s: float = 0.0
    share: HostShare = HostShare(cores=1 << 30)  # default: never shared
    busy_latency_s: float | None = None  # the transfer while every rank computes (None: as idle)
    busy_per_byte_s: float | None = None
    rehearsed: Any = None  # a Calibration of the program rehearsed before the run (`rehearsal`)
    links: Any = None  # PipelineLinks: each pair of pipeline ranks measured alone (several hosts)
    dp_reduce_s: float = 0.0  # the slowest dp group's gradient all-reduce (part of tail_s)
    dp_groups: tuple = ()  # several hosts: ((global ranks, all-reduce s), ...) of every dp group
    tp_links: Any = None  # TpLinks: tp > 1, each tp group's all-reduce measured (`pipeflow.planning.tp_links`)
    ep_links: Any = None  # EpLinks: ep > 1, the ep groups' all_to_all measured (`pipeflow.planning.ep_links`)
    overlap_pairs: bool = False  # the run overlaps dualpipev's pairs (pipeline.overlap_pairs): simulated so
    cp_link: Any = None  # TensorLink: cp > 1, a pass round the cp ring measured (`pipeflow.planning.costs.context`)
    # parallel.shard=full: one stage's gather (and its reshard's reduce-scatter), seconds, from the
    # dp reduction measured at start; the program's shard points are simulated with it
    shard_s: float | None = None


def simulate_shared(
    schedule: PipelineSchedule, programs: list[Program], cost: Callable[[Action], float], runtime: RuntimeCosts,
    share: HostShare, cpu: Callable[[Action], float] = lambda action: 1.0,
    busy_transfer: Callable[[CommOp], float] | None = None, shard_cost: float = 0.0,
) -> SimResult:
    """Simulate with actions slowed down by the cores they share (processor sharing).

    Each action's CPU part (`cpu`: its CPU time over its wall time, the profile's
    ``cpu_fraction``) runs ``share.slowdown`` slower, of the mean CPU-weighted number of ranks
    computing during it, taken from the previous simulation; damped iterations until the step
    moves by less than 0.1%.  Transfers are stretched by the busy-time-weighted mean slow-down,
    or with `busy_transfer` (a transfer while every rank computes) are ``idle + (busy - idle) x
    u``, u the share of the step the ranks spend computing (their CPU part).
    """
    slow: dict[Action, float] = {}
    mean_slow, used, previous, sim = 1.0, 0.0, math.inf, None
    base = runtime.transfer or (lambda op: 0.0)
    for _ in range(_ITERATIONS):
        if busy_transfer is None:
            stretched = replace(runtime, transfer=lambda op, f=mean_slow: base(op) * f)
        else:
            stretched = replace(runtime, transfer=lambda op, u=used: base(op) + (busy_transfer(op) - base(op)) * u)
        sim = simulate(schedule, programs, lambda a: cost(a) * slow.get(a, 1.0), runtime=stretched, shard_cost=shard_cost)
        if abs(sim.makespan - previous) <= 1e-3 * sim.makespan:
            break
        previous = sim.makespan
        computing = _mean_concurrency(sim.timeline, cpu)
        slow = {a: 0.5 * slow.get(a, 1.0) + 0.5 * (1.0 + (share.slowdown(n) - 1.0) * min(1.0, cpu(a)))
                for a, n in computing.items()}
        busy = [(end - start, slow[a]) for _, a, start, end in sim.timeline if end > start]
        total = math.fsum(d for d, _ in busy)
        mean_slow = math.fsum(d * f for d, f in busy) / total if total > 0 else 1.0
        cpu_time = math.fsum((end - start) * cpu(a) for _, a, start, end in sim.timeline)
        used = min(1.0, cpu_time / (schedule.num_ranks * sim.makespan)) if sim.makespan > 0 else 0.0
    assert sim is not None
    return sim


def _mean_concurrency(timeline: Sequence[tuple[int, Action, float, float]], cpu: Callable[[Action], float]
                      ) -> dict[Action, float]:
    """For every action, the mean number of ranks computing during it (itself included), each
    counted by its CPU use."""
    out = {}
    for r, a, start, end in timeline:
        span = end - start
        if span <= 0:
            out[a] = 1.0
            continue
        overlap = math.fsum(max(0.0, min(end, e) - max(start, s)) * cpu(b) for q, b, s, e in timeline if q != r)
        out[a] = cpu(a) + overlap / span
    return out


def op_bytes(boundary_bytes: Sequence[float]) -> Callable[[CommOp], float]:
    """Bytes an op carries: the outputs of the stage whose activations (or their gradients) it moves."""
    return lambda op: boundary_bytes[op.src_stage if op.payload == "act" else op.dst_stage]


def measure_step_costs(
    comm: Any, posting: str, params: Sequence[torch.Tensor], boundary_bytes: Sequence[float], num_pp: int,
    dp_group: Any = None, dp: int = 1, action_overhead_s: float | None = None, busy: bool = True,
    fused: bool | None = None, schedule: PipelineSchedule | None = None, grid: Any = None,
    tp_group: Any = None, tp_payload: float = 0.0, sequence_parallel: bool = False,
    ep_group: Any = None, experts: Any = None, cp_comm: Any = None, ring_payload: float = 0.0,
) -> StepCosts:
    """Measure the runtime's costs on this run's own groups at start (collective over the world):
    transfers at the model's boundary sizes (and a quarter of the largest, for the per-byte
    term), also while the host computes (unless not `busy`: a rehearsal will see that), posting,
    the per-action overhead (unless given), the tail (AdamW fused as `fused`, ``optim.fused``);
    the slowest rank's figures.  Where the job spans several hosts and `schedule` and `grid`
    (the mesh's :class:`~pipeflow.runtime.parallel.mesh_order.MeshGrid`) are given, every link of the
    program too, and each dp group's all-reduce apart.  With tp > 1 (`tp_group`, `grid`) each tp
    group's all-reduce at `tp_payload` bytes (the layers' largest collective), in the same pass;
    with ep > 1 (`ep_group`, `experts`: an :class:`~pipeflow.planning.ep_links.ExpertExchange`)
    the ep groups' all_to_all too; with cp > 1 (`cp_comm`, the cp group's transport) a pass round
    the cp ring at `ring_payload` bytes (the layers' largest) and a quarter of it."""
    from pipeflow.planning.costs.comm import measure_transfers
    from pipeflow.planning.links import measure_links

    device = comm.device
    largest = int(max(boundary_bytes, default=0.0)) or 4096
    sizes = sorted({int(b) for b in boundary_bytes if b > 0} | {largest, max(4, largest // 4)})
    latency, per_byte, post = measure_transfers(comm, sizes)
    busy_latency, busy_per_byte = measure_transfers(comm, sizes, busy=True)[:2] if busy else (None, None)
    links = None
    several = grid is not None and len(hosts.table().hosts) > 1
    if several and schedule is not None and comm.size > 1:
        links = measure_links(comm, schedule, sizes, grid.pipelines())
    tp_links = None
    if tp_group is not None and grid is not None and grid.tp > 1:
        from pipeflow.planning.tp_links import measure_tp_links

        tp_links = measure_tp_links(device, tp_group, grid, tp_payload, sequence_parallel)
    ep_links = None
    if ep_group is not None and experts is not None:
        from pipeflow.planning.ep_links import measure_ep_links

        ep_links = measure_ep_links(device, ep_group, experts)
    cp_link = None
    if cp_comm is not None and cp_comm.size > 1:
        from pipeflow.planning.tp_links import link_of

        ring = int(ring_payload) or 4096
        cp_link = link_of(*measure_transfers(cp_comm, [ring, max(4, ring // 4)])[:2])
    overhead = measure_action_overhead_s(device) if action_overhead_s is None else action_overhead_s
    reduce_s, rest = measure_tail_parts(params, device, dp_group, dp, fused=fused)
    release_cached_memory(device)  # the transfers' buffers too
    figures = torch.tensor([overhead, reduce_s + rest, reduce_s], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    groups: tuple[tuple[tuple[int, ...], float], ...] = ()
    if several and dp > 1:  # each dp group's all-reduce apart, to name one far slower than the others
        each = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(each, torch.tensor([reduce_s], dtype=torch.float64, device=device))
        seconds = [float(t.item()) for t in each]
        groups = tuple((tuple(g), max(seconds[r] for r in g)) for g in grid.dp_groups())
    overhead, tail, reduce_s = figures.tolist()
    if action_overhead_s is not None:
        overhead = action_overhead_s
    return StepCosts(posting, latency, per_byte, post, overhead, tail, host_share(num_pp, device), busy_latency,
                     busy_per_byte, links=links, dp_reduce_s=reduce_s, dp_groups=groups, tp_links=tp_links,
                     ep_links=ep_links, cp_link=cp_link)


def with_fsdp_shards(costs: StepCosts, dp: int, stages_here: int) -> StepCosts:
    """`costs` for ``parallel.shard=full``: each of this rank's `stages_here` stages gathers its
    whole parameters at the program's shard points and reduce-scatters their gradients at its
    reshard point, so the dp all-reduce leaves the tail.  `costs.dp_reduce_s` timed an all-reduce
    of this rank's shards (n bytes: 2 (dp-1)/dp n on a ring); a gather of the whole (dp n bytes)
    moves (dp-1) n, dp / 2 of it, and the reduce-scatter as much."""
    return replace(costs, shard_s=costs.dp_reduce_s * dp / 2 / max(1, stages_here),
                   tail_s=max(0.0, costs.tail_s - costs.dp_reduce_s))


def predict_step(
    schedule: PipelineSchedule, ranges: Sequence[range], profiles: Sequence[Any], costs: StepCosts,
    offload: tuple[OffloadPlan, OffloadCosts] | None = None,
) -> SimResult:
    """Simulate the whole step (see the module docstring); its makespan excludes the tail.  A
    rehearsed program (`costs.rehearsed`) is simulated with the rehearsal's calibrated costs.
    `offload`: ``pipeline.offload``'s plan marked in the programs and its copies timed."""
    from pipeflow.planning.profile import action_costs
    from pipeflow.schedules import lower

    plan, copies = offload if offload is not None else (None, None)
    shard = costs.shard_s is not None  # FSDP2's gathers and reduce-scatters at the program's shard points
    exchanges = costs.ep_links.exchanges(profiles, ranges) if costs.ep_links is not None else None
    if costs.rehearsed is not None:  # rehearsed on the run's own links: their cost is in its transfers
        cal = costs.rehearsed
        # pairs rehearsed interleaved: their exchanges' overlap is in the calibrated costs already
        runtime = replace(cal.runtime(), offload=copies, exchanges=None if cal.overlap else exchanges)
        return simulate(schedule, lower(schedule, cal.posting, shard=shard, offload=plan, overlap=costs.overlap_pairs),
                        cal.action_cost(schedule), runtime=runtime, shard_cost=costs.shard_s or 0.0)

    if costs.tp_links is not None:  # the layers' tp collectives on their group's measured link
        profiles = costs.tp_links.profiles(profiles, ranges, schedule.stage_to_rank)
    if costs.ep_links is not None:  # the MoE layers' exchanges on the ep groups' measured link
        profiles = costs.ep_links.profiles(profiles)
    if costs.cp_link is not None:  # the attention's passes round the cp ring, what compute leaves exposed
        from pipeflow.planning.costs.context import ring_profiles

        profiles = ring_profiles(profiles, costs.cp_link)
    boundary = [float(profiles[r.stop - 1].output_bytes) for r in ranges]
    bytes_of, p = op_bytes(boundary), schedule.num_ranks
    idle = transfer_cost(costs, bytes_of)
    runtime = RuntimeCosts(idle, [0.0] * p, [costs.post_s] * p, offload=copies, exchanges=exchanges,
                           bucket=link_buckets(costs, bytes_of))
    cost = action_costs(ranges, profiles, schedule, costs.action_overhead_s)
    fraction = [stage_cpu(profiles, r) for r in ranges]
    busy = None
    if costs.busy_latency_s is not None:
        per_byte = costs.per_byte_s if costs.busy_per_byte_s is None else costs.busy_per_byte_s
        if costs.links is None:
            busy = lambda op: costs.busy_latency_s + per_byte * bytes_of(op)  # noqa: E731
        else:  # the op's own link, plus what the host's computing adds to a transfer
            busy = lambda op: idle(op) + max(0.0, costs.busy_latency_s - costs.latency_s  # noqa: E731
                                             + (per_byte - costs.per_byte_s) * bytes_of(op))
    return simulate_shared(schedule, lower(schedule, costs.posting, shard=shard, offload=plan, overlap=costs.overlap_pairs),
                           cost, runtime, costs.share, lambda action: fraction[action.stage], busy,
                           shard_cost=costs.shard_s or 0.0)


def transfer_cost(costs: StepCosts, bytes_of: Callable[[CommOp], float]) -> Callable[[CommOp], float]:
    """An op's transfer seconds between idle ranks: on its own link where the links were measured
    (several hosts: within a burst, :func:`link_buckets` adds the rest), else the ring's figures."""
    if costs.links is None:
        return lambda op: costs.latency_s + costs.per_byte_s * bytes_of(op)

    def on_link(op: CommOp) -> float:
        link = costs.links.of(op)
        if link is None:  # a pair the measurement did not see: the ring's figures
            return costs.latency_s + costs.per_byte_s * bytes_of(op)
        return link.burst_seconds(bytes_of(op))

    return on_link


def link_buckets(costs: StepCosts, bytes_of: Callable[[CommOp], float]) -> Callable[[CommOp], Any] | None:
    """Where the links were measured, each op's transfer queued on its link (its burst and
    sustained rate: :class:`~pipeflow.schedules.Bucket`); None with the ring's figures."""
    if costs.links is None:
        return None

    def bucket(op: CommOp) -> Any:
        link = costs.links.of(op)
        return None if link is None else link.bucket(bytes_of(op))

    return bucket


def stage_cpu(profiles: Sequence[Any], layers: range) -> float:
    """A stage's CPU fraction (CPU time over wall time): its layers', weighted by their time."""
    seconds = [profiles[i].seconds for i in layers]
    total = math.fsum(seconds)
    if total <= 0:
        return 1.0
    return math.fsum(profiles[i].cpu_fraction * t for i, t in zip(layers, seconds)) / total


def describe_costs(costs: StepCosts) -> str:
    """The runtime's costs in one phrase for the start-of-run report."""
    cal = costs.rehearsed
    if cal is not None:
        return (f"rehearsed {cal.steps} steps on the first batch, posting {cal.posting}: transfer "
                f"{1e3 * cal.latency_s:.3f} ms + {1e9 * cal.per_byte_s:.3f} ms/MB, tail {1e3 * costs.tail_s:.2f} ms")
    share = costs.share
    shared = (f", {share.ranks_per_pipeline_rank * share.threads_per_rank:g} thread(s) per pipeline rank on "
              f"{share.cores} cores" if share.device == "cpu" else "")
    busy = ("" if costs.busy_latency_s is None else
            f" ({1e3 * costs.busy_latency_s:.3f} ms + {1e9 * (costs.busy_per_byte_s or 0.0):.3f} ms/MB while the host computes)")
    reduce = f" (dp all-reduce {1e3 * costs.dp_reduce_s:.2f} ms)" if costs.dp_reduce_s > 0 else ""
    if costs.tp_links is not None:
        reduce += f", {costs.tp_links.phrase()}"
    if costs.ep_links is not None:
        reduce += f", {costs.ep_links.phrase()}"
    if costs.cp_link is not None:
        from pipeflow.planning.tp_links import link_text

        reduce += f", cp ring pass {link_text(costs.cp_link)}"
    return (f"posting {costs.posting}, transfer {1e3 * costs.latency_s:.3f} ms + {1e9 * costs.per_byte_s:.3f} ms/MB{busy}, "
            f"{1e3 * costs.action_overhead_s:.3f} ms per action, tail {1e3 * costs.tail_s:.2f} ms{reduce}{shared}")
