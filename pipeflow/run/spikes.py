"""Loss spikes (``train.spike``): a step whose loss or gradient norm stands far above the recent
steps', judged the same on every rank (both figures are already agreed: the loss comes from the
last stage, reduced over dp; the norm is all-reduced), before its optimizer step.

A value is a spike when it exceeds the median of the last ``window`` accepted steps by more than
``threshold`` robust deviations (1.4826 x the median absolute deviation: a standard deviation for
normal noise) and by more than ``min_rise`` of that median (so a flat, quiet loss does not flag
its noise). Only rises count: a falling loss is training. ``action``: ``warn`` logs it; ``skip``
also drops the step's update (as an fp16 overflow is dropped); ``rollback`` drops it, reloads the
last complete checkpoint and skips the batches from that checkpoint's step to the spike (PaLM's
remedy), at most ``max_rollbacks`` times, then stops with :class:`~pipeflow.errors.LossSpikeError`.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pipeflow.config.choices import SPIKE_ACTIONS
from pipeflow.errors import LossSpikeError, PipeflowError

ACTIONS = SPIKE_ACTIONS
MAD_TO_SIGMA = 1.4826
MIN_HISTORY = 8  # accepted steps before anything is judged


@dataclass(frozen=True)
class Spike:
    """A spiking step: which figure, its value, the window's median and how many deviations above."""

    step: int
    figure: str  # "loss" or "grad norm"
    value: float
    median: float
    deviations: float

    def describe(self) -> str:
        """``loss 9.81 is 14.2 robust deviations above the last 50 steps' median 2.31``."""
        return (f"{self.figure} {self.value:.4g} is {self.deviations:.1f} robust deviations above the recent median "
                f"{self.median:.4g}")


@dataclass
class SpikeDetector:
    """The recent accepted steps' losses and norms, and the rule (see the module docstring)."""

    window: int = 50
    threshold: float = 6.0
    min_rise: float = 0.1
    losses: deque = field(default_factory=deque, init=False)
    norms: deque = field(default_factory=deque, init=False)

    def judge(self, step: int, loss: float, norm: float) -> Spike | None:
        """The spike of step `step`, or None (an accepted step joins the window)."""
        for figure, value, history in (("loss", loss, self.losses), ("grad norm", norm, self.norms)):
            spike = self._spike(step, figure, value, history)
            if spike is not None:
                return spike
        for value, history in ((loss, self.losses), (norm, self.norms)):
            history.append(value)
            while len(history) > self.window:
                history.popleft()
        return None

    def _spike(self, step: int, figure: str, value: float, history: deque) -> Spike | None:
        if len(history) < min(MIN_HISTORY, self.window):
            return None
        median = statistics.median(history)
        spread = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in history)
        rise = value - median
        if rise <= self.min_rise * abs(median):
            return None
        deviations = rise / spread if spread > 0 else float("inf")
        return Spike(step, figure, value, median, deviations) if deviations > self.threshold else None


def jumped_stage(now: tuple[float, ...], before: tuple[float, ...]) -> str:
    """``stage 3's gradient norm jumped most (x41.2)``: the stage whose norm grew most since the
    last accepted step (`before`; without one, the largest norm now)."""
    if not now:
        return "stage gradient norms not read back"
    if len(before) == len(now) and all(b > 0 for b in before):
        ratios = [n / b for n, b in zip(now, before)]
        s = max(range(len(now)), key=lambda k: ratios[k] if math.isfinite(ratios[k]) else math.inf)
        return f"stage {s}'s gradient norm jumped most (x{ratios[s]:.3g})"
    s = max(range(len(now)), key=lambda k: now[k] if math.isfinite(now[k]) else math.inf)
    return f"stage {s}'s gradient norm is the largest ({now[s]:.3g})"


DONE = {"warn": "its update was made (train.spike.action=warn)",
        "skip": "its update was dropped (train.spike.action=skip)",
        "rollback": "its update was dropped; rolling back to the last checkpoint"}


@dataclass
class SpikeGuard:
    """``train.spike`` over a run: the detector, the last accepted step's stage norms (to say which
    stage jumped), and the rollbacks made and batches skipped so far (saved in checkpoints)."""

    action: str
    window: int = 50
    threshold: float = 6.0
    min_rise: float = 0.1
    max_rollbacks: int = 3
    batches_skipped: int = 0
    rollbacks: int = 0
    detector: SpikeDetector | None = field(default=None, init=False)
    stage_norms: tuple[float, ...] = field(default=(), init=False)

    @classmethod
    def of(cls, spike_cfg: Any) -> SpikeGuard:
        """The guard ``train.spike`` describes."""
        return cls(str(spike_cfg.action), int(spike_cfg.window), float(spike_cfg.threshold),
                   float(spike_cfg.min_rise), int(spike_cfg.max_rollbacks))

    @property
    def acts(self) -> bool:
        """A spike's update is dropped (so no step may be read back after its update)."""
        return self.action in ("skip", "rollback")

    def judge(self, step: int, loss: float, norm: float, stage_norms: tuple[float, ...]) -> tuple[Spike | None, str]:
        """(the spike of step `step` or None, the stage whose gradient norm jumped, for its line)."""
        if self.action == "off":
            return None, ""
        if self.detector is None:
            self.detector = SpikeDetector(self.window, self.threshold, self.min_rise)
        spike = self.detector.judge(step, loss, norm)
        if spike is None:
            self.stage_norms = stage_norms
            return None, ""
        return spike, jumped_stage(stage_norms, self.stage_norms)

    def line(self, spike: Spike, jumped: str, data: str) -> str:
        """The warning a spike gets: what it was, what is done, which stage, which data."""
        return f"step {spike.step}: loss spike: {spike.describe()}; {DONE[self.action]}; {jumped}; data: {data}"

    def check_cap(self, spike: Spike) -> None:
        """Before rolling back for `spike`.

        Raises:
            LossSpikeError: ``max_rollbacks`` were made already.
        """
        if self.rollbacks >= self.max_rollbacks:
            raise LossSpikeError(f"step {spike.step}: {spike.describe()}, after {self.rollbacks} rollback(s) "
                                 f"(train.spike.max_rollbacks={self.max_rollbacks}): the run keeps spiking; lower "
                                 f"optim.lr or raise optim.warmup_steps, then resume from the last checkpoint")

    def rolled_back(self, spike: Spike, to_step: int, skipped_before: int) -> tuple[int, int]:
        """Count a rollback to the checkpoint of `to_step` (which had skipped `skipped_before`
        batches): the batches from it to the spike are skipped; returns the first and last skipped."""
        self.rollbacks += 1
        self.batches_skipped = skipped_before + spike.step + 1 - to_step
        self.detector = None  # the window starts again from the reloaded state
        return skipped_before + to_step, skipped_before + spike.step


class SpikeRollback(PipeflowError):
    """Raised inside a step that spiked under ``train.spike.action=rollback``: the loop reloads the
    last complete checkpoint (control flow, not a failure users see)."""

    def __init__(self, spike: Spike) -> None:
        super().__init__(spike.describe())
        self.spike = spike
