"""Sleep-stages: layers whose F, B and W each cost a fixed wall time without using the CPU.

They measure what a schedule and the runtime deliver against the simulator's ideal: every
layer sleeps `forward_ms` in forward, `backward_ms` when the gradient of its input is computed
(B) and `weight_ms` when the gradient of its parameter is computed (W); a full backward pays
both. The two gradient paths are separate autograd nodes, so a split backward runs only one.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from pipeflow.models.materialise import layers_from
from pipeflow.models.spec import LayerSpec, ModelSpec


def _sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches `deadline` (the layer's own tensor work counts
    against its budget, so a layer costs its wall time, not that time plus its Python)."""
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class _SleepThrough(torch.autograd.Function):
    """Identity on x that sleeps in forward (until `forward_end`) and in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_end: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_s = backward_s
        out = x.clone()
        _sleep_until(forward_end)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _sleep_until(time.perf_counter() + ctx.backward_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """Returns zeros shaped like `like`; its backward (the weight gradient) sleeps."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, like: torch.Tensor, weight_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.weight_s = weight_s
        ctx.save_for_backward(weight)
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        start = time.perf_counter()
        (weight,) = ctx.saved_tensors
        zero = grad.sum().reshape(1).expand_as(weight) * 0
        _sleep_until(start + ctx.weight_s)  # its tensor work counts against W, as in forward
        return zero, None, None


class SleepLayer(nn.Module):
    """x -> x, costing forward_ms (F), backward_ms (B, input grad) and weight_ms (W, weight grad)."""

    def __init__(self, forward_ms: float, backward_ms: float, weight_ms: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.costs_s = (forward_ms / 1e3, backward_ms / 1e3, weight_ms / 1e3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sleep F, return x (plus a zero that carries the weight's gradient path)."""
        start = time.perf_counter()
        forward_s, backward_s, weight_s = self.costs_s
        zero = _SleepWeight.apply(self.weight, x.detach(), weight_s)
        return _SleepThrough.apply(x, start + forward_s, backward_s) + zero


def build_sleep(
    num_layers: int = 8,
    forward_ms: float = 10.0,
    backward_ms: float = 10.0,
    weight_ms: float = 10.0,
    seed: int = 0,
    init_from: str | None = None,
) -> ModelSpec:
    """A model of `num_layers` sleep layers on (B, width) float inputs; loss = mean square.

    With one layer per stage, stage costs are exactly F = forward_ms, B = backward_ms,
    W = weight_ms (a full backward costs B + W). `init_from`: as for ``build_mlp``.
    """
    layers = [LayerSpec(f"sleep.{k}", SleepLayer, (forward_ms, backward_ms, weight_ms)) for k in range(num_layers)]
    return ModelSpec("sleep", layers_from(layers, init_from), loss_fn=sleep_loss, seed=seed)


def sleep_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean square of the output (the target is ignored: sleep-stages learn nothing)."""
    del target
    return output.pow(2).mean()
