"""The ep groups' ``all_to_all`` measured at start, so the step prediction costs every MoE layer's
token exchanges (:mod:`pipeflow.planning.costs.expert`) on the link its ep group uses.

Every ep group exchanges at once, as the layers do in training, at a small size and at the
layers' largest exchange (capped at :data:`MAX_PROBE_BYTES`; larger ones are extrapolated on the
line); ``latency + (ep - 1) / ep x bytes x per_byte`` is fitted through them on every rank and the
slowest rank's figures stand for every group (every replica waits for the slowest at the step's
end).  A few dozen small collectives: well under 0.3 s on CPUs.
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

from pipeflow.planning.costs.comm import fit_line
from pipeflow.planning.costs.expert import (BACKWARD_EXCHANGES, FORWARD_LATENCIES, WEIGHT_GRAD_EXCHANGES,
                                           ExpertLayers, ExpertLink, exchange_payload, exchange_seconds,
                                           exchanged_bytes_per_step, relink_exchanges)
from pipeflow.planning.profile import LayerProfile
from pipeflow.schedules import PipelineSchedule
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action

SMALL_PROBE_BYTES = 1 << 12
MAX_PROBE_BYTES = 1 << 21
_REPEATS = 5


@dataclass(frozen=True)
class ExpertExchange:
    """What a run's MoE layers exchange: ``parallel.ep``, each layer's top_k (0: dense), the link
    the layout's profiles were costed on, and the largest exchange (bytes of a rank's rows)."""

    ep: int
    top_k: tuple[int, ...]
    assumed: ExpertLink = ExpertLink()
    payload_bytes: float = 0.0


def expert_exchange(layers: ExpertLayers, ep: int, profiles: Sequence[LayerProfile] | None) -> ExpertExchange | None:
    """The run's :class:`ExpertExchange` (None without expert parallelism or an MoE layer)."""
    if ep <= 1 or not any(layers.top_k):
        return None
    return ExpertExchange(ep, layers.top_k, ExpertLink(), exchange_payload(profiles or (), layers.top_k))


@dataclass(frozen=True)
class EpLinks:
    """The ep groups' all_to_all as measured at start (the slowest rank's figures).

    Attributes:
        exchange: what the layers exchange and the link their profiles assumed.
        link: the measured link.
        measured_s: what measuring it took.
    """

    exchange: ExpertExchange
    link: ExpertLink
    measured_s: float = 0.0

    def profiles(self, profiles: Sequence[LayerProfile]) -> list[LayerProfile]:
        """The layers' profiles with their exchanges on the measured link instead of the assumed one."""
        ex = self.exchange
        return relink_exchanges(profiles, ex.top_k, ex.ep, ex.assumed, self.link)

    def exchanges(self, profiles: Sequence[LayerProfile], ranges: Sequence[range]) -> Callable[[Action], tuple[float, int]]:
        """Each action's exchanges on the measured link, as (seconds, how many): the simulator
        hides them in an overlapped pair behind the other action's compute (``RuntimeCosts.exchanges``).
        A full backward exchanges what its input-grad half does; a split backward's W once more."""
        ex = self.exchange
        per_stage = []
        for layers in ranges:
            seconds = [0.0, 0.0, 0.0]
            moe = sum(1 for i in layers if ex.top_k[i] > 0)
            for i in layers:
                for j, t in enumerate(exchange_seconds(profiles[i], ex.top_k[i], ex.ep, self.link)):
                    seconds[j] += t
            counts = (FORWARD_LATENCIES * moe, BACKWARD_EXCHANGES * moe, WEIGHT_GRAD_EXCHANGES * moe)
            per_stage.append({kind: (t, n) for kind, t, n in zip((FORWARD, BACKWARD, WEIGHT), seconds, counts)})

        def of(action: Action) -> tuple[float, int]:
            return per_stage[action.stage][action.kind] if action.stage < len(per_stage) else (0.0, 0)

        return of

    def phrase(self) -> str:
        """``ep all_to_all 0.120 ms + 900.0 MB/s (measured in 0.04 s)``."""
        rate = ("no per-byte cost" if math.isinf(self.link.bandwidth_Bps)
                else f"{self.link.bandwidth_Bps / 1e6:.1f} MB/s")
        return f"ep all_to_all {1e3 * self.link.latency_s:.3f} ms + {rate} (measured in {self.measured_s:.2f} s)"


    def per_rank_s(self, profiles: Sequence[LayerProfile], ranges: Sequence[range], schedule: PipelineSchedule
                   ) -> list[float]:
        """Seconds each pipeline rank's exchanges take in a step on the measured link (F and B of
        every micro-batch, and W's where the schedule splits backwards)."""
        ex, split = self.exchange, bool(schedule.split_backwards())
        out = [0.0] * schedule.num_ranks
        for s, layers in enumerate(ranges):
            for i in layers:
                f, b, w = exchange_seconds(profiles[i], ex.top_k[i], ex.ep, self.link)
                out[schedule.stage_to_rank[s]] += schedule.num_microbatches * (f + b + (w if split else 0.0))
        return out

    def describe(self, profiles: Sequence[LayerProfile], ranges: Sequence[range], schedule: PipelineSchedule) -> str:
        """The start-of-run line: each pipeline rank's exchanges per step as predicted, and the
        bytes they send off a rank, to read beside the run's measured ``expert all_to_all`` line."""
        ex = self.exchange
        sent = [0.0] * schedule.num_ranks
        for s, got in enumerate(exchanged_bytes_per_step(profiles, ex.top_k, ranges, ex.ep, schedule.num_microbatches)):
            sent[schedule.stage_to_rank[s]] += got
        said = "; ".join(f"{r} {1e3 * t:.2f} ms ({b / 1e6:.2f} MB sent)"
                         for r, (t, b) in enumerate(zip(self.per_rank_s(profiles, ranges, schedule), sent)))
        return f"expert all_to_all predicted per step per pipeline rank (ep={ex.ep}, {self.phrase()}): {said}"


def link_of(latency_s: float, per_byte_s: float) -> ExpertLink:
    """An :class:`ExpertLink` from a fitted ``latency + per_byte x bytes leaving a rank`` line."""
    return ExpertLink(1.0 / per_byte_s if per_byte_s > 0 else math.inf, latency_s)


def measure_ep_links(device: torch.device, ep_group: Any, exchange: ExpertExchange,
                     repeats: int = _REPEATS) -> EpLinks:
    """Time every ep group's all_to_all at once (see the module docstring).  Collective over the
    world (every rank is in one ep group); every rank returns the same link."""
    started = time.perf_counter()
    ep = exchange.ep
    big = int(min(MAX_PROBE_BYTES, max(16 * SMALL_PROBE_BYTES, exchange.payload_bytes)))
    points = []
    for size in (SMALL_PROBE_BYTES, big):
        rows = max(ep, size // 4 // ep * ep)  # float32 elements, a whole share per rank
        buffer = torch.zeros(rows, dtype=torch.float32, device=device)
        points.append(((ep - 1) / ep * 4 * rows, _median_all_to_all_s(buffer, ep_group, device, repeats)))
        del buffer
    figures = torch.tensor(fit_line(points), dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    latency, per_byte = figures.tolist()
    return EpLinks(exchange, link_of(latency, per_byte), time.perf_counter() - started)


def _median_all_to_all_s(buffer: torch.Tensor, group: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of one all_to_all of `buffer` over `group` (after one untimed)."""
    out = torch.empty_like(buffer)
    dist.all_to_all_single(out, buffer, group=group)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_to_all_single(out, buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
