"""Auxiliary losses that a layer adds where it runs, never sent across a stage boundary.

A load-balancing loss of a router in a middle stage belongs to the step's loss, but the stage's
only output is its activations.  As Megatron's ``MoEAuxLossAutoScaler``, the layer attaches the
loss to its activations with :class:`AttachAuxLoss`: the forward returns the activations
unchanged, the backward passes their gradient on and adds d(aux)/d(inputs of aux) times the
micro-batch's weight.  The weight (and the fp16 loss scale) is the one the stage computes the
micro-batch's loss with: the Stage opens :func:`aux_loss_scope` around each training forward,
and a layer reads it with :func:`current_scope` when it attaches its loss (captured then, so
schedules that interleave micro-batches, and recomputation in backward, see the right one).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AuxScope:
    """The micro-batch a training forward runs: its loss weight and the fp16 loss scale."""

    weight: float  # the micro-batch's share of the step's loss (the stage's loss_scale)
    grad_scale: float = 1.0  # what the loss backward starts from is multiplied by (fp16)


_SCOPES: list[AuxScope] = []  # the open scopes, innermost last (a stage runs one forward at a time)


@contextlib.contextmanager
def aux_loss_scope(weight: float, grad_scale: float = 1.0) -> Iterator[AuxScope]:
    """Within the block, layers attach their auxiliary losses weighted by `weight` (and their
    gradients by `weight * grad_scale`) and count their router statistics for the step."""
    scope = AuxScope(float(weight), float(grad_scale))
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.pop()


def current_scope() -> AuxScope | None:
    """The scope of the training forward running now; None outside one (evaluation, shape trials,
    the recomputation of a checkpointed layer in backward)."""
    return _SCOPES[-1] if _SCOPES else None


_TRIALS: list[bool] = []  # open shape trials


@contextlib.contextmanager
def shape_trial() -> Iterator[None]:
    """Within the block a stage runs its layers only to learn the shapes of their outputs (values
    discarded), which ranks may do unevenly (a shape seen before is not tried again): a layer must
    not start a collective there (expert parallelism's all_to_all)."""
    _TRIALS.append(True)
    try:
        yield
    finally:
        _TRIALS.pop()


def in_shape_trial() -> bool:
    """Whether a stage's shape trial runs now (see :func:`shape_trial`)."""
    return bool(_TRIALS)


class AttachAuxLoss(torch.autograd.Function):
    """``y = AttachAuxLoss.apply(x, aux, scale)``: y is x; in backward, x's gradient passes
    unchanged and `aux` (a scalar) receives the gradient `scale`."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor, scale: float) -> Tensor:  # noqa: D102 - autograd's protocol
        ctx.scale, ctx.aux_dtype, ctx.aux_device = scale, aux.dtype, aux.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # noqa: D102 - autograd's protocol
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


def attach_aux_loss(x: Tensor, aux: Tensor) -> Tensor:
    """`x` with `aux`'s gradient attached for backward, weighted by the running micro-batch's
    scope (0 outside one: a recomputation, whose graph autograd discards)."""
    scope = current_scope()
    scale = scope.weight * scope.grad_scale if scope is not None else 0.0
    return AttachAuxLoss.apply(x, aux, scale)
