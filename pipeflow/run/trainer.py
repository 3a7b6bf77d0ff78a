"""The training loop: lr schedule, global grad-norm clipping, the optimizer step, evaluation, logging.

How a step is scheduled is the Pipeline's business and how the run is put together the
builder's (:func:`pipeflow.run.builder.build_run`); the Trainer splits batches into
micro-batches, hands them over, then finishes the step (clip, optimizer, log) on every rank.
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

from pipeflow.data import Batches, loss_counts, microbatch_inputs, microbatch_targets, sequence_lengths, shard
from pipeflow.errors import NonFiniteError
from pipeflow.models.spec import ModelSpec
from pipeflow.observability.metrics import RunMetrics
from pipeflow.planning.layout import Layout, describe_layout
from pipeflow.run import checkpoint
from pipeflow.run.faults import FaultInjector
from pipeflow.run.workspace import Workspace
from pipeflow.runtime import failures
from pipeflow.runtime import finite as nonfinite
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.runtime.fsdp import is_sharded, local
from pipeflow.runtime.memory import MemoryAccountant
from pipeflow.runtime.mesh import GradReducer, Mesh
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import Posting
from pipeflow.runtime.precision import LossScaler
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
    """Clip by the norm over every stage's gradients (one all-reduce over the pipeline group).

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.  `extra` (e.g. the loss,
    non-zero on the last stage only) rides along in the same all-reduce.  Parameters whose id
    is in `skip` (copies of a tied parameter held elsewhere too) are scaled but not counted.
    With data parallelism the group spans `replicas` identical copies of every replicated
    gradient (after their dp all-reduce): each counts 1/replicas, while a gradient sharded over
    the dp group (``parallel.shard=full``: a DTensor) counts its local shard once, so one
    all-reduce over the world gives the norm of one model.  A non-finite norm (fp16 overflow on
    any rank) is returned unclipped.

    Returns:
        (total norm before clipping, the all-reduced `extra`).
    """
    grads = [local(p.grad) for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    device = extra.device
    # one norm per tensor (in its own dtype, half types accumulated in float32), squared and summed
    # in float64: no float64 copy of any gradient.  A sharded gradient (parallel.shard=full) is
    # counted by its local shard, once: the dp group holds each of its rows once, not `replicas` times
    replicated = _sum_of_squares([g for g in counted if not is_sharded(g)])
    total_sq = (replicated / replicas if replicas > 1 else replicated) + _sum_of_squares(
        [local(g) for g in counted if is_sharded(g)])
    packed = torch.cat([total_sq.reshape(1).to(device, torch.float64), extra.to(torch.float64).reshape(-1)])
    dist.all_reduce(packed, group=group)
    total = float(packed[0].sqrt())
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total, packed[1:]


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the gradients' squared 2-norms, in float64 (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([_norm(g.detach()) for g in grads]).double().pow(2).sum()


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """The 2-norm of one gradient; float16/bfloat16 reduced in float32 (no copy on CUDA)."""
    half = grad.dtype in (torch.float16, torch.bfloat16)
    return torch.linalg.vector_norm(grad, dtype=torch.float32 if half else None)


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
    history: list[float] = field(default_factory=list)  # the loss of every step this run trained

    @property
    def is_main(self) -> bool:
        """True on global rank 0, which logs and writes."""
        return dist.get_rank() == 0

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.mesh.dp

    @property
    def ranges(self) -> list[range]:
        """The layers of every stage."""
        return self.layout.ranges

    @property
    def checkpoint_root(self) -> str:
        """Where checkpoints go: ``<run_dir>/checkpoints``."""
        return os.path.join(self.run_dir, "checkpoints")

    def save_checkpoint(self, step: int) -> str:
        """Write ``<run_dir>/checkpoints/step_<step>`` (collective; see pipeflow.checkpoint).

        Raises:
            NonFiniteError: a weight holds NaN or Inf (nothing is written; ``latest`` stays).
        """
        flags = nonfinite.stage_flags(self.stages, self.schedule.num_stages, self.device, what="params")
        dist.all_reduce(flags)
        bad = [s for s, flag in enumerate(flags.tolist()) if flag > 0]
        if bad:
            raise NonFiniteError(
                f"checkpoint of step {step} not written: the weights of stage(s) {bad} hold NaN or Inf after the "
                f"optimizer step (optim.lr={self.cfg.optim.lr} too large?); latest still names the last good checkpoint"
            )
        meta = {"dp": self.dp, "pp": self.mesh.pp, "shard": self.cfg.parallel.shard, "scaler": self.scaler.state_dict()}
        job = self.workspace.token if self.workspace is not None else ""
        return checkpoint.save(self.checkpoint_root, step, layers_by_index(self.stages, self.ranges), self.optimizer,
                               meta, job=job)

    def resume(self) -> int:
        """Load the checkpoint ``train.resume`` names, if any; returns the step to start from.

        Every candidate is verified first (digests).  With ``auto`` a damaged checkpoint is
        skipped, with a warning naming the bad file, for the previous good one.

        Raises:
            CheckpointError: an explicitly named checkpoint is damaged (naming the file).
        """
        path = checkpoint.choose(self.cfg.train.resume, self.checkpoint_root)
        if path is None:
            return 0
        meta = checkpoint.load(path, layers_by_index(self.stages, self.ranges), self.optimizer)
        self.scaler.load_state_dict(meta["scaler"])
        if self.is_main:
            log.info("resumed from checkpoint %s at step %d (saved with dp=%s, pp=%s, shard=%s)", path, meta["step"],
                     meta["dp"], meta["pp"], meta.get("shard", "none"))
        return int(meta["step"])

    def describe(self) -> str:
        """The schedule, its predicted bubble and the partition table (see pipeflow.planning.layout)."""
        return describe_layout(self.layout, self.spec, self.schedule)

    def _microbatches(
        self, source: Any, step: int
    ) -> tuple[list[Tensors] | None, list[torch.Tensor] | None, list[float] | None]:
        """This dp rank's micro-batches of batch `step`: the inputs on stage 0's rank, the targets
        and each micro-batch's loss weight on the last stage's (None elsewhere).

        A micro-batch's weight is dp x its loss elements (tokens or rows) over the global batch's,
        so that summed over micro-batches and averaged over replicas, loss and gradients are the
        global batch's mean however the micro-batches differ in size (1/m when they are alike).
        """
        first, last = 0 in self.stages, self.schedule.num_stages - 1 in self.stages
        if not (first or last):
            return None, None, None
        batch = source.get(step)
        x, y = shard(batch, self.mesh.dp_rank, self.dp)
        m = self.schedule.num_microbatches
        inputs = targets = weights = None
        if first:
            inputs = microbatch_inputs(x, m, self.device, getattr(torch, self.cfg.train.dtype))
        if last:
            targets = microbatch_targets(y, m, self.device)
            total = loss_counts(batch[1])
            weights = [self.dp * t.numel() / total for t in targets]
        return inputs, targets, weights

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
        inputs, targets, weights = self._microbatches(self.batches.train, step)
        loss = self.pipeline.run(inputs, targets, grad_scale=self.scaler.scale, loss_weights=weights, memory=memory)
        extra = torch.zeros(1, device=self.device, dtype=torch.float64) if loss is None else loss.detach().double().reshape(1) / self.dp
        if self.finite is not None:  # before the dp and tie sums, which would spread a NaN to other stages
            extra = torch.cat([extra, self.finite.local_flags().to(extra.dtype)])
        if self.reducer is not None:  # before the tie sums: it writes back what it snapshotted
            self.reducer.finish()
        self.tied.reduce_grads()
        self.scaler.unscale_(self.params)
        norm, reduced = clip_grad_norm_global(
            self.params, self.cfg.optim.grad_clip, None, extra, self.tied.duplicates(), replicas=self.dp
        )
        reduced = reduced.tolist()
        if self.finite is not None:
            self.finite.raise_if_non_finite(reduced[1:], step, self.schedule.stage_to_rank, self.scaler)
        loss_finite = math.isfinite(reduced[0])
        # a non-finite norm with a finite loss under fp16 is the loss scaler's overflow to skip
        if not loss_finite or (not math.isfinite(norm) and not self.scaler.enabled):
            flags = nonfinite.stage_flags(self.stages, self.schedule.num_stages, self.device)
            dist.all_reduce(flags)  # only now, to name the stages: every rank saw the same norm
            stages = [s for s, flag in enumerate(flags.tolist()) if flag > 0]
            raise nonfinite.non_finite_step_error(step, loss_finite, stages, self.schedule.stage_to_rank)
        return reduced[0], norm

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step on batch `step`; returns (loss, grad norm before clipping) on every rank.

        With fp16, a step whose gradients overflowed on any rank is skipped on every rank (the
        norm that says so is all-reduced) and the loss scale halves (not below its minimum).
        """
        lr = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.faults is not None:
            self.faults.step = step
        memory = self.memory if self.memory is not None and self.metrics.memory.measures(step) else None
        if memory is not None:
            memory.begin()
        with failures.context(f"training step {step}"):
            loss, norm = self.forward_backward(step, memory)
        overflow = self.scaler.enabled and not math.isfinite(norm)
        scale, at_floor = self.scaler.scale, self.scaler.at_minimum
        if not overflow:
            self.optimizer.step()
        self.scaler.update(overflow)
        if memory is not None:  # what stays: after the optimizer step, before the grads are released
            self.metrics.memory_measured(step, memory.end(self.pipeline.comm_tensors()))
        if overflow and self.is_main:
            floor = (" - the scale is at its minimum, so a lower one cannot cure this: look for NaN/Inf in the "
                     "model, or use train.precision=bf16 (train.check_finite=true stops here)") if at_floor else ""
            log.warning("step %d: inf/nan gradients (fp16 overflow); step skipped, loss scale %.0f -> %.0f%s",
                        step, scale, self.scaler.scale, floor)
        self.optimizer.zero_grad(set_to_none=True)
        note = self.posting.choice_note()
        if note is not None and self.is_main:
            log.info(note)
        self.deadlines.first_step_done()  # later waits and collectives get the steady deadline
        return loss, norm

    def evaluate(self) -> float:
        """Mean loss over ``train.eval_batches`` held-out batches (forward only)."""
        total = torch.zeros(1, device=self.device, dtype=torch.float64)
        for k in range(self.cfg.train.eval_batches):
            inputs, targets, weights = self._microbatches(self.batches.val, k)
            with failures.context("evaluation"):
                loss = self.pipeline.eval(inputs, targets, loss_weights=weights)
            if loss is not None:
                total += loss.double()
        dist.all_reduce(total)  # the last stage of every replica holds its shard's mean loss
        return float(total) / (self.cfg.train.eval_batches * self.dp)

    def close(self) -> None:
        """Stop what runs beside the loop (the P2P watchdog's thread, joined) and release the run
        directory's lock; called at the end of :meth:`fit`, so every run and every sweep job ends
        with it (idempotent)."""
        self.pipeline.comm.close()
        if self.workspace is not None:
            self.workspace.release()

    def fit(self) -> dict[str, Any]:
        """Train for ``train.max_steps`` steps; returns first/last loss, final held-out loss and the
        run's figures (``samples_per_s``, ``tokens_per_s``, ``step_time_s``, ``bubble_measured``,
        ``bubble_predicted``, ``peak_memory_mb``; see ``pipeflow.observability.metrics.RunMetrics.close``)."""
        cfg = self.cfg.train
        if self.is_main:
            log.info(self.describe())
            log.info("run directory: %s", self.run_dir)
            log.info("mesh: dp=%d x pp=%d, shard=%s, precision=%s, activation checkpointing=%s", self.dp, self.mesh.pp,
                     self.cfg.parallel.shard, self.cfg.train.precision, self.cfg.pipeline.checkpoint_activations)
            lengths = sequence_lengths(self.cfg.data)
            if lengths is not None or self.pipeline.shapes.mode == "per_microbatch":
                drawn = f"; sequence lengths drawn from {lengths[0]}..{lengths[1]}" if lengths is not None else ""
                log.info("micro-batches of a step may differ in shape (each learned per step)%s", drawn)
        start = self.resume()
        first_val = self.evaluate()
        trained = len(self.history)
        for step in range(start, cfg.max_steps):
            self.metrics.begin_step(step)
            loss, norm = self.train_step(step)
            self.metrics.end_step(step, loss, norm, self.optimizer.param_groups[0]["lr"])
            self.history.append(loss)
            if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.max_steps):
                self.save_checkpoint(step + 1)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
                val = self.evaluate()
                if self.is_main:
                    log.info("step %4d | held-out loss %.4f", step + 1, val)
        final_val = self.evaluate()
        losses = self.history[trained:]
        first_loss, last_loss = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
        result = {"first_loss": first_loss, "last_loss": last_loss, "first_val_loss": first_val, "val_loss": final_val}
        result.update(self.metrics.close(self.schedule))
        self.close()
        if self.is_main:
            best = f" (best achievable {self.batches.best_loss:.4f})" if self.batches.best_loss is not None else ""
            log.info("loss %.4f -> %.4f | held-out loss %.4f -> %.4f%s", first_loss, last_loss, first_val, final_val, best)
        return result
