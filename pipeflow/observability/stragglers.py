"""Stragglers named while they happen (``metrics.straggler_factor``).

Every log interval (its last timed step, so nothing extra is timed) each rank's compute and each
link's transfers are held against what was predicted for *that* rank and *that* link:

- **a slow rank**: its compute per step over its predicted compute (the profiled costs of the
  actions its program runs) against the same ratio of the other ranks (their median), so a host
  busier than profiled everywhere flags no one, and one rank at 3x its compute does;
- **a slow link**: each transfer the receiver had to wait for, from the moment both ends had
  posted it (``max(send posted, recv posted)``, clocks aligned over the world) to the end of the
  receiver's wait: its bytes over that time, against the link's own rate measured at start
  (``links measured ...``; on one host the start's transfer model). A slow neighbour's lateness
  is not counted: the clock starts when the sender posts.

A rank or link off by more than the factor in :data:`INTERVALS` consecutive intervals is named in
a warning (``straggler: rank 5 (host3) compute 1.9x its prediction (the others 1.0x)``, ``slow
link: pipeline ranks 1-2 crosses hosts host0 -> host1: 6.2 MB/s, 110 MB/s at start``) and in the
trackers (``straggler/rank<g>/compute_ratio``, ``link/<a>-<b>/measured_mbps``), once until it
recovers, or falls behind by the factor again.
"""
from __future__ import annotations

import logging
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.runtime.world.clocks import clock_offsets
from pipeflow.runtime.events import Transfer

log = logging.getLogger("pipeflow")

INTERVALS = 2  # consecutive log intervals off before a rank or link is named
CALIBRATION = (1, 3)  # the log intervals (0-based; the first holds the warm-up) each ratio is calibrated on
UNCALIBRATED_SLACK = 1.5  # before that, a rank or link must be this much further off (the profile's own error)
MIN_EXCESS_S = 5e-3  # a step's compute or a transfer must also lose this much (CPU scheduling, timer noise)
OFFSETS_EVERY = 20  # log intervals between clock-offset measurements (clocks drift)
_TRANSFER = re.compile(r"^(send|recv):(\w+?)(\d+)\[(\d+)>(\d+)\](?:->|<-)r(\d+)$")


@dataclass
class RankSample:
    """One rank's figures of a log interval: compute per step, and its last timed step's transfers
    (clocks already on rank 0's axis)."""

    rank: int
    pp_rank: int
    replica: int
    compute_s: float
    transfers: list[Transfer]


