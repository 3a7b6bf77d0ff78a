"""Each pipeline link on its own: what a transfer between two pipeline ranks costs, measured at
start pair by pair, so a boundary that crosses hosts is costed on the slow link it uses.

The ring measurement of :mod:`pipeflow.planning.costs.comm` gives one figure for every
boundary (the slowest rank's).  Across hosts the boundaries differ by orders of magnitude: a
pair of ranks on one host talks through memory, a pair on two hosts through the network.  Here
every pair of pipeline ranks the program exchanges between (``stage_to_rank`` of each stage and
the next: the wrap-around of interleaved schedules too) is timed alone: its latency by small
exchanges both ways in one batched call, its rate and burst by large messages one direction at a
time (a stream's rate; the simulator queues each direction on its own).  Pairs that share no
rank are timed at the same time (rounds of a matching), every pipeline (data-parallel and
tensor-parallel replica) at once: as in training, replicas share the links between hosts.  The
slowest replica of each pair sets its figure's latency; its rate and burst are the replicas'
mean shares.

A link is three figures, so that it holds for every size the program sends and however far apart
it sends them (:func:`probe_pair`): the latency of a small message, the sustained rate of a large
message sent back to back, and the burst (how many bytes pass at line rate after a pause, from the
first large message).  A token bucket (``tbf``,
a switch's buffers) passes a burst at line rate: a link costed by one probe size would be fast
for spaced small boundaries and slow for long ones, or the other way round.  The simulator
queues each pair's transfers on its link (:class:`~pipeflow.schedules.Bucket`).
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.planning.costs.comm import exchange_s, stream_s
from pipeflow.runtime.world import hosts
from pipeflow.schedules import Bucket, PipelineSchedule
from pipeflow.schedules.ir import CommOp

SLOW_FACTOR = 3.0  # a link this many times slower than the median of its peers is named
PROBE_BYTES = 1 << 19  # a message past a token bucket's burst, timed beside the model's own sizes
PAUSE_S = 0.05  # idle time before a timing that starts with a full bucket
LATENCY_BYTES = 1 << 12  # the small exchange that times a link's latency
_SMALL_REPEATS = 3  # small exchanges (few: they must stay within a burst)
_FIRSTS = 3  # large messages timed each after a pause (the median kept)
_SUSTAINED_REPEATS = 3  # large messages timed back to back, after one that empties the bucket
_NO_BURST = 0.05  # a burst below this share of the probe is noise: the link has none
FAST_S = 2e-3  # a probe message sent this fast: no burst worth pausing to time (a link past 250 MB/s)


@dataclass(frozen=True)
class Link:
    """One pair of pipeline ranks as measured (the slowest replica's latency, the replicas' mean rate
    and burst).

    Attributes:
        ranks: the two pipeline ranks (lower first).
        latency_s, per_byte_s: a transfer's ``latency_s + bytes * per_byte_s`` at the sustained
            rate (the link busy).
        global_ranks: the slowest replica's global ranks of the two ends.
        hosts: the host names of those ranks (empty names on one host).
        burst_bytes: what passes at line rate after a pause (0: no burst), at no per-byte cost
            (:func:`probe_pair`).
    """

    ranks: tuple[int, int]
    latency_s: float
    per_byte_s: float
    global_ranks: tuple[int, int] = (0, 0)
    hosts: tuple[str, str] = ("", "")
    burst_bytes: float = 0.0

    def seconds(self, num_bytes: float) -> float:
        """One transfer of `num_bytes` on this link at its sustained rate (the link busy)."""
        return self.latency_s + self.per_byte_s * num_bytes

    @property
    def line_per_byte_s(self) -> float:
        """Seconds per byte within a burst: none where the link has one, else the sustained rate."""
        return 0.0 if self.burst_bytes > 0 else self.per_byte_s

    def burst_seconds(self, num_bytes: float) -> float:
        """One transfer of `num_bytes` within a burst (a full bucket)."""
        return self.latency_s + self.line_per_byte_s * num_bytes

    def bucket(self, num_bytes: float) -> Bucket:
        """A transfer of `num_bytes` through this link, for the simulator to queue."""
        return Bucket(num_bytes, self.per_byte_s, self.line_per_byte_s, self.burst_bytes)

    @property
    def crosses_hosts(self) -> bool:
        """True where the two ends run on different hosts."""
        return self.hosts[0] != self.hosts[1]

    def describe(self) -> str:
        """``pipeline ranks 1-2 crosses hosts host0 -> host1: 0.412 ms + 11.9 MB/s`` (hosts named
        only on several hosts; the global ranks where they are other numbers)."""
        a, b = self.ranks
        where = ""
        if self.hosts[0]:
            where = (f" crosses hosts {self.hosts[0]} -> {self.hosts[1]}" if self.crosses_hosts
                     else f" within host {self.hosts[0]}")
        rate = f"{1e-6 / self.per_byte_s:.1f} MB/s" if self.per_byte_s > 0 else "no per-byte cost measured"
        burst = f", bursts of {self.burst_bytes / 1e3:.0f} KB" if self.burst_bytes > 0 else ""
        g = self.global_ranks
        known = g[0] != g[1]  # (0, 0): not recorded
        named = f" (global ranks {g[0]} and {g[1]})" if known and tuple(g) != (a, b) else ""  # not read as global
        return f"pipeline ranks {a}-{b}{named}{where}: {1e3 * self.latency_s:.3f} ms + {rate}{burst}"


@dataclass(frozen=True)
class PipelineLinks:
    """Every link the program uses, by its pair of pipeline ranks."""

    links: tuple[Link, ...]
    stage_to_rank: tuple[int, ...]
    measured_s: float = 0.0  # what measuring them took

    def of(self, op: CommOp) -> Link | None:
        """The link an op travels (None for a pair not measured)."""
        pair = tuple(sorted((self.stage_to_rank[op.src_stage], self.stage_to_rank[op.dst_stage])))
        return next((link for link in self.links if link.ranks == pair), None)

    @property
    def across_hosts(self) -> bool:
        """True where some link crosses hosts."""
        return any(link.crosses_hosts for link in self.links)

    def slow(self, num_bytes: float, factor: float = SLOW_FACTOR) -> list[tuple[Link, float]]:
        """The links whose transfer of `num_bytes` costs at least `factor` times the median of
        the links, each with that ratio (none where fewer than three links)."""
        if len(self.links) < 3:
            return []
        median = statistics.median(link.seconds(num_bytes) for link in self.links)
        if median <= 0:
            return []
        return [(link, link.seconds(num_bytes) / median) for link in self.links
                if link.seconds(num_bytes) >= factor * median]

    def describe(self, num_bytes: float) -> str:
        """The start-of-run lines: every link, and those far slower than their peers named."""
        lines = [f"links measured in {self.measured_s:.2f} s (a stream each way, every replica): "
                 + "; ".join(link.describe() for link in self.links)]
        for link, ratio in self.slow(num_bytes):
            lines.append(f"slow link: {link.describe()} costs {ratio:.1f}x the median of the pipeline's links for "
                         f"{num_bytes / 1e6:.2f} MB (global ranks {link.global_ranks[0]} and {link.global_ranks[1]}): "
                         f"a slow cable or network, or a rank placed on another host than intended "
                         f"(parallel.order, the launcher's hosts)")
        return "\n".join(lines)


def describe_dp_groups(groups: Sequence[tuple[Sequence[int], float]], factor: float = SLOW_FACTOR) -> str:
    """The start-of-run line of each dp group's gradient all-reduce (its hosts where it crosses
    them), and those at least `factor` times the median of the groups named."""
    if not groups:
        return ""
    where = group_where
    lines = ["dp all-reduce per group: " + "; ".join(f"ranks {list(ranks)}{where(ranks)}: {1e3 * s:.2f} ms"
                                                     for ranks, s in groups)]
    median = statistics.median(s for _, s in groups)
    if len(groups) >= 3 and median > 0:
        lines += [f"slow dp group: ranks {list(ranks)}{where(ranks)} all-reduce {1e3 * s:.2f} ms, {s / median:.1f}x the "
                  f"median of the dp groups (a slow link, or a rank placed on another host than intended)"
                  for ranks, s in groups if s >= factor * median]
    return "\n".join(lines)


def group_where(ranks: Sequence[int]) -> str:
    """`` across hosts a b`` or `` within host a`` for a group of global `ranks` (empty on one host)."""
    names = list(dict.fromkeys(host_name(r) for r in ranks))
    return f" across hosts {' '.join(names)}" if len(names) > 1 else (f" within host {names[0]}" if names[0] else "")


def link_pairs(schedule: PipelineSchedule) -> list[tuple[int, int]]:
    """The pairs of pipeline ranks the program exchanges between (lower rank first), in order."""
    pairs = {tuple(sorted((schedule.stage_to_rank[s], schedule.stage_to_rank[s + 1])))
             for s in range(schedule.num_stages - 1)}
    return sorted(pair for pair in pairs if pair[0] != pair[1])  # type: ignore[misc]


def matching_rounds(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`pairs` in rounds of pairs that share no rank (greedy, in order), so each rank times one
    pair at a time."""
    rounds: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for group in rounds:
            if all(not set(pair) & set(other) for other in group):
                group.append(pair)
                break
        else:
            rounds.append([pair])
    return rounds


