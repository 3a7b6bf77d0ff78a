"""``parallel.order=auto``: the mesh order whose predicted step is the fastest on the links
measured at start.

Which order is right depends on the model and the machines.  A model whose gradients dominate
the bytes (wide layers, short sequences, few micro-batches) wants its data-parallel groups on
the fast links inside a host and its pipeline boundaries across hosts (pp outermost, as
Megatron and torchtitan lay it out); a model whose activations dominate wants the opposite
(pipeflow's ``[dp,pp,tp]``).  Before the mesh exists, every rank times one exchange with a
rank of its own host and one with a rank of another host (:func:`measure_host_links`); each
order's step is then predicted by the simulator on the profiled layers: every boundary on the
link its ranks use (the slowest replica's), the data-parallel all-reduce of each pipeline rank's
gradients and the tensor-parallel all-reduces of its layers on the link their group crosses
(ring collectives, each as slow as its slowest link).  One host: every link alike, the order kept.  Another order is taken only
when predicted at least :data:`MARGIN` faster (ties and noise keep ``[dp,pp,tp]``).
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.planning.links import Link, PipelineLinks, link_pairs, probe_pair, world_max
from pipeflow.planning.step_model import StepCosts, predict_step
from pipeflow.runtime.world import hosts
from pipeflow.runtime.parallel.mesh_order import DEFAULT_ORDER, MeshGrid, order_text
from pipeflow.schedules import PipelineSchedule

MARGIN = 0.02  # another order must be predicted this much faster than [dp,pp,tp]


@dataclass(frozen=True)
class HostLinks:
    """A transfer's ``(latency s, s per byte)`` between two ranks of one host and of two hosts (at
    the sustained rate), and the bytes each passes at line rate after a pause (its burst:
    :func:`~pipeflow.planning.links.probe_pair`)."""

    intra: tuple[float, float]
    inter: tuple[float, float]
    intra_burst: float = 0.0
    inter_burst: float = 0.0

    def link(self, across: bool, pair: tuple[int, int]) -> Link:
        """The link between pipeline ranks `pair`, within a host or (`across`) between hosts."""
        (latency, per_byte), burst = (self.inter, self.inter_burst) if across else (self.intra, self.intra_burst)
        return Link(pair, latency, per_byte, burst_bytes=burst)

    def seconds(self, across: bool, num_bytes: float) -> float:
        """One transfer of `num_bytes` within a host or (`across`) between hosts."""
        latency, per_byte = self.inter if across else self.intra
        return latency + per_byte * num_bytes

    def describe(self) -> str:
        """``within a host 0.05 ms + 2100 MB/s, across hosts 0.4 ms + 11.9 MB/s``."""
        def one(fig: tuple[float, float], burst: float) -> str:
            return (f"{1e3 * fig[0]:.3f} ms + " + (f"{1e-6 / fig[1]:.1f} MB/s" if fig[1] > 0 else "no per-byte cost")
                    + (f", bursts of {burst / 1e3:.0f} KB" if burst > 0 else ""))
        return f"within a host {one(self.intra, self.intra_burst)}, across hosts {one(self.inter, self.inter_burst)}"


def host_of_rank(world: int) -> list[int]:
    """Each global rank's host index in the job's host table (all 0 on one host)."""
    table = hosts.table()
    index = [0] * world
    for k, (_, _, ranks) in enumerate(table.hosts):
        for r in ranks:
            if r < world:
                index[r] = k
    return index


def measure_host_links(device: torch.device, host_index: Sequence[int]) -> HostLinks:
    """Time an exchange between a pair of ranks of one host and a pair on two hosts (collective
    over the world; every rank returns the same figures).  The pairs are the first two ranks of
    host 0, and the first ranks of hosts 0 and 1 (where host 0 runs one rank, the figures
    within a host are taken as those across: nothing runs within a host then)."""
    from pipeflow.runtime.transport import P2PComm

    comm = P2PComm(None, device)
    comm.warmup()  # NCCL: the first batched call on a group involves all its ranks
    first = [host_index.index(h) for h in sorted(set(host_index))]
    same = [r for r in range(len(host_index)) if host_index[r] == 0][:2]
    pairs = [tuple(same) if len(same) == 2 else None, (first[0], first[1]) if len(first) > 1 else None]
    figures = torch.zeros(2, 3, dtype=torch.float64, device=device)
    figures[:, 2] = -math.inf  # ranks outside a pair leave the burst to its ends
    for k, pair in enumerate(pairs):
        if pair is None:
            continue
        peer = (pair[1] if pair[0] == comm.rank else pair[0]) if comm.rank in pair else None
        latency, per_byte, burst = probe_pair(comm, peer, world_max(device), "time a host link for parallel.order=auto")
        if peer is not None:
            figures[k] = torch.tensor([latency, per_byte, -burst], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slower end's figures, the smaller burst
    intra, inter = ((row[0], row[1], -row[2]) for row in figures.cpu().tolist())
    if pairs[0] is None:
        intra = inter
    if pairs[1] is None:
        inter = intra
    return HostLinks(intra[:2], inter[:2], intra[2], inter[2])  # type: ignore[arg-type]


def ring_allreduce_s(links: HostLinks, group: Sequence[int], host_index: Sequence[int], num_bytes: float) -> float:
    """A ring all-reduce of `num_bytes` over the global ranks `group`: 2 (n - 1) steps of
    ``bytes / n``, each as slow as the slowest link of the ring (across hosts where it crosses)."""
    n = len(group)
    if n < 2 or num_bytes <= 0:
        return 0.0
    across = len({host_index[g] for g in group}) > 1
    return 2 * (n - 1) * links.seconds(across, num_bytes / n)


def crosses_hosts(pipes: Sequence[Sequence[int]], host_index: Sequence[int], a: int, b: int) -> bool:
    """Whether the boundary between pipeline ranks `a` and `b` crosses hosts in any replica
    (`pipes`: each pipeline's global ranks): it is then as slow as its slowest replica's."""
    return any(host_index[p[a]] != host_index[p[b]] for p in pipes)


def dp_allreduce_s(grid: MeshGrid, links: HostLinks, host_index: Sequence[int],
                   grad_bytes: Callable[[int], float]) -> float:
    """The slowest dp group's ring all-reduce of its pipeline rank's gradients
    (`grad_bytes(pipeline rank)`) under `grid`'s order."""
    return max((ring_allreduce_s(links, group, host_index, grad_bytes(grid.coordinates(group[0])[1]))
                for group in grid.dp_groups()), default=0.0)


def tp_allreduce_s(grid: MeshGrid, links: HostLinks, host_index: Sequence[int], stage_bytes: Sequence[float],
                   microbatches: int, beyond_host: bool = False) -> float:
    """Each micro-batch's tp all-reduces of the busiest stage (`stage_bytes`: the bytes its layers'
    tp plans carry) on the tp group that spans the most hosts; with `beyond_host` only what that
    costs beyond the same group on one host's link (profiles that charge a host's link already)."""
    if grid.tp < 2:
        return 0.0
    worst = max(grid.tp_groups(), key=lambda g: len({host_index[x] for x in g}))
    one_host = [0] * len(host_index)

    def cost(num_bytes: float) -> float:
        spent = ring_allreduce_s(links, worst, host_index, num_bytes)
        return spent - ring_allreduce_s(links, worst, one_host, num_bytes) if beyond_host else spent

    return max(0.0, microbatches * max(cost(b) for b in stage_bytes))


def pick_order(costs: Sequence[Any]) -> Any:
    """The fastest of `costs` (each with ``step_s``; ``[dp,pp,tp]``'s first) where it beats the
    first by :data:`MARGIN`, else the first: ties and noise keep the default order."""
    default = costs[0]
    best = min(costs, key=lambda c: c.step_s)
    return best if best.step_s < (1 - MARGIN) * default.step_s else default


def candidate_orders(dp: int, pp: int, tp: int) -> list[tuple[str, ...]]:
    """Every order that places the ranks differently: dimensions of degree 1 stay where the
    default order has them (moving them changes nothing); the default first."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    moving = [d for d in DEFAULT_ORDER if sizes[d] > 1]
    orders = []
    for perm in itertools.permutations(moving):
        it = iter(perm)
        orders.append(tuple(next(it) if sizes[d] > 1 else d for d in DEFAULT_ORDER))
    return sorted(set(orders), key=lambda o: (o != DEFAULT_ORDER, o))


@dataclass(frozen=True)
class OrderCost:
    """One order's predicted step and its parts (seconds)."""

    order: tuple[str, ...]
    step_s: float
    pipeline_s: float
    dp_s: float
    tp_s: float


def predict_order(order: tuple[str, ...], dp: int, pp: int, tp: int, schedule: PipelineSchedule,
                  ranges: Sequence[range], profiles: Sequence[Any], links: HostLinks,
                  host_index: Sequence[int], grad_bytes: Callable[[int], float]) -> OrderCost:
    """The step `order` is predicted to take: the pipeline simulated with each boundary on its
    link (the slowest replica's), plus the dp all-reduce of the pipeline rank with the most
    gradient bytes (`grad_bytes(pipeline rank)`), plus each micro-batch's tp all-reduces (the
    bytes the layers' tp plans carry, profiled) on the busiest stage."""
    grid = MeshGrid(dp, pp, tp, order)
    pipes = grid.pipelines()
    plinks = []
    for a, b in link_pairs(schedule):
        plinks.append(links.link(crosses_hosts(pipes, host_index, a, b), (a, b)))
    costs = StepCosts(latency_s=links.intra[0], per_byte_s=links.intra[1],
                      links=PipelineLinks(tuple(plinks), tuple(schedule.stage_to_rank)))
    pipeline_s = predict_step(schedule, ranges, profiles, costs).makespan
    dp_s = dp_allreduce_s(grid, links, host_index, grad_bytes)
    per_stage = [sum(profiles[i].tp_forward_bytes + profiles[i].tp_backward_bytes for i in r) for r in ranges]
    tp_s = tp_allreduce_s(grid, links, host_index, per_stage, schedule.num_microbatches)
    return OrderCost(order, pipeline_s + dp_s + tp_s, pipeline_s, dp_s, tp_s)


@dataclass(frozen=True)
class OrderChoice:
    """What ``parallel.order=auto`` weighed: every order's cost on the links timed before the mesh
    existed, and those links, to restate once the run's own prediction is made (:func:`restated`)."""

    chosen: tuple[str, ...]
    costs: tuple[OrderCost, ...]
    links: HostLinks
    measured_s: float
    reprice: Callable[[HostLinks], list[OrderCost]] | None = None  # every order's cost on other link figures

    def restated(self, step_s: float, measured: PipelineLinks | None = None) -> str:
        """The start-of-run line's reason, its steps on the pipeline line's scale: the chosen
        order's step is the run's own prediction `step_s` (profiled layers and the runtime
        measured at start), every other order's that times its ratio, the ratios taken on the
        pipeline's own link figures (`measured`, the links timed pair by pair: one figure per
        link in both lines) where they cover a link within a host or across hosts, else on the
        links timed before the mesh."""
        costs, links, where = self.costs, self.links, f"links timed before the mesh, in {self.measured_s:.2f} s"
        if measured is not None and self.reprice is not None:
            within = [link for link in measured.links if not link.crosses_hosts]
            across = [link for link in measured.links if link.crosses_hosts]
            if within or across:
                links = HostLinks(_median_figures(within) or self.links.intra, _median_figures(across) or self.links.inter,
                                  statistics.median(l.burst_bytes for l in within) if within else self.links.intra_burst,
                                  statistics.median(l.burst_bytes for l in across) if across else self.links.inter_burst)
                costs = tuple(self.reprice(links))
                where = "the pipeline's links as measured pair by pair"
        chosen = next(c for c in costs if c.order == self.chosen)
        scale = step_s / chosen.step_s if chosen.step_s > 0 else math.nan
        said = "; ".join(f"{order_text(c.order)} {1e3 * c.step_s * scale:.1f} ms"
                         + (" (the pipeline's prediction)" if c.order == self.chosen else
                            f" (x{c.step_s / chosen.step_s:.2f})") for c in costs)
        return (f" (parallel.order=auto chose {order_text(self.chosen)}: predicted step {said}; the orders weighed "
                f"on {where}: {links.describe()})")


def _median_figures(links: Sequence[Link]) -> tuple[float, float] | None:
    """The median latency and per-byte cost of `links` (None: no link)."""
    if not links:
        return None
    return statistics.median(l.latency_s for l in links), statistics.median(l.per_byte_s for l in links)


def choose_order(dp: int, pp: int, tp: int, schedule: PipelineSchedule, ranges: Sequence[range],
                 profiles: Sequence[Any] | None, device: torch.device, element_bytes: int
                 ) -> tuple[tuple[str, ...], str, OrderChoice | None]:
    """``parallel.order=auto`` (collective over the world): the order, the start-of-run line
    saying why, and what was weighed (None where nothing was: one host, one dimension above 1,
    or no profiled layers: ``[dp,pp,tp]``)."""
    world = dp * pp * tp
    host_index = host_of_rank(world)
    orders = candidate_orders(dp, pp, tp)
    if len(set(host_index)) < 2:
        return DEFAULT_ORDER, " (parallel.order=auto: one host, every link alike)", None
    if len(orders) < 2:
        return DEFAULT_ORDER, " (parallel.order=auto: one dimension above 1, one placement)", None
    if profiles is None:
        return DEFAULT_ORDER, (" (parallel.order=auto kept the default: no profiled layers to weigh boundaries "
                               "against gradients; pipeline.profile=true lets it choose)"), None
    started = time.perf_counter()
    links = measure_host_links(device, host_index)
    measured_s = time.perf_counter() - started
    stage_params = [sum(profiles[i].params for i in r) for r in ranges]

    def grad_bytes(pp_rank: int) -> float:
        held = [s for s, owner in enumerate(schedule.stage_to_rank) if owner == pp_rank]
        return float(element_bytes * sum(stage_params[s] for s in held)) / tp

    def reprice(figures: HostLinks) -> list[OrderCost]:
        return [predict_order(o, dp, pp, tp, schedule, ranges, profiles, figures, host_index, grad_bytes) for o in orders]

    costs = reprice(links)
    box = [costs]
    dist.broadcast_object_list(box, src=0)  # rank 0's figures decide: every rank builds the same mesh
    costs = box[0]
    chosen = pick_order(costs)
    said = "; ".join(f"{order_text(c.order)} {1e3 * c.step_s:.1f} ms (pipeline {1e3 * c.pipeline_s:.1f}, dp all-reduce "
                     f"{1e3 * c.dp_s:.1f}" + (f", tp {1e3 * c.tp_s:.1f}" if tp > 1 else "") + ")" for c in costs)
    return chosen.order, (f" (parallel.order=auto chose {order_text(chosen.order)}: predicted step {said}; links "
                          f"{links.describe()}, measured in {measured_s:.2f} s)"), \
        OrderChoice(chosen.order, tuple(costs), links, measured_s, reprice)

