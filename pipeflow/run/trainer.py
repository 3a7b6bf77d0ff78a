"""The training loop: steps, evaluations, checkpoints at their steps, preemption, logging.

How a step is scheduled is the Pipeline's business and how the run is put together the
builder's (:func:`pipeflow.run.builder.build_run`); the Trainer splits batches into
micro-batches (:mod:`pipeflow.run.microbatch_split`), hands them over, then finishes the step
(:mod:`pipeflow.run.step_update`: reductions, clip, optimizer) on every rank, and saves and
resumes through :mod:`pipeflow.checkpoint.train_state`.

A steady step never makes the host wait for the device: with fused AdamW a non-finite step is
skipped *on the device*, and step t's loss and norm are read back one step late, while step
t + 1 is already queued: an event wait, not a device drain.  A non-finite step is raised there,
named as before, before the next optimizer step and before any checkpoint.  Without fused AdamW
(ZeRO, ``optim.fused=false``) or with the fp16 loss scaler (whose next scale depends on this
step's overflow) the values are read back in the step, before the update.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from pipeflow.checkpoint.train_state import TrainState
from pipeflow.data.batch_ramp import lr_position_end
from pipeflow.observability.metrics import perplexity
from pipeflow.planning.layout import describe_layout
from pipeflow.run.evaluation import held_out_loss, reached_a_rank
from pipeflow.run.microbatch_split import MicroBatches
from pipeflow.run.phases import Loop, ModelParts, RunPlan, Topology
from pipeflow.run.readback import PendingStep, StepValues
from pipeflow.run.run_log import compile_line, end_line, start_lines
from pipeflow.run.saves import RunSaves
from pipeflow.run.signals import (agent_stopping, catch_signals, clear_preemption, record_preemption, signal_names,
                                  signal_numbers)
from pipeflow.run.spikes import Spike, SpikeGuard, SpikeRollback
from pipeflow.run.step_batches import StepBatches
from pipeflow.run.step_update import clip_grad_norm_global, lr_at, unique_parameters
from pipeflow.runtime.world import distributed
from pipeflow.runtime import failures
from pipeflow.runtime.clip import clip_on_device
from pipeflow.runtime.keyed_dropout import SampleKeys
from pipeflow.runtime.memory import MemoryAccountant

__all__ = ["Trainer", "clip_grad_norm_global", "clip_on_device", "lr_at", "unique_parameters"]

log = logging.getLogger("pipeflow")



@dataclass
class Trainer:
    """Trains this rank's part of the pipeline: the loop over what :func:`~pipeflow.run.builder.build_run` built.

    It holds the values the builder's phases returned (:mod:`pipeflow.run.phases`): reach the
    objects through them (``trainer.parts.stages``, ``trainer.loop.pipeline``,
    ``trainer.loop.update.optimizer``, ``trainer.plan.layout``, ``trainer.topology.mesh``).

    Attributes:
        cfg: the resolved config (``train``, ``optim`` and ``data`` settings are read).
        device: this rank's device.
        plan: the model, data, schedule and layout (with its prediction) every rank planned alike.
        topology: the dp x pp process mesh, the pipeline's transport and the run's deadlines.
        parts: this rank's stages and what holds their parameters (tied weights, dp reducer,
            compiled layers, the parameters that train).
        loop: the pipeline, the step's update (optimizer, fp16 loss scaler, finite check, MoE
            routers' statistics), the fault injector, metrics, the run directory (its lock,
            released at the end of :meth:`fit`) and the memory accountant.
        history: the loss of every step this run trained.
    """

    cfg: DictConfig
    device: torch.device
    plan: RunPlan
    topology: Topology
    parts: ModelParts
    loop: Loop
    history: list[float] = field(default_factory=list)
    _signalled: str | None = field(default=None, init=False, repr=False)  # the train.save_on_signal signal received
    _from_agent: bool = field(default=False, init=False, repr=False)  # it was torchrun's agent stopping its workers
    _spikes: SpikeGuard | None = field(default=None, init=False, repr=False)  # train.spike (made at the first use)
    _watching_signals: bool = field(default=False, init=False, repr=False)  # evaluations check for it
    batches: StepBatches = field(init=False, repr=False)  # each step's micro-batches and schedule
    saves: RunSaves = field(init=False, repr=False)  # the run's checkpoints as the loop saves them

    def __post_init__(self) -> None:
        self.batches = StepBatches(self.cfg, self.device, self.plan, self.topology, self.parts, self.loop)
        self.saves = RunSaves(self.cfg, self.device, self.loop.metrics, self.is_main)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, which logs and writes."""
        return dist.get_rank() == 0

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.topology.mesh.dp

    @property
    def ranges(self) -> list[range]:
        """The layers of every stage."""
        return self.plan.layout.ranges

    @property
    def checkpoint_root(self) -> str:
        """Where checkpoints go: ``<run_dir>/checkpoints``."""
        return os.path.join(self.loop.workspace.run_dir, "checkpoints")

    @property
    def checkpoint_storage(self) -> str:
        """``train.checkpoint_storage``: ``shared`` (one folder every rank sees) or ``local``."""
        return self.cfg.train.checkpoint_storage

    @property
    def state(self) -> TrainState:
        """What this rank saves and resumes (:class:`~pipeflow.checkpoint.train_state.TrainState`)."""
        return TrainState(self.cfg, self.topology.mesh, self.parts.stages, self.ranges, self.plan.schedule.num_stages,
                          self.loop.update.optimizer, self.loop.update.scaler, lora=self.plan.spec.lora is not None, root=self.checkpoint_root,
                          storage=self.checkpoint_storage, job=self.loop.workspace.token,
                          batches_skipped=self.spikes.batches_skipped)

    def save_checkpoint(self, step: int, sync: bool = False) -> str:
        """Write ``<run_dir>/checkpoints/step_<step>`` (collective; :meth:`RunSaves.save`): at once,
        or staged and written in the background (``train.checkpoint_mode``) unless `sync`.

        Raises:
            NonFiniteError: a weight holds NaN or Inf (nothing is written; ``latest`` stays).
        """
        return self.saves.save(self.state, step, sync)

    def resume(self) -> int:
        """Load the checkpoint ``train.resume`` names, if any (:meth:`TrainState.resume`); returns
        the step to start from.

        Raises:
            CheckpointError: an explicitly named checkpoint is damaged (naming the file).
        """
        resumed = self.state.resume(announce=self.is_main)
        if resumed is None:
            return 0
        step, path, self.spikes.batches_skipped = resumed
        self.saves.saved = (step, path)
        return step

    @property
    def spikes(self) -> SpikeGuard:
        """``train.spike``'s guard: its detector, rollbacks and the training batches skipped."""
        if self._spikes is None:
            self._spikes = SpikeGuard.of(self.cfg.train.spike)
        return self._spikes

    def describe(self) -> str:
        """The schedule, its predicted bubble and the partition table (see pipeflow.planning.layout)."""
        return describe_layout(self.plan.layout, self.plan.spec, self.plan.schedule)

    def _train_microbatches(self, step: int) -> MicroBatches:
        """This dp rank's micro-batches of training step `step` (past the batches a rollback skipped)."""
        return self.batches.microbatches(self.plan.batches.train, step, self.spikes.batches_skipped)

    def _spiked(self, step: int, values: StepValues) -> Spike | None:
        """Judge step `step`'s loss and norm (``train.spike``, alike on every rank); rank 0 logs a
        spike with what is done about it. None: no spike (or the check is off, or an fp16 overflow)."""
        if values.overflow:
            return None
        spike, jumped = self.spikes.judge(step, values.loss, values.norm, values.stage_norms)
        if spike is not None and self.is_main:
            batch = step + self.spikes.batches_skipped
            first = (self.plan.ramp.consumed_before(step) if self.plan.ramp is not None
                     else batch * int(self.cfg.data.batch_size))
            log.warning(self.spikes.line(spike, jumped, f"training batch {batch} (samples {first}.., "
                                                        f"{self.batches.count(step)} micro-batches per replica)"))
        return spike

    @property
    def defers_readback(self) -> bool:
        """True when a step's loss and norm may be read back a step late (:attr:`StepUpdate.defers_readback`)."""
        return self.loop.update.defers_readback

    def forward_backward(self, step: int, memory: MemoryAccountant | None = None) -> tuple[float, float]:
        """Gradients of batch `step`, reduced over ties and dp, unscaled and clipped, left in
        ``p.grad``; returns (loss, grad norm before clipping), the same on every rank.

        A non-finite norm means an inf/nan gradient somewhere.  A non-finite loss or norm that is
        not an fp16 overflow (finite loss, the loss scaler on) always stops the run here, on every
        rank (the norm is all-reduced), naming the stages.  With ``train.check_finite`` the
        per-layer flags ride in the grad-norm all-reduce and name where NaN first appeared.
        With `memory` the pipeline samples this step's tensor bytes after every action.

        Raises:
            NonFiniteError: NaN/Inf that the loss scaler does not explain.
        """
        values = self.finish(self.queue(step, self.loop.update.optimizer.param_groups[0]["lr"], memory))
        return values.loss, values.norm

    def queue(self, step: int, lr: float, memory: MemoryAccountant | None = None) -> PendingStep:
        """Forward, backward, reductions and clipping of batch `step`, queued on the device; the
        packet of figures copied towards the host without waiting (see :class:`PendingStep`)."""
        inputs, targets, weights, _ = self._train_microbatches(step)
        if self.cfg.train.dropout_rng == "sample":  # this step's dropout masks, whatever the layout
            keys = SampleKeys(self.plan.spec.seed, step, self.batches.first_rows(step))
            for stage in self.parts.stages.values():
                stage.sample_keys = keys
        loss = self.loop.pipeline.run(inputs, targets, grad_scale=self.loop.update.scaler.scale, loss_weights=weights,
                                 memory=memory)
        return self.loop.update.reduce(step, lr, loss, preempt=bool(self._signalled), from_agent=self._from_agent)

    def finish(self, pending: PendingStep) -> StepValues:
        """Read step `pending.step`'s packet back and judge it (:meth:`StepUpdate.judge`).

        Raises:
            NonFiniteError: NaN/Inf that the loss scaler does not explain.
            RunDirLostError: rank 0's lock watch found the run directory or its lock gone or taken.
        """
        return self.loop.update.judge(pending, lambda: self._train_microbatches(pending.step).inputs)

    def apply(self, pending: PendingStep, values: StepValues | None) -> None:
        """The optimizer step of `pending` (:meth:`StepUpdate.apply`); :meth:`_end` releases the gradients."""
        self.loop.update.apply(pending, values, announce=self.is_main)

    def _begin(self, step: int) -> tuple[float, MemoryAccountant | None]:
        """Set step `step`'s learning rate and fault drill; returns (lr, the memory accountant
        when this step's tensor memory is measured)."""
        ramp = self.plan.ramp
        lr = lr_at(step if ramp is None else ramp.position(step), self.cfg.optim,
                   lr_position_end(ramp, self.cfg.train.max_steps))  # a ramp: lr follows the samples trained
        for group in self.loop.update.optimizer.param_groups:
            group["lr"] = lr
        if ramp is not None:
            self.loop.pipeline.use_schedule(self.batches.schedule_at(step))
            self.loop.metrics.ramp_batches(self.batches.ramp_batch)
        if self.loop.faults is not None:
            self.loop.faults.step = step
        memory = self.loop.memory if self.loop.metrics.memory.measures(step) else None
        if memory is not None:
            memory.begin()
        return lr, memory

    def _end(self, step: int, memory: MemoryAccountant | None) -> None:
        """After step `step`'s update: its memory measurement, the gradients released, the posting
        note, the steady deadline."""
        if memory is not None:  # what stays: after the optimizer step, before the grads are released
            moved = self.loop.pipeline.offloaded.bytes if self.loop.pipeline.offloaded is not None else math.nan
            self.loop.metrics.memory_measured(step, memory.end(self.loop.pipeline.comm_tensors()), moved)
        self.loop.update.optimizer.zero_grad(set_to_none=True)
        note = self.plan.posting.choice_note()
        if note is not None and self.is_main:
            log.info(note)
        self.topology.deadlines.first_step_done()  # later waits and collectives get the steady deadline

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step on batch `step`; returns (loss, grad norm before clipping) on every rank.

        With fp16, a step whose gradients overflowed on any rank is skipped on every rank (the
        norm that says so is all-reduced) and the loss scale halves (not below its minimum).
        This reads the step's figures back before its update; :meth:`fit` reads them a step late.
        """
        _, done = self.advance(step, None, late=False)
        values = done[-1][1]
        return values.loss, values.norm

    def advance(self, step: int, previous: PendingStep | None = None,
                late: bool | None = None) -> tuple[PendingStep | None, list[tuple[PendingStep, StepValues]]]:
        """The step :meth:`fit` runs: queue step `step`; read back `previous` (a step late) once
        this one is queued, before this step's update; then the update.

        Args:
            previous: the step still to read back (what the last call returned), or None.
            late: leave this step's figures on the device for the next call to read (default:
                :attr:`defers_readback`, except on a memory-measured step, which waits anyway).

        Returns:
            (this step if it is still to be read back, else None; the steps read back by this
            call with their values, in step order).

        Raises:
            NonFiniteError: `previous` or this step (when read now) was not finite.
        """
        lr, memory = self._begin(step)
        with failures.context(f"training step {step}"):
            pending = self.queue(step, lr, memory)
        done = [] if previous is None else [(previous, self.finish(previous))]
        for read, read_values in done:  # a step read back late was updated already: only warned about
            self._spiked(read.step, read_values)
        acting = self.spikes.acts
        if late is None:  # a spike's update is dropped before it is made: no step read back late
            late = self.defers_readback and memory is None and not acting
        values = None if late else self.finish(pending)
        spike = None if values is None else self._spiked(step, values)
        if spike is not None and acting:
            self.loop.update.optimizer.zero_grad(set_to_none=True)
            self._end(step, memory)
            if self.spikes.action == "rollback":
                raise SpikeRollback(spike)
            return None, done + [(pending, values)]
        self.apply(pending, values)
        self._end(step, memory)
        if values is None:
            return pending, done
        return None, done + [(pending, values)]

    def evaluate(self) -> float | None:
        """Mean loss over ``train.eval_batches`` held-out batches (:func:`~pipeflow.run.evaluation.held_out_loss`).

        Returns:
            The loss, or None when a ``train.save_on_signal`` signal reached some rank during it:
            after each batch every rank learns that from one small all-reduce, so all of them
            leave the evaluation at the same batch and the job saves within the launcher's grace.
        """
        stop = (lambda: reached_a_rank(bool(self._signalled), self.device)) if self._watching_signals else None
        # held-out batches are full ones (a ramp's training step may not be)
        self.loop.pipeline.use_schedule(self.plan.schedule)
        return held_out_loss(self.loop.pipeline, lambda k: self.batches.microbatches(self.plan.batches.val, k),
                             self.cfg.train.eval_batches, self.device, stop)

    def close(self) -> None:
        """Stop what runs beside the loop (the P2P watchdog's thread, joined) and release the run
        directory's lock; called at the end of :meth:`fit`, so every run and every sweep job ends
        with it (idempotent)."""
        self.loop.pipeline.comm.close()
        self.saves.close()
        self.loop.workspace.release()

    def _train(self, start: int) -> int | None:
        """Steps `start` .. ``train.max_steps`` - 1, each read back a step late where that is safe
        (:attr:`defers_readback`), everything read back before a save, an evaluation and the end.

        Returns:
            None, or the step whose checkpoint was saved because a ``train.save_on_signal``
            signal reached some rank (every rank learns it from the same all-reduce, so all stop
            at the same step boundary).
        """
        cfg = self.cfg.train
        previous: PendingStep | None = None
        step = start - 1
        while step + 1 < cfg.max_steps:
            step += 1
            self.saves.poll()  # a background save that ended on every rank: reported at this boundary
            self.loop.metrics.begin_step(step)
            try:
                waiting, done = self.advance(step, previous)
            except SpikeRollback as rollback:  # every rank alike: the loss and norm it judged are agreed
                self.loop.metrics.stop_step()
                step = self.saves.roll_back(self.state, self.spikes, rollback.spike) - 1
                continue
            timing = self.loop.metrics.stop_step()
            (waiting if waiting is not None else done[-1][0]).timing = timing
            preempt = False
            for finished, values in done:
                preempt |= self._record(finished, values)
            previous = waiting
            save = bool(cfg.save_every) and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.max_steps)
            evaluate = bool(cfg.eval_every) and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps
            if previous is not None and (preempt or save or evaluate or step + 1 == cfg.max_steps):
                preempt |= self._record(previous, self.finish(previous))  # read back before what follows
                previous = None
            if preempt:
                return self._leave_on_signal(step + 1, saved=None)
            path = self.save_checkpoint(step + 1) if save else None
            if evaluate:
                val = self.evaluate()
                if val is None:
                    return self._leave_on_signal(step + 1, saved=path, during="an evaluation")
                self.loop.metrics.evaluated(step + 1, val)
        return None

    def _leave_on_signal(self, step: int, saved: str | None, during: str = "") -> int:
        """Save the state after `step` (unless `saved` already holds it), say so, record it in the
        run directory (:func:`pipeflow.run.signals.record_preemption`) and return `step`.

        Args:
            step: the steps trained so far; the checkpoint's step.
            saved: the checkpoint of this step already written, or None.
            during: the phase the signal stopped (``an evaluation``), for the message.
        """
        distributed.saving_on_signal(True)  # a launcher that dies first must not end the save
        if not self.saves.before_leaving(step):  # the save in flight failed: this step is saved now
            saved = None
        path = saved if saved is not None else self.save_checkpoint(step, sync=True)
        names = list(map(str, signal_names(self.cfg.train.save_on_signal)))
        if self.is_main:
            where = f" during {during}" if during else ""
            if self._from_agent:
                log.warning("stopped at step %d%s by torchrun's agent, which stops its workers to restart them (a "
                            "node joined or left the job) or after a worker failed: saved %s, where a restart "
                            "continues", step, where, path)
            else:
                log.warning("preempted at step %d%s: saved %s (a signal of train.save_on_signal=%s reached a rank); "
                            "the same command with train.resume=auto continues from here", step, where, path, names)
        self._record_preemption(step, path)
        return step

    def _record_preemption(self, step: int, path: str | None) -> None:
        """Rank 0 records the preemption in the run directory, and each node's first rank tells its
        own launcher (every node's launcher exits 75, not only the one with rank 0); nothing is
        recorded when torchrun's agent stopped the workers (a restart, a failure: no preemption)."""
        if (self.is_main or distributed.local_rank() == 0) and not self._from_agent:
            record_preemption(self.loop.workspace.run_dir if self.is_main else None, step, path)

    def _evaluate_and_train(self, start: int) -> tuple[int | None, float, float]:
        """The first evaluation, the steps from `start`, the final evaluation, each of which a
        ``train.save_on_signal`` signal ends with a save (nothing is saved before the first
        step: the checkpoint resumed from, or nothing, already holds that state).

        Returns:
            (the step a signal stopped at, or None; the first held-out loss; the last one, NaN
            when a signal stopped the run).
        """
        nan = float("nan")
        first_val = self.evaluate()
        if first_val is None:
            if self.is_main:
                log.warning("preempted at step %d during the first evaluation, before any step of this launch: "
                            "nothing to save (%s); the same command with train.resume=auto starts from there", start,
                            "the checkpoint resumed from holds it" if start else "nothing trained yet")
            self._record_preemption(start, None)
            return start, nan, nan
        self.loop.metrics.evaluated(start, first_val, line=False)
        preempted_at = self._train(start)
        if preempted_at is not None:  # a preempted job saves and leaves: no final evaluation in the grace period
            return preempted_at, first_val, nan
        final_val = self.evaluate()
        if final_val is None:
            steps = self.cfg.train.max_steps
            last = self.saves.saved
            saved = last[1] if last is not None and last[0] == steps else None
            return self._leave_on_signal(steps, saved=saved, during="the final evaluation"), first_val, nan
        self.loop.metrics.evaluated(self.cfg.train.max_steps, final_val, line=False)
        return None, first_val, final_val

    def _on_signal(self, name: str) -> None:
        """A ``train.save_on_signal`` signal reached this rank: the next step's all-reduce carries it.
        Whether torchrun's agent sent it is judged now: a peer that saved and left makes the agent
        stop the rest, which must not turn this rank's own preemption into an agent's stop."""
        if self._signalled is None:
            self._from_agent = agent_stopping()
        self._signalled = name

    def _record(self, pending: PendingStep, values: StepValues) -> bool:
        """Hand a finished step's figures to the metrics and the history; returns its preempt flag."""
        self.loop.metrics.end_step(pending.step, values.loss, values.norm, pending.lr, pending.timing, values.routing)
        self.history.append(values.loss)
        if values.preempt:  # every rank alike: a stop by the agents only (a node joined or left) is no preemption
            self._from_agent = not values.external
        return values.preempt

    def fit(self) -> dict[str, Any]:
        """Train for ``train.max_steps`` steps; returns first/last loss, final held-out loss and the
        run's figures (``samples_per_s``, ``tokens_per_s``, ``step_time_s``, ``bubble_measured``,
        ``bubble_predicted``, ``peak_memory_mb``; see ``pipeflow.observability.metrics.RunMetrics.close``),
        and ``preempted_at``: None, or the step saved when a ``train.save_on_signal`` signal
        stopped the run early (train.py then exits with :data:`pipeflow.run.signals.PREEMPTED_EXIT_CODE`)."""
        cfg = self.cfg.train
        if self.is_main:
            for line in start_lines(self.cfg, self.topology.mesh, self.describe(), self.loop.workspace.run_dir,
                                    self.parts.compiled, self.loop.pipeline.shapes.mode):
                log.info(line)
            if self.plan.ramp is not None:
                log.info(self.batches.ramp_line())
        start = self.resume()
        if self.is_main:
            clear_preemption(self.loop.workspace.run_dir)
        trained = len(self.history)
        numbers = signal_numbers(cfg.save_on_signal)
        restore = catch_signals(numbers, self._on_signal)
        self._watching_signals = bool(numbers)
        try:  # every phase between the first and the last step saves and leaves on a signal
            preempted_at, first_val, final_val = self._evaluate_and_train(start)
        finally:
            self._watching_signals = False
            restore()
        if preempted_at is None:  # the last checkpoint is complete before the run says it ended
            self.saves.wait("the end of the run")
        losses = self.history[trained:]
        first_loss, last_loss = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
        result = {"first_loss": first_loss, "last_loss": last_loss, "first_val_loss": first_val, "val_loss": final_val,
                  "val_perplexity": perplexity(final_val), "preempted_at": preempted_at}
        result.update(self.loop.metrics.close(self.plan.schedule))
        if self.parts.compiled is not None:
            result["compile"] = self.parts.compiled.summary()
            if self.is_main:
                log.info(compile_line(result["compile"], self.parts.compiled.seconds))
        self.close()
        if self.is_main and preempted_at is None:
            log.info(end_line(result, self.plan.batches.best_loss,
                              with_perplexity=self.loop.metrics.items[1] is not None))
        return result
