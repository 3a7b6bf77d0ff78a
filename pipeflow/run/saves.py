"""A training run's checkpoints as the loop sees them: saved at their steps, synchronously or
staged and written in the background (``train.checkpoint_mode``), each background save reported
once it ended (its line and figures, or ``train.on_save_error``'s handling), the last one saved
or resumed remembered, and a spike's rollback to the last complete one."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig

from pipeflow.checkpoint.background import BackgroundSaver, SaveReport, raise_or_warn
from pipeflow.checkpoint.train_state import TrainState
from pipeflow.errors import LossSpikeError
from pipeflow.observability.metrics import RunMetrics
from pipeflow.run.spikes import Spike, SpikeGuard

log = logging.getLogger("pipeflow")

# a preemption waits this long for an older step's background save, then gives it up and saves its own
# step at once: torchrun's agent and Slurm allow 30 s between SIGTERM and SIGKILL by default
PREEMPT_WAIT_S = 20.0


@dataclass
class RunSaves:
    """This rank's side of the run's checkpoints (every call is collective: every rank makes it at
    the same step).

    Attributes:
        cfg: the resolved config (``train.checkpoint_mode``, ``train.on_save_error``, ``train.checkpoint_storage``).
        device: this rank's device.
        metrics: where a save's figures go.
        is_main: global rank 0, which logs.
        saved: the last checkpoint saved or resumed: (step, folder), or None.
    """

    cfg: DictConfig
    device: torch.device
    metrics: RunMetrics
    is_main: bool
    saved: tuple[int, str] | None = None
    _saver: BackgroundSaver | None = field(default=None, repr=False)  # train.checkpoint_mode=async*

    def save(self, state: TrainState, step: int, sync: bool = False) -> str:
        """Write `state` as ``<run_dir>/checkpoints/step_<step>`` (see pipeflow.checkpoint.saving), or
        with ``train.checkpoint_mode=async|async_process`` (unless `sync`) stage it and write it in
        the background (:mod:`pipeflow.checkpoint.background`): the folder it will have is returned
        at once, complete when reported.

        Raises:
            NonFiniteError: a weight holds NaN or Inf (nothing is written; ``latest`` stays).
        """
        started = time.perf_counter()
        mode = self.cfg.train.checkpoint_mode
        if sync or mode == "sync":
            path = state.save(step, self.device)
            if self.is_main:
                log.info("saved checkpoint of step %d: %s (%.2f s)", step, path, time.perf_counter() - started)
            self.metrics.checkpoint_saved(step, path, started, time.perf_counter() - started)
        else:
            if self._saver is None:  # collective: every rank reaches its first save at the same step
                self._saver = BackgroundSaver(str(mode), str(self.cfg.train.on_save_error), self.device,
                                              self.cfg.train.checkpoint_storage)
            path, waited = state.save(step, self.device, self._saver)
            self.settled(waited)
            if self.is_main and self._saver.inflight is not None:
                log.info("staged checkpoint of step %d in %.2f s (train.checkpoint_mode=%s): writing it in the "
                         "background", step, self._saver.inflight.staged_s, mode)
        self.saved = (step, path)
        return path

    def settled(self, report: SaveReport | None) -> None:
        """Report a background save that ended: its line and figures, or its failure
        (``train.on_save_error``: raised or warned on every rank alike)."""
        if report is None:
            return
        if report.error is not None:
            raise_or_warn(report, str(self.cfg.train.on_save_error))
            return
        if self.is_main:
            log.info("saved checkpoint of step %d: %s (written in the background in %.2f s)", report.step,
                     report.path, report.write_s)
        self.metrics.checkpoint_saved(report.step, str(report.path), report.written_from - report.staged_s,
                                      report.staged_s, report.write_s)

    def poll(self) -> None:
        """At a step boundary: report a background save that ended on every rank."""
        if self._saver is not None:
            self.settled(self._saver.poll())

    def wait(self, before: str) -> SaveReport | None:
        """Wait for the background save in flight, if any, and report it; `before` names what waits."""
        if self._saver is None:
            return None
        report = self._saver.wait(before)
        self.settled(report)
        return report

    def before_leaving(self, step: int) -> bool:
        """A signal stops the run after `step` steps: the save in flight finishes first (an older
        step's within :data:`PREEMPT_WAIT_S`, else it is given up); returns False when it failed,
        so that the caller saves `step` now."""
        if self._saver is None or self._saver.inflight is None:
            return True
        same = self._saver.inflight.step == step
        report = self._saver.wait("leaving", timeout_s=None if same else PREEMPT_WAIT_S)
        if report is not None and report.error is not None:
            if self.is_main:
                log.warning("the background checkpoint of step %d failed (%s): saving step %d now", report.step,
                            report.error, step)
            return False
        self.settled(report)
        return True

    def roll_back(self, state: TrainState, spikes: SpikeGuard, spike: Spike) -> int:
        """Reload the last complete checkpoint after `spike` (``train.spike.action=rollback``) and
        skip the batches from its step to the spike's; returns the step to go on from.

        Raises:
            LossSpikeError: no checkpoint to roll back to, or ``train.spike.max_rollbacks`` reached.
        """
        spikes.check_cap(spike)
        self.wait("a rollback")
        resumed = state.resume(announce=False, source="auto")
        if resumed is None:
            raise LossSpikeError(f"step {spike.step}: {spike.describe()}; train.spike.action=rollback has no complete "
                                 f"checkpoint to go back to (set train.save_every)")
        step, path, skipped = resumed
        first, last = spikes.rolled_back(spike, step, skipped)
        self.saved = (step, path)
        if self.is_main:
            log.warning("rolled back to %s (step %d) after the spike of step %d; batches %d..%d skipped (rollback %d "
                        "of at most %d)", path, step, spike.step, first, last, spikes.rollbacks, spikes.max_rollbacks)
        return step

    def close(self) -> None:
        """Stop the background writer, if one was started."""
        if self._saver is not None:
            self._saver.close()
