"""Mixed precision (``train.precision=fp32|bf16|fp16``): autocast dtype and the fp16 loss scaler.

Parameters and optimizer state stay in ``train.param_dtype`` (the fp32 master weights); each stage's
forward runs under ``torch.autocast`` in the compute dtype, and what a stage sends to the next
(activations) and back (their gradients) is cast to the compute dtype, so half as many bytes
travel.  fp16 needs a loss scale: the loss sent backward is multiplied by it, gradients are
divided by it before clipping, and a step whose gradients hold an inf or nan anywhere is skipped
on every rank: the check rides in the single all-reduce of the global grad norm (a non-finite
norm on one stage makes the all-reduced norm non-finite everywhere).  The scale never falls
below ``min_scale`` (1, as Megatron-LM's and DeepSpeed's default): an overflow there is not one
a lower scale can cure, and ``train.check_finite`` raises on it (see pipeflow.runtime.finite).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pipeflow.errors import ConfigError

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of `precision` (None for fp32: no autocast).

    Raises:
        ConfigError: unknown precision.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def to_compute_dtype(values: tuple, dtype: torch.dtype | None) -> tuple:
    """`values` with their floating tensors cast to `dtype` (None: unchanged): what a stage
    sends to the next one under mixed precision."""
    if dtype is None:
        return values
    return tuple(v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values)


class LossScaler:
    """Dynamic loss scale for fp16 (the policy of ``torch.amp.GradScaler``).

    The scale doubles after `growth_interval` finite steps in a row and halves at every
    overflow, down to `min_scale`.  Disabled (scale 1, never skips) unless `enabled`.
    """

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        self.enabled = enabled
        self.min_scale = min_scale
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by the scale (no-op when disabled)."""
        if not self.enabled:
            return
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    @property
    def at_minimum(self) -> bool:
        """True when enabled and the scale can fall no further: an overflow now is not the scale's fault."""
        return self.enabled and self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; `found_inf` must be the same on every rank."""
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Scale and growth counter, for checkpoints."""
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.enabled:  # a checkpoint from before the floor may hold a lower scale
            self.scale = max(float(state["scale"]), self.min_scale)
            self._good_steps = int(state["good_steps"])


def checkpoint_every(value: Any) -> int:
    """``pipeline.checkpoint_activations`` as n (0: off, 1: every layer).

    Raises:
        ConfigError: neither a bool nor a non-negative int.
    """
    if isinstance(value, bool) or value is None:
        return int(bool(value))
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return int(value.lower() == "true")
    try:
        every = int(value)
    except (TypeError, ValueError):
        every = -1
    if every < 0:
        raise ConfigError(
            f"pipeline.checkpoint_activations={value!r}: use true, false or a positive int n "
            f"(recompute every n-th layer)"
        )
    return every
