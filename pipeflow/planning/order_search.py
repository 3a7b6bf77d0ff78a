"""The planner's mesh order (``parallel.order``): each layout's step under every order that places
the ranks differently, on the hosts the run will use.

The hosts are :class:`HostPlacement`: consecutive global ranks fill hosts of ``ranks_per_host``,
with one link within a host and one across hosts (a cluster description's ``intra``/``inter``
links, or the links ``parallel.order=auto`` measures).  Under an order every pipeline transfer is
costed on the link its two ranks use (across hosts where any replica's pair crosses them), the
data-parallel all-reduce of each pipeline rank's gradients and the stages' tp collectives on the
link their groups cross (:mod:`pipeflow.planning.mesh_choice`).  On one host every order is
alike and nothing is searched; another order is picked only when predicted
:data:`~pipeflow.planning.mesh_choice.MARGIN` faster than ``[dp,pp,tp]`` (ties keep it).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeflow.planning.mesh_choice import (HostLinks, candidate_orders, crosses_hosts, dp_allreduce_s, pick_order,
                                           tp_allreduce_s)
from pipeflow.planning.step_model import op_bytes
from pipeflow.runtime.parallel.mesh_order import MeshGrid
from pipeflow.schedules import PipelineSchedule
from pipeflow.schedules.ir import CommOp
from pipeflow.schedules.simulator import SimResult


@dataclass(frozen=True)
class HostPlacement:
    """The hosts a planned run's ranks fill: `ranks_per_host` consecutive global ranks each, and
    the transfer figures within a host and across hosts (`links`)."""

    ranks_per_host: int
    links: HostLinks

    def host_index(self, world: int) -> list[int]:
        """Each global rank's host."""
        return [r // max(1, self.ranks_per_host) for r in range(world)]

    def spans(self, world: int) -> bool:
        """Whether `world` ranks fill more than one host."""
        return world > self.ranks_per_host

    @staticmethod
    def of_cluster(cluster: Any) -> HostPlacement:
        """The placement of a cluster description (:class:`~pipeflow.planning.hardware.Cluster`):
        its GPUs per host, its ``intra`` and ``inter`` links (GB/s each way, microseconds)."""
        def figures(link: Any) -> tuple[float, float]:
            return link.latency_us * 1e-6, 1.0 / (link.bandwidth_gbps * 1e9)

        return HostPlacement(int(cluster.gpus_per_host), HostLinks(figures(cluster.intra), figures(cluster.inter)))


@dataclass(frozen=True)
class OrderStep:
    """One order's predicted step (seconds): the pipeline's simulation and what follows it."""

    order: tuple[str, ...]
    sim: SimResult
    dp_s: float
    tp_s: float

    @property
    def step_s(self) -> float:
        """The pipeline plus the dp all-reduce and the tp collectives beyond a host's link."""
        return self.sim.makespan + self.dp_s + self.tp_s


def order_steps(schedule: PipelineSchedule, ranges: Sequence[range], profiles: Sequence[Any], dp: int, tp: int,
                hosts: HostPlacement, grad_bytes: Sequence[float],
                simulate_with: Callable[[Callable[[CommOp], float]], SimResult]) -> list[OrderStep]:
    """Every order that places the ranks differently (``[dp,pp,tp]`` first), each predicted.

    Args:
        schedule, ranges, profiles: the layout (the profiles one tp rank's, their collectives
            costed over a host's link already).
        dp, tp: the degrees.
        hosts: where the ranks sit.
        grad_bytes: each stage's gradient bytes (one tp rank's), all-reduced over its dp group.
        simulate_with: the layout's simulation with each transfer costed by the function given.
    """
    world = dp * schedule.num_ranks * tp
    host_index = hosts.host_index(world)
    links = hosts.links
    boundary = [float(profiles[r.stop - 1].output_bytes) for r in ranges]
    bytes_of = op_bytes(boundary)
    rank_grads = [math.fsum(g for s, g in enumerate(grad_bytes) if schedule.stage_to_rank[s] == r)
                  for r in range(schedule.num_ranks)]
    tp_bytes = [math.fsum(profiles[i].tp_forward_bytes + profiles[i].tp_backward_bytes for i in r) for r in ranges]
    out = []
    for order in candidate_orders(dp, schedule.num_ranks, tp):
        grid = MeshGrid(dp, schedule.num_ranks, tp, order)
        pipes = grid.pipelines()

        def transfer(op: CommOp, pipes: list[list[int]] = pipes) -> float:
            a, b = schedule.stage_to_rank[op.src_stage], schedule.stage_to_rank[op.dst_stage]
            return links.seconds(crosses_hosts(pipes, host_index, a, b), bytes_of(op))

        dp_s = dp_allreduce_s(grid, links, host_index, rank_grads.__getitem__)
        # tp: beyond what the profiles charge, the same bytes on a host's own link
        tp_s = tp_allreduce_s(grid, links, host_index, tp_bytes, schedule.num_microbatches, beyond_host=True)
        out.append(OrderStep(order, simulate_with(transfer), dp_s, tp_s))
    return out


def pick(steps: Sequence[OrderStep]) -> OrderStep:
    """The fastest order where it beats ``[dp,pp,tp]`` (the first) by the margin, else that
    (:func:`~pipeflow.planning.mesh_choice.pick_order`)."""
    return pick_order(steps)


def order_note(dp: int, pp: int, degrees: Sequence[int], hosts: HostPlacement | None) -> str:
    """The header's phrase on the mesh order (``parallel.order``) where more than one places the
    ranks differently: searched on the hosts given, else (the machine the planner runs on: one
    host, every order alike) ``[dp,pp,tp]`` kept."""
    if all(len(candidate_orders(dp, pp, tp)) < 2 for tp in degrees):
        return ""
    if hosts is not None and any(hosts.spans(dp * pp * tp) for tp in degrees):
        return f"; mesh orders searched on hosts of {hosts.ranks_per_host} ranks ({hosts.links.describe()})"
    return ("; mesh order [dp,pp,tp]: one host (this machine), every order alike (plan.hardware=<preset or file> "
            "searches the orders on a cluster's hosts)")