@dataclass
class StragglerWatch:
    """What the figures are held against, and the run of intervals each suspect has been off.

    Attributes:
        factor: ``metrics.straggler_factor``.
        compute_s: predicted compute per step of each pipeline rank (None: not profiled).
        link_s: (lower pipeline rank, higher, bytes) -> predicted seconds of one transfer on that link.
        link_name: (lower, higher, replica) -> how the link is named (``pipeline ranks 1-2 crosses hosts ...``).
        host_of: global rank -> its host name ("" on one host).
    """

    factor: float
    compute_s: Sequence[float] | None
    link_s: Callable[[int, int, float], float] | None
    link_name: Callable[[int, int, int], str]
    host_of: Callable[[int], str]
    runs: dict[Any, int] = field(default_factory=dict)
    early: dict[str, list[float]] = field(default_factory=dict)  # each key's ratios in the calibration intervals
    named: dict[Any, float] = field(default_factory=dict)  # key -> its ratio when last named
    worse: dict[Any, int] = field(default_factory=dict)  # key -> intervals off by the factor again since named
    intervals: int = 0
    _offset: float | None = None

    def sample(self, rank: int, pp_rank: int, replica: int, compute_s: float, transfers: list[Transfer],
               device: torch.device) -> list[RankSample] | None:
        """Gather every rank's sample of this interval to rank 0 (collective); None elsewhere."""
        if self._offset is None or self.intervals % OFFSETS_EVERY == 0:
            self._offset = clock_offsets(device)[dist.get_rank()]
        self.intervals += 1
        off = self._offset
        mine = RankSample(rank, pp_rank, replica, compute_s,
                          [Transfer(t.name, t.nbytes, t.posted - off, t.waited - off, t.done - off) for t in transfers])
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return gathered

    def judge(self, step: int, samples: Sequence[RankSample]) -> tuple[list[str], dict[str, float]]:
        """The warnings newly due at `step` and the figures for the trackers (rank 0)."""
        lines: list[str] = []
        scalars: dict[str, float] = {}
        off: set = set()
        for key, text, value, ratio in self._slow_ranks(samples) + self._slow_links(samples):
            scalars[key] = value
            if text is not None:
                off.add(key)
                self.runs[key] = self.runs.get(key, 0) + 1
                # named once, and again if it falls behind by the factor again (a link slowed by a busy
                # host, then throttled, says so twice)
                again = key in self.named and ratio >= self.named[key] * self.factor
                self.worse[key] = self.worse.get(key, 0) + 1 if again else 0
                if (self.runs[key] >= INTERVALS and key not in self.named) or self.worse[key] >= INTERVALS:
                    self.named[key], self.worse[key] = ratio, 0
                    lines.append(f"step {step}: {text}")
        for key in list(self.runs):
            if key not in off:  # recovered: named again if it falls behind again
                del self.runs[key]
                self.named.pop(key, None)
                self.worse.pop(key, None)
        return lines, scalars

    def _calibrated(self, key: str, ratio: float) -> tuple[float, str, str]:
        """`ratio` over its own median in the calibration intervals (the run's first after warm-up),
        how it reads, and what it was calibrated on; before those are in, over
        :data:`UNCALIBRATED_SLACK`."""
        first, last = CALIBRATION
        if first <= self.intervals - 1 < last and math.isfinite(ratio):
            self.early.setdefault(key, []).append(ratio)
        early = self.early.get(key)
        if self.intervals - 1 < last or not early:
            return ratio / UNCALIBRATED_SLACK, f"{ratio:.1f}x", "not calibrated yet; "
        base = statistics.median(early)
        return ratio / base, f"{ratio / base:.1f}x", f"{base:.2f}x in the run's first intervals; "

    def _slow_ranks(self, samples: Sequence[RankSample]) -> list[tuple[str, str | None, float, float]]:
        if self.compute_s is None or len(samples) < 2:
            return []
        ratios = {s.rank: s.compute_s / self.compute_s[s.pp_rank] for s in samples
                  if self.compute_s[s.pp_rank] > 0 and math.isfinite(s.compute_s)}
        out = []
        for s in samples:
            if s.rank not in ratios:
                continue
            others = statistics.median(r for g, r in ratios.items() if g != s.rank) if len(ratios) > 1 else None
            key = f"straggler/rank{s.rank}/compute_ratio"
            ratio, reads, base = self._calibrated(key, ratios[s.rank] / others if others else math.nan)
            host = self.host_of(s.rank)
            text = None
            if ratio > self.factor and s.compute_s * (1 - 1 / ratio) > MIN_EXCESS_S:  # it loses time, not noise
                text = (f"straggler: rank {s.rank}{f' ({host})' if host else ''} compute {reads} its prediction "
                        f"against the other ranks' ({base}its compute {1e3 * s.compute_s:.1f} ms a step, predicted "
                        f"{1e3 * self.compute_s[s.pp_rank]:.1f} ms)")
            out.append((key, text, ratio, ratio))
        return out

    def _slow_links(self, samples: Sequence[RankSample]) -> list[tuple[str, str | None, float, float]]:
        if self.link_s is None:
            return []
        posted: dict[tuple[int, str], float] = {}  # (replica, transfer id) -> when the sender posted it
        for s in samples:
            for t in s.transfers:
                kind, ident = _ident(t.name)
                if kind == "send":
                    posted[(s.replica, ident)] = t.posted
        times: dict[tuple[int, int, int], list[tuple[float, float, int]]] = {}  # link -> (seconds, predicted, bytes)
        for s in samples:
            for t in s.transfers:
                kind, ident = _ident(t.name)
                sent = posted.get((s.replica, ident))
                if kind != "recv" or sent is None or t.nbytes <= 0:
                    continue
                began = max(sent, t.posted)
                if t.done - t.waited <= 0.0 or t.waited > t.done or began >= t.done:
                    continue  # not waited for: it arrived earlier, its time unknown
                peer = int(_TRANSFER.match(t.name).group(6))
                a, b = min(peer, s.pp_rank), max(peer, s.pp_rank)
                times.setdefault((a, b, s.replica), []).append((t.done - began, self.link_s(a, b, t.nbytes), t.nbytes))
        out = []
        for (a, b, replica), got in sorted(times.items()):
            seconds = statistics.median(x[0] for x in got)
            predicted = statistics.median(x[1] for x in got)
            nbytes = statistics.median(x[2] for x in got)
            rate, start_rate = nbytes / seconds / 1e6, nbytes / predicted / 1e6 if predicted > 0 else math.inf
            key = f"link/{a}-{b}/measured_mbps" + (f"/replica{replica}" if replica else "")
            ratio, reads, base = self._calibrated(key, seconds / predicted if predicted > 0 else math.nan)
            text = None
            if ratio > self.factor and seconds - predicted > MIN_EXCESS_S:
                text = (f"slow link: {self.link_name(a, b, replica)}: {rate:.1f} MB/s, {start_rate:.1f} MB/s at start "
                        f"({1e3 * seconds:.2f} ms a transfer of {nbytes / 1e6:.3f} MB, {reads} its prediction; "
                        f"{base.rstrip('; ')})")
            out.append((key, text, rate, ratio))
        return out


def _ident(name: str) -> tuple[str, str]:
    """(``send`` or ``recv``, the transfer's id ``act0[0>1]``) of an op's text."""
    m = _TRANSFER.match(name)
    if m is None:
        return "", ""
    return m.group(1), f"{m.group(2)}{m.group(3)}[{m.group(4)}>{m.group(5)}]"

