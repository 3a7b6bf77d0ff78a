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

import statistics
from collections import deque
from dataclasses import dataclass, field

from pipeflow.errors import PipeflowError

ACTIONS = ("off", "warn", "skip", "rollback")
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


class SpikeRollback(PipeflowError):
    """Raised inside a step that spiked under ``train.spike.action=rollback``: the loop reloads the
    last complete checkpoint (control flow, not a failure users see)."""

    def __init__(self, spike: Spike) -> None:
        super().__init__(spike.describe())
        self.spike = spike
