"""The training loop: data, optimizer, lr schedule, global grad-norm clipping, evaluation, logging.

How a step is scheduled is the Pipeline's business; the Trainer splits batches into
micro-batches, hands them over, then finishes the step (clip, optimizer, log) on every rank.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeflow.run import checkpoint
from pipeflow.data import TOKEN_DATA, build_batches, shard, split_microbatches
from pipeflow.run import guard
from pipeflow.runtime import failures
from pipeflow.runtime.transport import DeadlineWatchdog, P2PComm
from pipeflow.run.config import check_config
from pipeflow.run.faults import install_from_env
from pipeflow.run.run_dir import agree_run_dir
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.layout import choose_layout, describe_layout
from pipeflow.runtime.mesh import GradReducer, build_mesh
from pipeflow.observability.metrics import RunMetrics, predicted_bubble
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.recv_policy import AheadTuner
from pipeflow.runtime.precision import LossScaler, configure_stages
from pipeflow.schedules import build_schedule
from pipeflow.runtime.stage import Tensors, build_stages, layers_by_index
from pipeflow.runtime.tied import TiedWeights

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
    With data parallelism the group spans `replicas` identical copies of every gradient (after
    their dp all-reduce): each counts 1/replicas, so one all-reduce over the world gives the
    norm of one model.  A non-finite norm (fp16 overflow on any rank) is returned unclipped.

    Returns:
        (total norm before clipping, the all-reduced `extra`).
    """
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    device = extra.device
    local = torch.stack([g.detach().double().pow(2).sum() for g in counted]).sum() if counted else torch.zeros((), dtype=torch.float64)
    local = local / replicas if replicas > 1 else local
    packed = torch.cat([local.reshape(1).to(device, torch.float64), extra.to(torch.float64).reshape(-1)])
    dist.all_reduce(packed, group=group)
    total = float(packed[0].sqrt())
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total, packed[1:]


