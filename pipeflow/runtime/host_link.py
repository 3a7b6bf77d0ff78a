"""The copy path between a device and host memory, measured at start (``pipeline.offload`` plans
its copies over it: :class:`~pipeflow.schedules.offload.HostLink`)."""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeflow.schedules.offload import HostLink


@dataclass(frozen=True)
class HostLinkMeasure:
    """Measured copy bandwidths between this device and host memory (bytes per second);
    `overlapped`: copies run beside compute (CUDA) rather than on the compute thread (CPU)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    overlapped: bool

    def link(self, latency_s: float = 0.0) -> HostLink:
        """The :class:`HostLink` the planner times copies with."""
        return HostLink(self.d2h_bytes_per_s, self.h2d_bytes_per_s, latency_s, self.overlapped)


def measure_link(device: torch.device | str, nbytes: int | None = None, repeats: int = 5) -> HostLinkMeasure:
    """Time copies of `nbytes` between `device` and host memory, median of `repeats`.

    Args:
        device: a CUDA device (pinned host memory, copies on a side stream timed with CUDA events)
            or the CPU (memcpys timed with ``perf_counter``: into a reused buffer, as an offload
            copies into its pool, and into fresh memory, as a reload allocates; page faults
            make the second several times slower).
        nbytes: bytes per copy; None: 64 MiB on CUDA, 32 MiB on the CPU (beyond the caches).
        repeats: timed copies per direction (after one untimed).
    """
    device = torch.device(device)
    if device.type != "cuda":  # as the CPU's copies run: out into a pooled buffer, back into a fresh one
        src = torch.ones(nbytes or 32 * 2**20, dtype=torch.uint8)
        pooled = torch.empty_like(src)
        out = src.numel() / _median_s(lambda: pooled.copy_(src), repeats)
        back = src.numel() / _median_s(lambda: torch.empty_like(src).copy_(src), repeats)
        return HostLinkMeasure(out, back, overlapped=False)
    nbytes = nbytes or 64 * 2**20
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    d2h = _cuda_median_s(lambda: host.copy_(dev, non_blocking=True), stream, repeats)
    h2d = _cuda_median_s(lambda: dev.copy_(host, non_blocking=True), stream, repeats)
    return HostLinkMeasure(nbytes / d2h, nbytes / h2d, overlapped=True)


@functools.lru_cache(maxsize=None)
def measured_once(device: str) -> HostLinkMeasure:
    """:func:`measure_link` of `device` with its defaults, once per process: the copy path does not
    change while a process lives, and a second run built in it (a sweep's trial, a re-plan) then
    plans its copies with the same link as the first rather than another noisy measure."""
    return measure_link(device)


def _median_s(copy: Any, repeats: int) -> float:
    copy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def _cuda_median_s(copy: Any, stream: torch.cuda.Stream, repeats: int) -> float:
    with torch.cuda.stream(stream):
        copy()
        marks = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            copy()
            end.record(stream)
            marks.append((start, end))
    stream.synchronize()
    return max(statistics.median(s.elapsed_time(e) for s, e in marks) / 1e3, 1e-9)