def probe_pair(comm: Any, peer: int | None, agree: Callable[[float], float],
               what: str = "time a link for the step model") -> tuple[float, float, float]:
    """(latency s, sustained s per byte, burst bytes) of the link to pipeline rank `peer`, who runs
    the same probe (small exchanges both directions at once; the large messages of the rate and
    burst one direction at a time, :func:`~pipeflow.planning.costs.comm.stream_s`: each direction
    of a full-duplex link has its own rate, and the simulator queues each on its own); with
    `peer` None only the `agree` calls.  `agree(x)` is the largest `x` of the world's ranks,
    every rank calling it at the same points: the pairs timed at once, and the replicas sharing a
    link, run each phase together.

    Where every pair sends one :data:`PROBE_BYTES` message in under :data:`FAST_S`, a burst would
    save less than that: such messages back to back give the rate, a small exchange the latency,
    and the link has no burst.  Otherwise, after a pause (the bucket full) the small exchange
    gives the latency, large messages each timed after a pause show what a full bucket does to
    them, and a few back to back (after one that empties the bucket) the sustained rate.  The
    burst is what the first messages gained over the sustained ones, taken to pass at line rate
    (its per-byte cost 0: a burst moves at memory or NIC speed, far above a rate worth limiting);
    a link whose first messages are no faster has no burst, and one rate.
    """
    def timed(time_it: Callable[[], float], pause: bool = True) -> float:
        agree(0.0)
        if pause:
            time.sleep(PAUSE_S)
        return time_it() if peer is not None else 0.0

    def back_to_back() -> float:
        return stream_s(comm, peer, PROBE_BYTES, _SUSTAINED_REPEATS, 1, what)

    small = lambda: exchange_s(comm, peer, LATENCY_BYTES, _SMALL_REPEATS, 1, what)  # noqa: E731
    if agree(timed(lambda: exchange_s(comm, peer, PROBE_BYTES, 1, 0, what), pause=False)) < FAST_S:
        sustained = timed(back_to_back, pause=False)
        # the least of a few: a delivery that waited for a core only adds, and at this speed the
        # per-byte term is the difference of two short times
        latency = timed(lambda: min(exchange_s(comm, peer, LATENCY_BYTES, 1, 0, what) for _ in range(5)), pause=False)
        return min(latency, sustained), _per_byte(sustained, latency), 0.0
    latency = timed(small)
    first = statistics.median(timed(lambda: stream_s(comm, peer, PROBE_BYTES, 1, 0, what)) for _ in range(_FIRSTS))
    sustained = timed(back_to_back)
    per_byte, latency = _per_byte(sustained, latency), min(latency, sustained)
    gained = (sustained - first) / per_byte if per_byte > 0 else 0.0
    burst = min(float(PROBE_BYTES), gained) if gained >= _NO_BURST * PROBE_BYTES else 0.0
    return latency, per_byte, burst


