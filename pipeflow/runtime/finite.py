"""Non-finite losses and gradients stop the run, naming the stage.

Always: the Trainer's grad-norm all-reduce (every step) is non-finite exactly when some loss or
gradient is; per-stage flags of non-finite gradient norms ride in the same all-reduce and name the
stages, and :func:`non_finite_step_error` is raised on every rank, before the optimizer step and
any save.  Before a save, :func:`param_flags` (one all-reduce) names stages whose weights are not
finite.

``train.check_finite`` adds :class:`FiniteCheck`: stop at the first non-finite value, naming the
stage where it appeared.

Either error, when stage 0's input batch itself holds NaN or Inf, becomes one naming the batch and
its micro-batches (:func:`inputs_blamed`: one more all-reduce, only on that error path).

Forward outputs (the loss on the last stage, before the fp16 loss scale) and parameter gradients
are checked on the device without a host sync per micro-batch; 2 x S flags summed over the world
once per step tell every rank where NaN or Inf first showed up: the lowest stage whose forward
output was non-finite (forward runs from stage 0 up), else the highest stage whose gradients were
(backward runs down).  The Trainer sends the flags in the all-reduce of the global grad norm that
it runs every step anyway (no collective of their own); :meth:`FiniteCheck.check` runs its own.

With fp16, non-finite gradients alone are a loss-scale overflow, the loss scaler's business: the
step is skipped on every rank and the scale lowered, no error.  What the scaler cannot explain
still raises: a non-finite forward output or loss (the scale only multiplies the backward), and
an overflow while the scale is already at its minimum (a lower scale cannot cure it).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import NonFiniteError
from pipeflow.runtime.parallel.fsdp import local
from pipeflow.runtime.precision import LossScaler


class FiniteCheck:
    """Watches this rank's stages for non-finite forward outputs and gradients.

    Args:
        stages: this rank's stages by index (a forward hook is added to each).
        num_stages: S, stages in the whole pipeline.
        device: where the flags live (the stages' device).
    """

    def __init__(self, stages: dict[int, Any], num_stages: int, device: torch.device) -> None:
        self.stages = stages
        self.num_stages = num_stages
        self.flags = torch.zeros(2 * num_stages, device=device)  # [forward of s..., grads of s...]
        for stage in stages.values():
            stage.forward_hooks.append(self._watch_forward)

    def _watch_forward(self, stage: Any, i: int, outputs: Any) -> Any:
        """A forward hook: flag stage `stage.index` when its outputs hold a NaN or Inf."""
        # the last stage's output is the loss times the fp16 loss scale: judge the loss itself
        watched = (stage.losses[i],) if stage.is_last and i in stage.losses else outputs
        floats = [t.detach() for t in watched if t.is_floating_point()]
        if floats:
            bad = torch.stack([~torch.isfinite(t).all() for t in floats]).any()
            self.flags[stage.index] += bad.to(self.flags.dtype)
        return outputs

    def local_flags(self) -> torch.Tensor:
        """This rank's 2 x S flags for the step (gradients looked at now, after backward), to be
        summed over the world; the next step starts from zeros."""
        S = self.num_stages
        for s, stage in self.stages.items():
            grads = [local(p.grad.detach()) for p in stage.parameters() if p.grad is not None]
            if grads:  # isfinite, not a norm: a norm of large finite values can overflow
                bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any()
                self.flags[S + s] = bad.to(self.flags.dtype)
        flags, self.flags = self.flags, torch.zeros_like(self.flags)
        return flags

    def check(
        self, step: int, stage_to_rank: Sequence[int], group: dist.ProcessGroup | None = None,
        scaler: LossScaler | None = None,
    ) -> None:
        """After a step's forward and backward: one all-reduce of the flags, then
        :meth:`raise_if_non_finite` (the Trainer sends the flags in its grad-norm all-reduce instead).

        Raises:
            NonFiniteError: naming the stage (and rank) where non-finite values first appeared.
        """
        flags = self.local_flags()
        dist.all_reduce(flags, group=group)
        self.raise_if_non_finite(flags.tolist(), step, stage_to_rank, scaler)

    def raise_if_non_finite(
        self, flags: Sequence[float], step: int, stage_to_rank: Sequence[int], scaler: LossScaler | None = None
    ) -> None:
        """Raise on every rank if the world-summed `flags` show NaN or Inf that `scaler` (the fp16
        loss scaler, if any) does not explain: non-finite gradients alone are an overflow it skips,
        unless its scale is already at the minimum.

        Raises:
            NonFiniteError: naming the stage (and rank) where non-finite values first appeared.
        """
        S = self.num_stages
        forward = [s for s in range(S) if flags[s] > 0]
        backward = [s for s in range(S) if flags[S + s] > 0]
        if not forward and not backward:
            return
        overflow = not forward and scaler is not None and scaler.enabled
        if overflow and not scaler.at_minimum:
            return  # the loss scaler skips the step and lowers the scale
        if forward:
            s = forward[0]
            where = f"the forward output of stage {s} (rank {stage_to_rank[s]}){' - the loss' if s == S - 1 else ''}"
        else:
            s = backward[-1]
            where = f"the parameter gradients of stage {s} (rank {stage_to_rank[s]}), in backward"
        if overflow:
            where += (f"; the fp16 loss scale is already at its minimum ({scaler.min_scale:g}), so a lower "
                      f"scale cannot cure this overflow (train.precision=bf16 has fp32's range)")
        raise NonFiniteError(
            f"training step {step}: non-finite values (NaN or Inf) first appeared in {where}; "
            f"stages with non-finite forward outputs: {forward or 'none'}, with non-finite gradients: "
            f"{backward or 'none'}. Check that stage's layers and inputs, lower optim.lr, keep "
            f"optim.grad_clip on, or train in train.param_dtype=float32."
        )


def param_flags(stages: dict[int, Any], num_stages: int, device: torch.device) -> torch.Tensor:
    """S flags, 1 at each of this rank's stages whose parameters hold a NaN or Inf; summed over
    the world they name every such stage."""
    flags = torch.zeros(num_stages, device=device)
    for s, stage in stages.items():
        tensors = [local(p.detach()) for p in stage.parameters()]
        if tensors:
            flags[s] = torch.stack([~torch.isfinite(t).all() for t in tensors]).any().to(flags.dtype)
    return flags


def non_finite_step_error(
    step: int, loss_finite: bool, grad_stages: Sequence[int], stage_to_rank: Sequence[int]
) -> NonFiniteError:
    """The error of a training step whose all-reduced loss or grad norm is NaN/Inf (the check that
    always runs), naming the stages with non-finite gradients."""
    last = len(stage_to_rank) - 1
    parts = [] if loss_finite else [f"the loss (computed on stage {last}, pipeline rank {stage_to_rank[last]})"]
    if grad_stages:
        named = ", ".join(f"stage {s} (pipeline rank {stage_to_rank[s]})" for s in grad_stages)
        parts.append(f"the parameter gradients of {named}")
    where = " and ".join(parts) or "the gradient norm"
    return NonFiniteError(
        f"training step {step}: {where} hold NaN or Inf, so the run stops here on every rank before the "
        f"optimizer step and before any save: the last checkpoint is from before this step. Lower optim.lr, "
        f"keep optim.grad_clip on, train in train.param_dtype=float32, or set train.check_finite=true to name the "
        f"stage whose forward output first went non-finite."
    )


# ------------------------------------------------------------------ a non-finite input batch
def input_counts(inputs: Sequence[Sequence[torch.Tensor]] | None, num_microbatches: int,
                 device: torch.device) -> torch.Tensor:
    """``[m, 2]``: NaN and Inf elements of each micro-batch of this rank's stage-0 inputs (zeros
    on a rank without stage 0, or for integer inputs such as token ids)."""
    counts = torch.zeros(num_microbatches, 2, dtype=torch.float64, device=device)
    for i, tensors in enumerate(inputs or []):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t = local(t.detach())
                counts[i, 0] += torch.isnan(t).sum().to(device, torch.float64)
                counts[i, 1] += torch.isinf(t).sum().to(device, torch.float64)
    return counts


def non_finite_input_error(step: int, counts: Sequence[Sequence[Sequence[float]]]) -> NonFiniteError | None:
    """The error naming the micro-batches of batch `step` whose stage-0 inputs hold NaN or Inf,
    from `counts` ``[global rank][micro-batch][NaN, Inf]`` summed over the world; None if none do."""
    named = []
    for rank, per_mb in enumerate(counts):
        bad = [(i, int(nan), int(inf)) for i, (nan, inf) in enumerate(per_mb) if nan or inf]
        if bad:
            listed = ", ".join(f"{i} ({_elements(nan, inf)})" for i, nan, inf in bad)
            named.append(f"micro-batch{'es' if len(bad) > 1 else ''} {listed} of stage 0's input on global rank {rank}")
    if not named:
        return None
    return NonFiniteError(
        f"training step {step}: the input batch holds NaN or Inf: {'; '.join(named)} (batch {step} of the "
        f"training data), so the loss and gradients computed from it are non-finite too; the learning rate is "
        f"not the cause. Clean or drop those rows in the data (or the code that makes batch {step}); the run "
        f"stops before the optimizer step and before any save, so the last checkpoint is from before this step."
    )


def _elements(nan: int, inf: int) -> str:
    parts = ([f"{nan} NaN"] if nan else []) + ([f"{inf} Inf"] if inf else [])
    return " and ".join(parts)


@contextmanager
def inputs_blamed(
    step: int, inputs_of: Callable[[], Sequence[Sequence[torch.Tensor]] | None], num_microbatches: int,
    device: torch.device, group: dist.ProcessGroup | None = None,
) -> Iterator[None]:
    """Turn a :class:`NonFiniteError` of training step `step` raised inside the block into one
    naming the input batch, when stage 0's inputs of batch `step` hold NaN or Inf.

    Only on the error path, which every rank takes for the same step (the judged figures are
    all-reduced): `inputs_of()` gives this rank's stage-0 micro-batch inputs of batch `step`
    again (None off stage 0), and one all-reduce over `group` (the world) of NaN/Inf counts
    tells every rank which micro-batches, on which rank.  A steady step costs nothing.

    Raises:
        NonFiniteError: the input batch's error, or the block's own when every input was finite.
    """
    try:
        yield
    except NonFiniteError:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        counts = torch.zeros(world, num_microbatches, 2, dtype=torch.float64, device=device)
        counts[rank] = input_counts(inputs_of(), num_microbatches, device)
        if world > 1:
            dist.all_reduce(counts, group=group)
        error = non_finite_input_error(step, counts.tolist())
        if error is None:
            raise
        raise error from None  # the loss and gradients only followed the input: no blame on optim.lr