class Trainer:
    """Builds this rank's part of the pipeline from the config and trains it.

    Args:
        cfg: the resolved Hydra config (see ``configs/`` and ``pipeflow/config.py``).
        device: this rank's device.
    """

    def __init__(self, cfg: DictConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        self.config_hash = guard.check_same_config(cfg)  # before anything a rank could disagree on
        self.dp, self.pp = check_config(cfg, self.world_size)
        self.mesh = build_mesh(self.dp, self.pp, device)
        self.pp_rank = self.mesh.pp_rank
        self.dtype = getattr(torch, cfg.train.dtype)
        self.spec: ModelSpec = instantiate(cfg.model)
        self.m = cfg.pipeline.num_microbatches
        self.schedule = build_schedule(
            cfg.schedule.name, self.pp, self.m, cfg.pipeline.stages_per_rank, cfg.pipeline.placement,
            cfg.schedule.path, cfg.pipeline.stage_to_rank,
        )
        self.batches = build_batches(cfg.data, cfg.model)
        sample = split_microbatches(shard(self.batches.train.get(0), 0, self.dp)[0], self.m)[0]
        self.layout = choose_layout(self.spec, self.schedule, cfg.pipeline, sample, device, self.dtype)
        self.ranges = self.layout.ranges
        guard.check_same_program(self.schedule, self.ranges)
        self.stages = build_stages(self.spec, self.ranges, self.schedule.stages_of(self.pp_rank), device, self.dtype)
        configure_stages(self.stages.values(), cfg.train.precision, cfg.pipeline.checkpoint_activations)
        self.scaler = LossScaler(cfg.train.precision == "fp16")
        comm = P2PComm(self.mesh.pp_group, device, cfg.comm.first_step_timeout_s)
        comm.warmup()  # ranks may still be building their stages: the first-step deadline
        comm.timeout_s = cfg.comm.timeout_s
        if not comm.host_blocking:  # CUDA: waits order streams; a thread keeps their deadlines
            comm.watchdog = DeadlineWatchdog(lambda exc: guard.fail(exc, self.rank))
        self.tied = TiedWeights(
            self.spec, self.ranges, self.schedule.stage_to_rank, layers_by_index(self.stages, self.ranges),
            [comm.global_rank(r) for r in range(comm.size)], comm.rank, self.mesh.replicas,
        )
        self.tied.sync_initial_values()
        self.pipeline = Pipeline(self.stages, self.schedule, comm, cfg.comm.dynamic_shapes, cfg.comm.first_step_timeout_s)
        self.pipeline.recvs_ahead = cfg.comm.recvs_ahead
        # auto's choice is made by the whole world (every replica alike, so no replica waits on a
        # slower setting) and within about a quarter of the run, so short runs and sweeps
        # measure the chosen setting for most of their steps
        self.pipeline.tuning_group = None
        self.pipeline.ahead_tuner = AheadTuner(trials=max(1, min(10, (cfg.train.max_steps - 2) // 8)))
        self.faults = install_from_env(self.stages, self.rank)  # PIPEFLOW_FAULT_INJECT (tests)
        self._first_step_done = False
        self._ahead_reported = False  # comm.recvs_ahead=auto's choice, logged once
        self.finite = FiniteCheck(self.stages, self.schedule.num_stages, device) if cfg.train.check_finite else None
        self.params = unique_parameters(st.parameters() for st in self.stages.values())
        self.reducer = GradReducer(self.stages, self.mesh.dp_group, self.dp) if self.dp > 1 else None
        if self.reducer is not None:
            self.pipeline.on_stage_grads_ready = self.reducer.stage_ready
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), weight_decay=cfg.optim.weight_decay
        )
        self.run_dir = self._agree_run_dir()
        per_sample = cfg.data.seq_len if cfg.data.name in TOKEN_DATA else None
        self.metrics = RunMetrics(
            cfg, self.pipeline, comm.rank, self.pp, device, self.run_dir, predicted_bubble(self.layout, self.schedule),
            (cfg.data.batch_size, None if per_sample is None else cfg.data.batch_size * per_sample),
        )
        self.checkpoint_root = os.path.join(self.run_dir, "checkpoints")
        self.history: list[float] = []  # the loss of every step this run trained

    def _agree_run_dir(self) -> str:
        """Rank 0 picks the run directory (`pipeflow.run.run_dir.agree_run_dir`), every rank
        receives it; rank 0 writes the config there."""
        run_dir = agree_run_dir(self.cfg.train.run_dir)
        if self.is_main:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "config.yaml"), "w") as f:
                f.write(OmegaConf.to_yaml(self.cfg, resolve=True))
        return run_dir

    def save_checkpoint(self, step: int) -> str:
        """Write ``<run_dir>/checkpoints/step_<step>`` (collective; see pipeflow.checkpoint)."""
        meta = {"dp": self.dp, "pp": self.pp, "scaler": self.scaler.state_dict()}
        return checkpoint.save(self.checkpoint_root, step, layers_by_index(self.stages, self.ranges), self.optimizer, meta)

    def resume(self) -> int:
        """Load the checkpoint ``train.resume`` names, if any; returns the step to start from."""
        path = checkpoint.resolve(self.cfg.train.resume, self.checkpoint_root)
        if path is None:
            return 0
        meta = checkpoint.load(path, layers_by_index(self.stages, self.ranges), self.optimizer)
        self.scaler.load_state_dict(meta["scaler"])
        if self.is_main:
            log.info("resumed from %s at step %d (saved with dp=%s, pp=%s)", path, meta["step"], meta["dp"], meta["pp"])
        return int(meta["step"])

    def describe(self) -> str:
        """The schedule, its predicted bubble and the partition table (see pipeflow.planning.layout)."""
        return describe_layout(self.layout, self.spec, self.schedule)

    def _local_batch(self, source: Any, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This dp rank's shard of batch `step`; None on ranks without the first or last stage."""
        if 0 not in self.stages and self.schedule.num_stages - 1 not in self.stages:
            return None
        return shard(source.get(step), self.mesh.dp_rank, self.dp)

    def _microbatches(self, batch: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[list[Tensors] | None, list[torch.Tensor] | None]:
        inputs = targets = None
        if batch is None:
            return inputs, targets
        x, y = batch
        if 0 in self.stages:
            xs = x.to(self.device)
            xs = xs.to(self.dtype) if xs.is_floating_point() else xs
            inputs = [(mb,) for mb in split_microbatches(xs, self.m)]
        if self.schedule.num_stages - 1 in self.stages:
            targets = split_microbatches(y.to(self.device), self.m)
        return inputs, targets

    def forward_backward(self, step: int) -> tuple[float, float]:
        """Gradients of batch `step`, reduced over ties and dp, unscaled and clipped, left in
        ``p.grad``; returns (loss, grad norm before clipping), the same on every rank.

        A non-finite norm means an inf/nan gradient somewhere (fp16 overflow).  With
        ``train.check_finite`` the finite flags ride in the grad-norm all-reduce.

        Raises:
            NonFiniteError: ``train.check_finite`` and NaN/Inf the loss scaler does not explain.
        """
        inputs, targets = self._microbatches(self._local_batch(self.batches.train, step))
        for stage in self.stages.values():
            stage.grad_scale = self.scaler.scale
        loss = self.pipeline.run(inputs, targets)
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
        with failures.context(f"training step {step}"):
            loss, norm = self.forward_backward(step)
        overflow = self.scaler.enabled and not math.isfinite(norm)
        scale, at_floor = self.scaler.scale, self.scaler.at_minimum
        if not overflow:
            self.optimizer.step()
        self.scaler.update(overflow)
        if overflow and self.is_main:
            floor = (" - the scale is at its minimum, so a lower one cannot cure this: look for NaN/Inf in the "
                     "model, or use train.precision=bf16 (train.check_finite=true stops here)") if at_floor else ""
            log.warning("step %d: inf/nan gradients (fp16 overflow); step skipped, loss scale %.0f -> %.0f%s",
                        step, scale, self.scaler.scale, floor)
        self.optimizer.zero_grad(set_to_none=True)
        tuner = self.pipeline.ahead_tuner
        if tuner.medians is not None and not self._ahead_reported:
            self._ahead_reported = True
            if self.is_main:
                log.info("comm.recvs_ahead=auto: recvs posted %s (median step %.2f ms a step ahead, %.2f ms at "
                         "their step, slowest rank)", "a step ahead" if tuner.choice else "at their step",
                         *(1e3 * t for t in tuner.medians))
        if not self._first_step_done:  # later collectives get the steady-state deadline
            guard.set_collective_timeout(self.cfg.comm.timeout_s)
            self._first_step_done = True
        return loss, norm

    def evaluate(self) -> float:
        """Mean loss over ``train.eval_batches`` held-out batches (forward only)."""
        total = torch.zeros(1, device=self.device, dtype=torch.float64)
        for k in range(self.cfg.train.eval_batches):
            inputs, targets = self._microbatches(self._local_batch(self.batches.val, k))
            with failures.context("evaluation"):
                loss = self.pipeline.eval(inputs, targets)
            if loss is not None:
                total += loss.double()
        dist.all_reduce(total)  # the last stage of every replica holds its shard's mean loss
        return float(total) / (self.cfg.train.eval_batches * self.dp)

    def fit(self) -> dict[str, Any]:
        """Train for ``train.max_steps`` steps; returns first/last loss, final held-out loss and the
        run's figures (``samples_per_s``, ``tokens_per_s``, ``step_time_s``, ``bubble_measured``,
        ``bubble_predicted``, ``peak_memory_mb``; see ``pipeflow.observability.metrics.RunMetrics.close``)."""
        cfg = self.cfg.train
        if self.is_main:
            log.info(self.describe())
            log.info("run directory: %s", self.run_dir)
            log.info("mesh: dp=%d x pp=%d, precision=%s, activation checkpointing=%s", self.dp, self.pp,
                     self.cfg.train.precision, self.cfg.pipeline.checkpoint_activations)
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
        if self.is_main:
            best = f" (best achievable {self.batches.best_loss:.4f})" if self.batches.best_loss is not None else ""
            log.info("loss %.4f -> %.4f | held-out loss %.4f -> %.4f%s", first_loss, last_loss, first_val, final_val, best)
        return result