def _per_byte(sustained: float, latency: float) -> float:
    """Seconds per byte of :data:`PROBE_BYTES` sent in `sustained` beyond the `latency`; where a
    noisy latency came out above it, the whole time (a bound: the link is at least that fast)."""
    return (sustained - latency if sustained > latency else sustained) / PROBE_BYTES


def world_max(device: Any) -> Callable[[float], float]:
    """`agree` for :func:`probe_pair`: the largest value of the world's ranks (a barrier too)."""
    def agree(value: float) -> float:
        figure = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(figure, op=dist.ReduceOp.MAX)
        return float(figure.item())

    return agree


def measure_links(comm: Any, schedule: PipelineSchedule, sizes: Sequence[int], replicas: Sequence[Sequence[int]]
                  ) -> PipelineLinks:
    """Time every pair of pipeline ranks the program uses, alone, at `sizes` bytes and past a
    burst (see the module docstring).  Collective over the world; every rank returns the same
    links.

    Args:
        comm: this rank's pipeline communicator (``post``/``wait``, ``rank``, ``size``, ``device``).
        schedule: the program's schedule (its ``stage_to_rank`` gives the pairs).
        sizes: the model's transfer sizes, bytes (the slowest replica is the slowest at the largest).
        replicas: the global ranks of every pipeline (``Mesh.replicas``), to name the slowest's ends.
    """
    started = time.perf_counter()
    pairs = link_pairs(schedule)
    index = {pair: k for k, pair in enumerate(pairs)}
    figures = torch.zeros(max(1, len(pairs)), 3, dtype=torch.float64, device=comm.device)  # NCCL: on the device
    for group in matching_rounds(pairs):
        mine = next((pair for pair in group if comm.rank in pair), None)
        peer = None if mine is None else (mine[1] if mine[0] == comm.rank else mine[0])
        got = probe_pair(comm, peer, world_max(comm.device))  # every replica's pair at once, phase by phase
        if mine is not None:
            figures[index[mine]] = torch.tensor(got, dtype=torch.float64, device=comm.device)
    world = dist.get_world_size()
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    gathered = [g.cpu() for g in gathered]
    largest = float(max(sizes, default=PROBE_BYTES))
    links = []
    for (a, b), k in index.items():
        worst = None  # (seconds at the model's largest size, latency, pipeline)
        rates, bursts = [], []
        for pipe, ranks in enumerate(replicas):
            ends = torch.stack([gathered[ranks[a]][k], gathered[ranks[b]][k]])
            latency, per_byte, _ = ends.max(dim=0).values.tolist()
            rates.append(1.0 / per_byte if per_byte > 0 else float("inf"))
            bursts.append(float(ends[:, 2].min()))  # the end that saw the smaller burst
            cost = latency + per_byte * largest
            if worst is None or cost > worst[0]:
                worst = (cost, latency, pipe)
        _, latency, pipe = worst  # type: ignore[misc]
        # replicas sharing a link do not split it evenly over a short probe (one takes more of the
        # rate and of the burst than the other): each is simulated with its mean share, and the
        # skew this leaves between replicas is the end-of-step wait a rehearsal measures
        mean_rate = statistics.fmean(rates)
        per_byte = 1.0 / mean_rate if math.isfinite(mean_rate) else 0.0
        burst = statistics.fmean(bursts)
        ends = (replicas[pipe][a], replicas[pipe][b])
        links.append(Link((a, b), latency, per_byte, ends, (host_name(ends[0]), host_name(ends[1])), burst))
    return PipelineLinks(tuple(links), tuple(schedule.stage_to_rank), time.perf_counter() - started)


def host_name(rank: int) -> str:
    """The host name of global `rank` where the job spans several hosts, else empty."""
    table = hosts.table()
    if len(table.hosts) < 2:
        return ""
    host = table.host_of(rank)
    return host[0] if host is not None else "?"
