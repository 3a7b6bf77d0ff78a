"""Each tensor-parallel group's all-reduce measured at start, so the step prediction costs every
stage's tp collectives on the link its group uses (and the start-of-run report names a slow group).

The profiles split over tp ranks (:mod:`pipeflow.planning.costs.tensor`) assume an NVLink-class
link.  At start every tp group all-reduces at once, as the layers' collectives run in training,
at a small size, at the model's largest collective payload (a representative size, capped at
:data:`MAX_PROBE_BYTES`) and a quarter of it; a ring's ``latency + 2 (tp - 1) / tp x bytes /
bandwidth`` is fitted through them.  A group's figure is its slowest rank's; a pipeline rank's, the slowest of its
groups' (every replica waits for the slowest at the step's end).
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.planning.costs.comm import fit_line
from pipeflow.planning.links import SLOW_FACTOR, group_where
from pipeflow.planning.profile import LayerProfile
from pipeflow.planning.costs.tensor import TensorLink, relink_profile
from pipeflow.runtime.world import hosts

SMALL_PROBE_BYTES = 1 << 12
MAX_PROBE_BYTES = 1 << 23  # larger collectives are extrapolated on the fitted line
_REPEATS = 7


@dataclass(frozen=True)
class TpLinks:
    """The tp groups' all-reduce links as measured at start.

    Attributes:
        tp: the tensor-parallel degree.
        sequence_parallel: whether the layers run sequence-parallel (their W sums the norms).
        groups: every tp group's global ranks and its link (its slowest rank's figures).
        per_rank: pipeline rank r -> the slowest link of its tp groups.
        payload_bytes: the representative size timed (the largest collective's, capped).
        measured_s: what measuring them took.
        several_hosts: whether the job spans several hosts (the report lists every group then).
    """

    tp: int
    sequence_parallel: bool
    groups: tuple[tuple[tuple[int, ...], TensorLink], ...]
    per_rank: tuple[TensorLink, ...]
    payload_bytes: float = 0.0
    measured_s: float = 0.0
    several_hosts: bool = False

    def profiles(self, profiles: Sequence[LayerProfile], ranges: Sequence[range], stage_to_rank: Sequence[int],
                 assumed: TensorLink = TensorLink()) -> list[LayerProfile]:
        """The layers' profiles with each stage's collectives costed on its pipeline rank's
        measured link instead of `assumed` (the link the profiles were split over)."""
        out = list(profiles)
        for s, layers in enumerate(ranges):
            link = self.per_rank[stage_to_rank[s]]
            for i in layers:
                out[i] = relink_profile(profiles[i], self.tp, assumed, link, self.sequence_parallel)
        return out

    def phrase(self) -> str:
        """``tp all-reduce 0.050 ms + 900.0 MB/s`` (the slowest pipeline rank's link)."""
        worst = max(self.per_rank, key=lambda link: link.all_reduce_s(max(self.payload_bytes, 1.0), self.tp, 1))
        return f"tp all-reduce {link_text(worst)}"

    def describe(self, factor: float = SLOW_FACTOR) -> str:
        """The start-of-run lines: every tp group's link (its hosts named on several), and a group
        whose all-reduce of the representative size costs `factor` times the groups' median named."""
        size = max(self.payload_bytes, 1.0)
        lines = [f"tp all-reduce per group, measured in {self.measured_s:.2f} s: "
                 + "; ".join(f"ranks {list(ranks)}{group_where(ranks)}: {link_text(link)}" for ranks, link in self.groups)]
        seconds = [link.all_reduce_s(size, self.tp, 1) for _, link in self.groups]
        median = statistics.median(seconds) if seconds else 0.0
        if len(seconds) >= 3 and median > 0:
            lines += [f"slow tp group: ranks {list(ranks)}{group_where(ranks)} all-reduce of {size / 1e6:.2f} MB "
                      f"{1e3 * s:.2f} ms, {s / median:.1f}x the median of the tp groups (a slow link, or a rank "
                      f"placed on another host than intended: parallel.order, the launcher's hosts)"
                      for (ranks, _), s in zip(self.groups, seconds) if s >= factor * median]
        return "\n".join(lines)


def link_text(link: TensorLink) -> str:
    """``0.050 ms + 900.0 MB/s``: a link's latency and bandwidth."""
    rate = "no per-byte cost" if math.isinf(link.bandwidth_Bps) else f"{link.bandwidth_Bps / 1e6:.1f} MB/s"
    return f"{1e3 * link.latency_s:.3f} ms + {rate}"


def link_of(latency_s: float, per_byte_s: float) -> TensorLink:
    """A :class:`TensorLink` from a fitted ``latency + per_byte x ring bytes`` line."""
    return TensorLink(1.0 / per_byte_s if per_byte_s > 0 else math.inf, latency_s)


def fold_groups(figures: Sequence[Sequence[float]], groups: Sequence[Sequence[int]], pp_of_group: Sequence[int],
                pp: int, tp: int, payload_bytes: float) -> tuple[tuple[tuple[tuple[int, ...], TensorLink], ...],
                                                                  tuple[TensorLink, ...]]:
    """Each group's link from its ranks' fitted ``(latency, per_byte)`` (`figures` by global rank;
    the slowest rank's of each), and each pipeline rank's slowest group (`pp_of_group`: the
    pipeline rank of each group)."""
    size = max(payload_bytes, 1.0)
    links = []
    for ranks in groups:
        latency = max(figures[r][0] for r in ranks)
        per_byte = max(figures[r][1] for r in ranks)
        links.append((tuple(ranks), link_of(latency, per_byte)))
    per_rank = []
    for r in range(pp):
        mine = [link for (_, link), owner in zip(links, pp_of_group) if owner == r]
        per_rank.append(max(mine, key=lambda link: link.all_reduce_s(size, tp, 1)) if mine else TensorLink())
    return tuple(links), tuple(per_rank)


def measure_tp_links(device: torch.device, tp_group: Any, grid: Any, payload_bytes: float,
                     sequence_parallel: bool = False, repeats: int = _REPEATS) -> TpLinks:
    """Time every tp group's all-reduce (all groups at once; see the module docstring).
    Collective over the world; every rank returns the same links.

    Args:
        device: this rank's device (NCCL's collectives run on it).
        tp_group: this rank's tp process group.
        grid: the mesh's :class:`~pipeflow.runtime.parallel.mesh_order.MeshGrid` (its tp groups).
        payload_bytes: the layers' largest collective payload (the representative size).
        sequence_parallel: whether the layers run sequence-parallel.
        repeats: timed all-reduces per size.
    """
    started = time.perf_counter()
    tp = grid.tp
    big = int(min(MAX_PROBE_BYTES, max(16 * SMALL_PROBE_BYTES, payload_bytes)))
    points = []
    for size in sorted({SMALL_PROBE_BYTES, big // 4, big}):
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
        points.append((2 * (tp - 1) / tp * size, _median_all_reduce_s(buffer, tp_group, device, repeats)))
        del buffer
    mine = torch.tensor(fit_line(points), dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    figures = [g.cpu().tolist() for g in gathered]
    groups = grid.tp_groups()
    pp_of_group = [grid.coordinates(ranks[0])[1] for ranks in groups]
    links, per_rank = fold_groups(figures, groups, pp_of_group, grid.pp, tp, big)
    return TpLinks(tp, sequence_parallel, links, per_rank, float(big), time.perf_counter() - started,
                   len(hosts.table().hosts) > 1)


def _median_all_reduce_s(buffer: torch.Tensor, group: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of one all-reduce of `buffer` over `group` (after one untimed)."""
    dist.all_reduce(buffer, group=group)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
