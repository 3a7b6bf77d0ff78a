"""The training loop: lr schedule, global grad-norm clipping, the optimizer step, evaluation, logging.

How a step is scheduled is the Pipeline's business and how the run is put together the
builder's (:func:`pipeflow.run.builder.build_run`); the Trainer splits batches into
micro-batches, hands them over, then finishes the step (clip, optimizer, log) on every rank.

A steady step never makes the host wait for the device.  The global grad norm, the clip
coefficient and the finite check stay on the device (one all-reduce carries the norm, the loss,
per-stage non-finite flags, the preemption flag and rank 0's run-directory-lost flag); with
fused AdamW a non-finite step is skipped *on the device* (its ``found_inf``), and step t's loss
and norm are read back one step late, while step t + 1 is already queued: an event wait, not a
device drain.  A non-finite step
is raised there, named as before, before the next optimizer step and before any checkpoint.
Without fused AdamW (ZeRO, ``optim.fused=false``) or with the fp16 loss scaler (whose next
scale depends on this step's overflow) the values are read back in the step, before the update.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pipeflow.data import (Batches, loss_counts, microbatch_counts, microbatch_inputs, microbatch_targets,
                           sequence_lengths, shard)
from pipeflow.errors import AllTargetsMaskedError, NonFiniteError
from pipeflow.models.spec import ModelSpec
from pipeflow.observability.metrics import RunMetrics, perplexity
from pipeflow.planning.layout import Layout, describe_layout
from pipeflow.run import checkpoint, lora_base, storage
from pipeflow.run.compile_phase import CompilePhase
from pipeflow.run.faults import FaultInjector
from pipeflow.run.readback import PendingStep, StepValues, packet_on_host
from pipeflow.run.signals import catch_signals, clear_preemption, record_preemption, signal_names, signal_numbers
from pipeflow.run.workspace import Workspace
from pipeflow.runtime import distributed, failures
from pipeflow.runtime import finite as nonfinite
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.runtime.clip import clip_on_device, grad_norms
from pipeflow.runtime.fsdp import local
from pipeflow.runtime.memory import MemoryAccountant
from pipeflow.runtime.mesh import GradReducer, Mesh
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import Posting
from pipeflow.runtime.precision import LossScaler
from pipeflow.runtime.routing import RoutingSync
from pipeflow.runtime.stage import Stage, Tensors, layers_by_index
from pipeflow.runtime.tied import TiedWeights
from pipeflow.runtime.transport import Deadlines
from pipeflow.schedules import PipelineSchedule

log = logging.getLogger("pipeflow")


def lr_at(step: int, cfg: Any, max_steps: int) -> float:
    """Linear warm-up to optim.lr, then cosine decay to optim.min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def unique_parameters(groups: Any) -> list[torch.nn.Parameter]:
    """The parameters of several modules' lists, each once (tied copies on one rank are shared)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for params in groups:
        for p in params:
            seen.setdefault(id(p), p)
    return list(seen.values())


def clip_grad_norm_global(
    params: list[torch.nn.Parameter], max_norm: float, group: Any, extra: torch.Tensor, skip: set[int] = frozenset(),
    replicas: int = 1,
) -> tuple[float, torch.Tensor]:
    """:func:`clip_on_device`, with the norm read back to the host (a sync on a GPU: for tests and tools).

    Returns:
        (total norm before clipping, the all-reduced `extra`).
    """
    total, reduced = clip_on_device(params, max_norm, group, extra, skip, replicas)
    return float(total), reduced


@dataclass
class Trainer:
    """Trains this rank's part of the pipeline: the loop over what :func:`~pipeflow.run.builder.build_run` built.

    Attributes:
        cfg: the resolved config (``train``, ``optim`` and ``data`` settings are read).
        device: this rank's device.
        config_hash: the digest every rank agreed on.
        mesh: the dp x pp process mesh.
        spec, schedule, layout: the model, the schedule, the partition (and its prediction).
        batches: the train and validation batch sources.
        stages, pipeline: this rank's stages and the interpreter of its program.
        posting: which lowering the pipeline runs (its auto choice is logged once).
        deadlines: switched to the steady deadline after the first training step.
        tied, reducer: tied-weight and data-parallel gradient reduction (reducer None at dp = 1).
        scaler, finite, faults: the fp16 loss scaler, the optional non-finite check and fault injector.
        params, optimizer, metrics, run_dir: what is optimized, how, measured, and where written.
        workspace: the run directory's lock (released at the end of :meth:`fit`) and job token.
        memory: counts this rank's tensor bytes on the steps ``metrics.memory_steps`` names.
        compiled: ``train.compile``'s start-up phase (None: eager), its recompiles reported at the end.
    """

    cfg: DictConfig
    device: torch.device
    config_hash: str
    mesh: Mesh
    spec: ModelSpec
    schedule: PipelineSchedule
    layout: Layout
    batches: Batches
    stages: dict[int, Stage]
    pipeline: Pipeline
    posting: Posting
    deadlines: Deadlines
    tied: TiedWeights
    reducer: GradReducer | None
    scaler: LossScaler
    finite: FiniteCheck | None
    faults: FaultInjector | None
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    metrics: RunMetrics
    run_dir: str
    workspace: Workspace | None = None  # the run directory's lock and this job's token
    memory: MemoryAccountant | None = None
    compiled: CompilePhase | None = None  # train.compile: the start-up compile phase
    routing: RoutingSync | None = None  # model.moe: the routers' statistics, summed in the step's all-reduce
    history: list[float] = field(default_factory=list)  # the loss of every step this run trained
    _signalled: str | None = field(default=None, init=False, repr=False)  # the train.save_on_signal signal received
    _watching_signals: bool = field(default=False, init=False, repr=False)  # evaluations check for it
    _saved: tuple[int, str] | None = field(default=None, init=False, repr=False)  # last saved or resumed: (step, folder)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, which logs and writes."""
        return dist.get_rank() == 0

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.mesh.dp

    @property
    def pipelines(self) -> int:
        """Pipelines running the same program (dp x tp): each holds its shard's loss on its last stage."""
        return self.mesh.dp * self.mesh.tp

    @property
    def ranges(self) -> list[range]:
        """The layers of every stage."""
        return self.layout.ranges

    @property
    def checkpoint_root(self) -> str:
        """Where checkpoints go: ``<run_dir>/checkpoints``."""
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def checkpoint_storage(self) -> str:
        """``train.checkpoint_storage``: ``shared`` (one folder every rank sees) or ``local``."""
        return str(OmegaConf.select(self.cfg, "train.checkpoint_storage", default="shared"))

    def save_checkpoint(self, step: int) -> str:
        """Write ``<run_dir>/checkpoints/step_<step>`` (collective; see pipeflow.checkpoint).

        Raises:
            NonFiniteError: a weight holds NaN or Inf (nothing is written; ``latest`` stays).
        """
        flags = nonfinite.param_flags(self.stages, self.schedule.num_stages, self.device)
        dist.all_reduce(flags)
        bad = [s for s, flag in enumerate(flags.tolist()) if flag > 0]
        if bad:
            raise NonFiniteError(
                f"checkpoint of step {step} not written: the weights of stage(s) {bad} hold NaN or Inf after the "
                f"optimizer step (optim.lr={self.cfg.optim.lr} too large?); latest still names the last good checkpoint"
            )
        meta = {"dp": self.dp, "pp": self.mesh.pp, "tp": self.mesh.tp, "order": list(self.mesh.grid.order),
                "shard": self.cfg.parallel.shard, "scaler": self.scaler.state_dict()}
        layers = layers_by_index(self.stages, self.ranges)
        if self.spec.lora is not None:  # the adapters only; the frozen base named, not copied
            meta[lora_base.LORA_BASE], layers = lora_base.record(self.cfg.model), lora_base.trainable(layers)
        job = self.workspace.token if self.workspace is not None else ""
        path = checkpoint.save(self.checkpoint_root, step, layers, self.optimizer, meta, job=job,
                               storage=self.checkpoint_storage)
        self._saved = (step, path)
        return path

    def resume(self) -> int:
        """Load the checkpoint ``train.resume`` names, if any; returns the step to start from.

        Every candidate is verified first (digests).  With ``auto`` a damaged checkpoint is
        skipped, with a warning naming the bad file, for the previous good one.

        Raises:
            CheckpointError: an explicitly named checkpoint is damaged (naming the file).
        """
        choose = storage.choose_local if self.checkpoint_storage == "local" else checkpoint.choose
        path = choose(self.cfg.train.resume, self.checkpoint_root)
        if path is None:
            return 0
        layers = layers_by_index(self.stages, self.ranges)
        if self.spec.lora is not None:  # its adapters, over the base it names
            layers = lora_base.trainable(layers)
        meta = checkpoint.load(path, layers, self.optimizer, self.checkpoint_storage, grid=self.mesh.grid)
        if lora_base.LORA_BASE in meta:
            lora_base.check(meta[lora_base.LORA_BASE], self.cfg.model, path)
        self.scaler.load_state_dict(meta["scaler"])
        if self.is_main:
            log.info("resumed from checkpoint %s at step %d (saved with %s)", path, meta["step"],
                     checkpoint.saved_layout(meta))
        self._saved = (int(meta["step"]), path)
        return int(meta["step"])

    def describe(self) -> str:
        """The schedule, its predicted bubble and the partition table (see pipeflow.planning.layout)."""
        return describe_layout(self.layout, self.spec, self.schedule)

    def _microbatches(
        self, source: Any, step: int
    ) -> tuple[list[Tensors] | None, list[torch.Tensor] | None, list[float] | None, int]:
        """This dp rank's micro-batches of batch `step`: the inputs on stage 0's rank, the targets
        and each micro-batch's loss weight on the last stage's (None elsewhere), and the targets
        the loss counts in the global batch (0 on ranks that hold neither end).

        A micro-batch's weight is dp x the targets its loss counts (``ModelSpec.loss_count``:
        tokens or rows, less masked ones) over the global batch's, so that summed over
        micro-batches and averaged over replicas, loss and gradients are the global batch's mean
        over its counted targets however the micro-batches differ in size or masking.  Every rank
        holds the global batch, so the global count needs no collective; counts are taken on the
        host batch.  An all-masked micro-batch weighs 0 (its stage skips its loss).

        Raises:
            AllTargetsMaskedError: a training batch whose every target is masked.
        """
        first, last = 0 in self.stages, self.schedule.num_stages - 1 in self.stages
        weighs = last or self.routing is not None  # an MoE layer's aux loss weighs as its micro-batch's loss
        if not (first or weighs):
            return None, None, None, 0
        batch = source.get(step)
        total = loss_counts(batch[1], self.spec.loss_count)  # the global batch's, on the host
        if total == 0 and source is self.batches.train:
            raise AllTargetsMaskedError(
                f"training batch {step}: every target is masked (the loss's ignore_index, -100), so the step has "
                f"nothing to learn from (seen on rank {dist.get_rank()}, which holds the batch); check the data's "
                f"masks (data=chat: does the chat template mark assistant turns?)")
        x, y = shard(batch, self.mesh.dp_rank, self.dp)
        m = self.schedule.num_microbatches
        inputs = targets = weights = None
        if first:
            inputs = microbatch_inputs(x, m, self.device, getattr(torch, self.cfg.train.dtype))
        if weighs:
            counts = microbatch_counts(y, m, self.spec.loss_count)  # before the batch moves to the device
            weights = [self.dp * c / total if total else 0.0 for c in counts]
        if last:
            targets = microbatch_targets(y, m, self.device)
        return inputs, targets, weights, total

    @property
    def defers_readback(self) -> bool:
        """True when a step's loss and norm may be read back a step late: the optimizer skips a
        non-finite update on the device (fused AdamW's ``found_inf``) and no fp16 loss scale
        depends on this step's overflow."""
        opt = self.optimizer
        return (isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and bool(opt.defaults.get("fused"))
                and not self.scaler.enabled)

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
        values = self.finish(self.queue(step, self.optimizer.param_groups[0]["lr"], memory))
        return values.loss, values.norm

    def queue(self, step: int, lr: float, memory: MemoryAccountant | None = None) -> PendingStep:
        """Forward, backward, reductions and clipping of batch `step`, queued on the device; the
        packet of figures copied towards the host without waiting (see :class:`PendingStep`)."""
        inputs, targets, weights, _ = self._microbatches(self.batches.train, step)
        loss = self.pipeline.run(inputs, targets, grad_scale=self.scaler.scale, loss_weights=weights, memory=memory)
        zero = torch.zeros(1, device=self.device, dtype=torch.float64)
        own_loss = zero if loss is None else loss.detach().double().reshape(1) / self.pipelines
        preempt = zero + (1.0 if self._signalled else 0.0)
        # rank 0's lock watch found the run directory gone or taken: every rank stops at this step
        lost = zero + (1.0 if self.workspace is not None and self.workspace.lost else 0.0)
        # train.check_finite's flags: before the dp and tie sums, which would spread a NaN to other stages
        checked = [self.finite.local_flags().to(torch.float64)] if self.finite is not None else []
        if self.reducer is not None:  # before the tie sums: it writes back what it snapshotted
            self.reducer.finish()
        self.tied.reduce_grads()
        self.scaler.unscale_(self.params)
        with_grad = [p for p in self.params if p.grad is not None]
        norms = grad_norms([local(p.grad) for p in with_grad])
        routing = [self.routing.packet(self.device)] if self.routing is not None else []
        extra = torch.cat([own_loss, preempt, lost, self._stage_flags(with_grad, norms), *checked, *routing])
        norm, reduced = clip_on_device(self.params, self.cfg.optim.grad_clip, None, extra, self.tied.duplicates(),
                                       replicas=self.pipelines, norms=norms,
                                       split=self.routing.split if self.routing is not None else None)
        if self.routing is not None:  # the step's summed tokens per expert move the routers' biases, on the device
            self.routing.balance(reduced[-self.routing.size:])
        return packet_on_host(step, lr, torch.cat([norm.reshape(1), reduced]))

    def _stage_flags(self, with_grad: list[torch.nn.Parameter], norms: list[torch.Tensor]) -> torch.Tensor:
        """S flags, 1 where one of this rank's stages has a non-finite gradient norm (`norms`, taken
        after the dp and tie sums): summed over the world in the step's all-reduce they name the
        stages, with no collective of their own."""
        S = self.schedule.num_stages
        norm_of = {id(p): n for p, n in zip(with_grad, norms)}
        flags = [torch.zeros((), device=self.device, dtype=torch.float64)] * S
        for s, stage in self.stages.items():
            mine = [norm_of[id(p)] for p in stage.parameters() if id(p) in norm_of]
            if mine:
                flags[s] = (~torch.isfinite(torch.stack(mine).double().sum())).double()
        return torch.stack(flags)

    def finish(self, pending: PendingStep) -> StepValues:
        """Read step `pending.step`'s packet back (waiting for its copy only) and judge it: a
        non-finite loss or norm that is not an fp16 overflow raises, naming the stages.

        Raises:
            NonFiniteError: NaN/Inf that the loss scaler does not explain.
            RunDirLostError: rank 0's lock watch found the run directory or its lock gone or taken
                (:mod:`pipeflow.run.lock`); every rank raises it at this step.
        """
        values, routing = pending.values(), None
        if self.routing is not None:  # the packet's tail: the routers' statistics (the loss gains their aux loss)
            values, routing = values[:-self.routing.size], self.routing.figures(values[-self.routing.size:], self.pipelines)
            values[1] += routing.aux
        S = self.schedule.num_stages
        norm, loss, preempt = values[0], values[1], values[2] > 0
        if values[3] > 0 and self.workspace is not None:
            raise self.workspace.lost_error(pending.step)
        grad_stages, checked = values[4:4 + S], values[4 + S:]
        # a non-finite step whose input batch holds NaN/Inf is named by its batch, not blamed on optim.lr
        with nonfinite.inputs_blamed(pending.step, lambda: self._microbatches(self.batches.train, pending.step)[0],
                                     self.schedule.num_microbatches, self.device):
            if self.finite is not None:
                self.finite.raise_if_non_finite(checked, pending.step, self.schedule.stage_to_rank, self.scaler)
            loss_finite = math.isfinite(loss)
            # a non-finite norm with a finite loss under fp16 is the loss scaler's overflow to skip
            if not loss_finite or (not math.isfinite(norm) and not self.scaler.enabled):
                stages = [s for s, flag in enumerate(grad_stages) if flag > 0]
                raise nonfinite.non_finite_step_error(pending.step, loss_finite, stages, self.schedule.stage_to_rank)
        return StepValues(loss, norm, preempt, overflow=self.scaler.enabled and not math.isfinite(norm), routing=routing)

    def apply(self, pending: PendingStep, values: StepValues | None) -> None:
        """The optimizer step of `pending` (skipped on an fp16 overflow); :meth:`_end` releases the gradients.

        `values` None: the step is not read back yet (:attr:`defers_readback`): fused AdamW is
        told on the device whether the norm was finite (``found_inf``) and skips the update if not.
        """
        if values is None:
            self.optimizer.found_inf = (~torch.isfinite(pending.reduced[0])).float()  # type: ignore[attr-defined]
            self.optimizer.step()
        else:
            if hasattr(self.optimizer, "found_inf"):
                del self.optimizer.found_inf  # type: ignore[attr-defined]
            scale, at_floor = self.scaler.scale, self.scaler.at_minimum
            if not values.overflow:
                self.optimizer.step()
            self.scaler.update(values.overflow)
            if values.overflow and self.is_main:
                floor = (" - the scale is at its minimum, so a lower one cannot cure this: look for NaN/Inf in the "
                         "model, or use train.precision=bf16 (train.check_finite=true stops here)") if at_floor else ""
                log.warning("step %d: inf/nan gradients (fp16 overflow); step skipped, loss scale %.0f -> %.0f%s",
                            pending.step, scale, self.scaler.scale, floor)

    def _begin(self, step: int) -> tuple[float, MemoryAccountant | None]:
        """Set step `step`'s learning rate and fault drill; returns (lr, the memory accountant
        when this step's tensor memory is measured)."""
        lr = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.faults is not None:
            self.faults.step = step
        memory = self.memory if self.memory is not None and self.metrics.memory.measures(step) else None
        if memory is not None:
            memory.begin()
        return lr, memory

    def _end(self, step: int, memory: MemoryAccountant | None) -> None:
        """After step `step`'s update: its memory measurement, the gradients released, the posting
        note, the steady deadline."""
        if memory is not None:  # what stays: after the optimizer step, before the grads are released
            moved = self.pipeline.offloaded.bytes if self.pipeline.offloaded is not None else math.nan
            self.metrics.memory_measured(step, memory.end(self.pipeline.comm_tensors()), moved)
        self.optimizer.zero_grad(set_to_none=True)
        note = self.posting.choice_note()
        if note is not None and self.is_main:
            log.info(note)
        self.deadlines.first_step_done()  # later waits and collectives get the steady deadline

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
        if late is None:
            late = self.defers_readback and memory is None
        values = None if late else self.finish(pending)
        self.apply(pending, values)
        self._end(step, memory)
        if values is None:
            return pending, done
        return None, done + [(pending, values)]

    def evaluate(self) -> float | None:
        """Mean loss over ``train.eval_batches`` held-out batches (forward only), each target the
        loss counts weighing alike (a batch weighs by its count; an all-masked one by nothing).

        Returns:
            The loss, or None when a ``train.save_on_signal`` signal reached some rank during it:
            after each batch every rank learns that from one small all-reduce, so all of them
            leave the evaluation at the same batch and the job saves within the launcher's grace.
        """
        total = torch.zeros(2, device=self.device, dtype=torch.float64)  # (loss x count, count)
        for k in range(self.cfg.train.eval_batches):
            inputs, targets, weights, count = self._microbatches(self.batches.val, k)
            with failures.context("evaluation"):
                loss = self.pipeline.eval(inputs, targets, loss_weights=weights)
            if loss is not None:
                total += torch.cat([loss.double().reshape(1) * count, total.new_tensor([count])])
            if self._watching_signals and self._signal_reached_a_rank():
                return None
        dist.all_reduce(total)  # the last stage of every pipeline holds its dp shard's share of the mean
        loss_sum, count = total.tolist()  # each pipeline's last stage added the count: pipelines x it
        if count == 0:
            raise AllTargetsMaskedError(f"evaluation: every target of the {self.cfg.train.eval_batches} held-out "
                                        f"batches (train.eval_batches) is masked; check the data's masks")
        return loss_sum / count

    def _signal_reached_a_rank(self) -> bool:
        """True on every rank when a ``train.save_on_signal`` signal reached any rank (one all-reduce
        and a read-back: for phases between steps, which wait for the host anyway)."""
        flag = torch.tensor([1.0 if self._signalled else 0.0], device=self.device)
        with failures.context("the preemption check between evaluation batches"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def close(self) -> None:
        """Stop what runs beside the loop (the P2P watchdog's thread, joined) and release the run
        directory's lock; called at the end of :meth:`fit`, so every run and every sweep job ends
        with it (idempotent)."""
        self.pipeline.comm.close()
        if self.workspace is not None:
            self.workspace.release()

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
        for step in range(start, cfg.max_steps):
            self.metrics.begin_step(step)
            waiting, done = self.advance(step, previous)
            timing = self.metrics.stop_step()
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
                self.metrics.evaluated(step + 1, val)
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
        path = saved if saved is not None else self.save_checkpoint(step)
        names = list(map(str, signal_names(self.cfg.train.save_on_signal)))
        if self.is_main:
            where = f" during {during}" if during else ""
            log.warning("preempted at step %d%s: saved %s (a signal of train.save_on_signal=%s reached a rank); "
                        "the same command with train.resume=auto continues from here", step, where, path, names)
        self._record_preemption(step, path)
        return step

    def _record_preemption(self, step: int, path: str | None) -> None:
        """Rank 0 records the preemption in the run directory, and each node's first rank tells its
        own launcher (every node's launcher exits 75, not only the one with rank 0)."""
        if self.is_main or distributed.local_rank() == 0:
            record_preemption(self.run_dir if self.is_main else None, step, path)

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
        self.metrics.evaluated(start, first_val, line=False)
        preempted_at = self._train(start)
        if preempted_at is not None:  # a preempted job saves and leaves: no final evaluation in the grace period
            return preempted_at, first_val, nan
        final_val = self.evaluate()
        if final_val is None:
            steps = self.cfg.train.max_steps
            saved = self._saved[1] if self._saved is not None and self._saved[0] == steps else None
            return self._leave_on_signal(steps, saved=saved, during="the final evaluation"), first_val, nan
        self.metrics.evaluated(self.cfg.train.max_steps, final_val, line=False)
        return None, first_val, final_val

    def _on_signal(self, name: str) -> None:
        """A ``train.save_on_signal`` signal reached this rank: the next step's all-reduce carries it."""
        self._signalled = name

    def _record(self, pending: PendingStep, values: StepValues) -> bool:
        """Hand a finished step's figures to the metrics and the history; returns its preempt flag."""
        self.metrics.end_step(pending.step, values.loss, values.norm, pending.lr, pending.timing, values.routing)
        self.history.append(values.loss)
        return values.preempt

    def fit(self) -> dict[str, Any]:
        """Train for ``train.max_steps`` steps; returns first/last loss, final held-out loss and the
        run's figures (``samples_per_s``, ``tokens_per_s``, ``step_time_s``, ``bubble_measured``,
        ``bubble_predicted``, ``peak_memory_mb``; see ``pipeflow.observability.metrics.RunMetrics.close``),
        and ``preempted_at``: None, or the step saved when a ``train.save_on_signal`` signal
        stopped the run early (train.py then exits with :data:`pipeflow.run.signals.PREEMPTED_EXIT_CODE`)."""
        cfg = self.cfg.train
        if self.is_main:
            log.info(self.describe())
            log.info("run directory: %s", self.run_dir)
            tp = f", sequence parallel={self.cfg.parallel.sequence_parallel}" if self.mesh.tp > 1 else ""
            ep = int(OmegaConf.select(self.cfg, "parallel.ep", default=1) or 1)
            tp += f", experts split over ep={ep} dp ranks (all_to_all)" if ep > 1 else ""
            log.info("mesh: %s, shard=%s%s, precision=%s, activation checkpointing=%s", self.mesh.describe(),
                     self.cfg.parallel.shard, tp, self.cfg.train.precision, self.cfg.pipeline.checkpoint_activations)
            log.info("%s%s", self.mesh.grid.describe(), self.mesh.order_reason)
            if self.compiled is not None:
                log.info(self.compiled.describe())
            lengths = sequence_lengths(self.cfg.data)
            if lengths is not None or self.pipeline.shapes.mode == "per_microbatch":
                drawn = f"; sequence lengths drawn from {lengths[0]}..{lengths[1]}" if lengths is not None else ""
                log.info("micro-batches of a step may differ in shape (each learned per step)%s", drawn)
        start = self.resume()
        if self.is_main:
            clear_preemption(self.run_dir)
        trained = len(self.history)
        numbers = signal_numbers(cfg.save_on_signal)
        restore = catch_signals(numbers, self._on_signal)
        self._watching_signals = bool(numbers)
        try:  # every phase between the first and the last step saves and leaves on a signal
            preempted_at, first_val, final_val = self._evaluate_and_train(start)
        finally:
            self._watching_signals = False
            restore()
        losses = self.history[trained:]
        first_loss, last_loss = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
        result = {"first_loss": first_loss, "last_loss": last_loss, "first_val_loss": first_val, "val_loss": final_val,
                  "val_perplexity": perplexity(final_val), "preempted_at": preempted_at}
        result.update(self.metrics.close(self.schedule))
        if self.compiled is not None:
            result["compile"] = self.compiled.summary()
            if self.is_main:
                log.info("compile: %d recompiles on rank 0 after the compile phase (%.1f s at start-up)%s",
                         result["compile"]["recompiles"], self.compiled.seconds,
                         "" if result["compile"]["recompiles"] == 0 else
                         " (new shapes, dtypes or modes: see TORCH_LOGS=recompiles)")
        self.close()
        if self.is_main and preempted_at is None:
            best = f" (best achievable {self.batches.best_loss:.4f})" if self.batches.best_loss is not None else ""
            ppl = (f" | held-out perplexity {perplexity(first_val):.4g} -> {perplexity(final_val):.4g}"
                   if self.metrics.items[1] is not None else "")
            log.info("loss %.4f -> %.4f | held-out loss %.4f -> %.4f%s%s", first_loss, last_loss, first_val, final_val,
                     best, ppl)
        return result
