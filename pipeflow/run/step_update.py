"""A training step's update after its pipeline ran, in three phases that let the host run ahead:
:meth:`StepUpdate.reduce` (reductions, clip and the figures' packet, queued on the device),
:meth:`StepUpdate.judge` (the packet read back: a non-finite step raises) and
:meth:`StepUpdate.apply` (the optimizer step); with the learning rate schedule and the clip.

The global grad norm, the clip coefficient and the finite check stay on the device (one
all-reduce carries the norm, the loss, per-stage non-finite flags, the preemption flag and rank
0's run-directory-lost flag); with fused AdamW a non-finite step is skipped *on the device*
(its ``found_inf``), so the Trainer may read a step's figures back one step late.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeflow.run.readback import PendingStep, StepValues, packet_on_host
from pipeflow.run.workspace import Workspace
from pipeflow.runtime import finite as nonfinite
from pipeflow.runtime.clip import clip_on_device, grad_norms
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.runtime.parallel.fsdp import local
from pipeflow.runtime.parallel.mesh import GradReducer
from pipeflow.runtime.precision import LossScaler
from pipeflow.runtime.parallel.routing import RoutingSync
from pipeflow.runtime.stage import Stage, Tensors
from pipeflow.runtime.tied import TiedWeights
from pipeflow.schedules import PipelineSchedule

log = logging.getLogger("pipeflow")


def lr_at(step: float, cfg: Any, max_steps: float) -> float:
    """Linear warm-up to optim.lr, then cosine decay to optim.min_lr at the last step (under
    ``train.batch_ramp`` both in full batches trained: fractional)."""
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


# the step packet's preemption slot, summed over the ranks: 1 per rank whose own torchrun agent
# stopped it (a restart: no preemption), this per rank signalled from outside (exact in float64)
EXTERNAL_SIGNAL = float(1 << 20)


@dataclass(frozen=True)
class StepUpdate:
    """What a step's update touches on this rank.

    Attributes:
        device, schedule, stages: this rank's device, the schedule, its stages.
        params, optimizer, grad_clip: what is optimized, how, and ``optim.grad_clip``.
        tied, reducer: tied-weight and data-parallel gradient reduction (reducer None at dp = 1).
        scaler, finite, routing: the fp16 loss scaler, ``train.check_finite``'s check, MoE routers' statistics.
        workspace: the run directory's lock (its loss stops every rank), or None.
        pipelines: pipelines running the same program (dp x tp), each holding its shard's loss.
    """

    device: torch.device
    schedule: PipelineSchedule
    stages: dict[int, Stage]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    grad_clip: float
    tied: TiedWeights
    reducer: GradReducer | None
    scaler: LossScaler
    finite: FiniteCheck | None
    routing: RoutingSync | None
    workspace: Workspace | None
    pipelines: int

    def reduce(self, step: int, lr: float, loss: torch.Tensor | None, preempt: bool,
               from_agent: bool = False) -> PendingStep:
        """Reductions and clipping of step `step` after its pipeline ran (`loss`: this rank's, or
        None), queued on the device; the packet of figures copied towards the host without waiting.
        `preempt`: a ``train.save_on_signal`` signal reached this rank, `from_agent` from its own
        torchrun agent (summed, the slot says whether any rank's came from outside)."""
        zero = torch.zeros(1, device=self.device, dtype=torch.float64)
        own_loss = zero if loss is None else loss.detach().double().reshape(1) / self.pipelines
        flag = zero + ((1.0 if from_agent else EXTERNAL_SIGNAL) if preempt else 0.0)
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
        extra = torch.cat([own_loss, flag, lost, self._stage_squares(with_grad, norms), *checked, *routing])
        norm, reduced = clip_on_device(self.params, self.grad_clip, None, extra, self.tied.duplicates(),
                                       replicas=self.pipelines, norms=norms,
                                       split=self.routing.split if self.routing is not None else None)
        if self.routing is not None:  # the step's summed tokens per expert move the routers' biases, on the device
            self.routing.balance(reduced[-self.routing.size:])
        return packet_on_host(step, lr, torch.cat([norm.reshape(1), reduced]))

    def _stage_squares(self, with_grad: list[torch.nn.Parameter], norms: list[torch.Tensor]) -> torch.Tensor:
        """S sums of squares, this rank's part of each stage's gradient norm (`norms`, taken after the
        dp and tie sums): summed over the world in the step's all-reduce, a non-finite one names a
        stage with NaN/Inf gradients and the others say which stage's norm moved (``train.spike``),
        with no collective of their own (dp replicas count alike in every step: ratios hold)."""
        S = self.schedule.num_stages
        norm_of = {id(p): n for p, n in zip(with_grad, norms)}
        squares = [torch.zeros((), device=self.device, dtype=torch.float64)] * S
        for s, stage in self.stages.items():
            mine = [norm_of[id(p)] for p in stage.parameters() if id(p) in norm_of]
            if mine:
                squares[s] = torch.stack(mine).double().pow(2).sum()
        return torch.stack(squares)

    def judge(self, pending: PendingStep, inputs_of: Callable[[], list[Tensors] | None]) -> StepValues:
        """Read step `pending.step`'s packet back (waiting for its copy only) and judge it: a
        non-finite loss or norm that is not an fp16 overflow raises, naming the stages (or the
        input batch, when `inputs_of()`, this rank's stage-0 inputs of the step, hold NaN/Inf).

        Raises:
            NonFiniteError: NaN/Inf that the loss scaler does not explain.
            RunDirLostError: rank 0's lock watch found the run directory or its lock gone or taken
                (:mod:`pipeflow.checkpoint.lock`); every rank raises it at this step.
        """
        values, routing = pending.values(), None
        if self.routing is not None:  # the packet's tail: the routers' statistics (the loss gains their aux loss)
            values, routing = values[:-self.routing.size], self.routing.figures(values[-self.routing.size:], self.pipelines)
            values[1] += routing.aux
        S = self.schedule.num_stages
        norm, loss, preempt, external = values[0], values[1], values[2] > 0, values[2] >= EXTERNAL_SIGNAL
        if values[3] > 0 and self.workspace is not None:
            raise self.workspace.lost_error(pending.step)
        grad_stages, checked = values[4:4 + S], values[4 + S:]
        # a non-finite step whose input batch holds NaN/Inf is named by its batch, not blamed on optim.lr
        with nonfinite.inputs_blamed(pending.step, inputs_of, self.schedule.num_microbatches, self.device):
            if self.finite is not None:
                self.finite.raise_if_non_finite(checked, pending.step, self.schedule.stage_to_rank, self.scaler)
            loss_finite = math.isfinite(loss)
            # a non-finite norm with a finite loss under fp16 is the loss scaler's overflow to skip
            if not loss_finite or (not math.isfinite(norm) and not self.scaler.enabled):
                stages = [s for s, square in enumerate(grad_stages) if not math.isfinite(square)]
                raise nonfinite.non_finite_step_error(pending.step, loss_finite, stages, self.schedule.stage_to_rank)
        stage_norms = tuple(math.sqrt(v) if math.isfinite(v) and v >= 0 else math.nan for v in grad_stages)
        return StepValues(loss, norm, preempt, overflow=self.scaler.enabled and not math.isfinite(norm), routing=routing,
                          stage_norms=stage_norms,
                          external=external)

    def apply(self, pending: PendingStep, values: StepValues | None, announce: bool) -> None:
        """The optimizer step of `pending` (skipped on an fp16 overflow, which rank 0 logs when `announce`).

        `values` None: the step is not read back yet: fused AdamW is told on the device whether
        the norm was finite (``found_inf``) and skips the update if not.
        """
        if values is None:
            self.optimizer.found_inf = (~torch.isfinite(pending.reduced[0])).float()  # type: ignore[attr-defined]
            self.optimizer.step()
            return
        if hasattr(self.optimizer, "found_inf"):
            del self.optimizer.found_inf  # type: ignore[attr-defined]
        scale, at_floor = self.scaler.scale, self.scaler.at_minimum
        if not values.overflow:
            self.optimizer.step()
        self.scaler.update(values.overflow)
        if values.overflow and announce:
            floor = (" - the scale is at its minimum, so a lower one cannot cure this: look for NaN/Inf in the "
                     "model, or use train.precision=bf16 (train.check_finite=true stops here)") if at_floor else ""
            log.warning("step %d: inf/nan gradients (fp16 overflow); step skipped, loss scale %.0f -> %.0f%s",
                        pending.step, scale, self.scaler.scale, floor)

    @property
    def defers_readback(self) -> bool:
        """True when a step's loss and norm may be read back a step late: the optimizer skips a
        non-finite update on the device (fused AdamW's ``found_inf``) and no fp16 loss scale
        depends on this step's overflow."""
        opt = self.optimizer
        return (isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and bool(opt.defaults.get("fused"))
                and not self.scaler.enabled)
