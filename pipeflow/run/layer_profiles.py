"""The planner's per-layer costs: the model's layers profiled at a micro-batch size or two (as a
rank of context-parallel degree cp runs them), and the costs at any size in between, linear
through them.  Shared by ``python -m pipeflow.plan`` and a run that re-plans at start
(:mod:`pipeflow.run.replan`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from pipeflow.data import build_batches
from pipeflow.planning.profile import LayerProfile, profile_layers
from pipeflow.planning.search import CostModel
from pipeflow.run.compile_phase import compile_options
from pipeflow.config.data import typed_data
from pipeflow.runtime.parallel import ring_attention
from pipeflow.runtime.precision import compute_dtype

_SCALED = ("forward_s", "backward_s", "input_grad_s", "weight_grad_s", "activation_bytes", "output_bytes",
           "tp_forward_bytes", "tp_backward_bytes", "ring_forward_bytes", "ring_backward_bytes",
           "ring_forward_hidden_s", "ring_backward_hidden_s")


def interpolate(low: Sequence[LayerProfile], b_low: int, high: Sequence[LayerProfile], b_high: int) -> CostModel:
    """Per-layer costs at any micro-batch size b, linear through the two profiled sizes.

    Times and activation bytes are ``x(b) = x_low + (x_high - x_low) (b - b_low) / (b_high - b_low)``,
    never below 0; with one profiled size (b_low == b_high) they are used as they are.
    """
    def at(b: int) -> list[LayerProfile]:
        if b_high == b_low:
            return list(low)
        t = (b - b_low) / (b_high - b_low)
        return [
            dataclasses.replace(lo, **{k: _lerp(getattr(lo, k), getattr(hi, k), t) for k in _SCALED})
            for lo, hi in zip(low, high)
        ]
    return at


def _lerp(low: float, high: float, t: float) -> Any:
    value = max(0.0, low + (high - low) * t)
    return int(round(value)) if isinstance(low, int) else value


def profile_costs(cfg: DictConfig, sizes: Sequence[int], device: torch.device, cp: int = 1) -> CostModel:
    """Profile the model's layers at the smallest and largest micro-batch size of `sizes`, as a
    rank of context-parallel degree `cp` runs them (its share of each row, attention round a
    loopback ring whose passes the profile logs)."""
    return interpolate(*profile_sizes(cfg, sizes, device, cp))


def profile_sizes(cfg: DictConfig, sizes: Sequence[int], device: torch.device, cp: int = 1
                  ) -> tuple[list[LayerProfile], int, list[LayerProfile], int]:
    """The profiles :func:`profile_costs` interpolates: (at the smallest size, it, at the largest, it)."""

    spec = instantiate(cfg.model)
    sample, target = build_batches(typed_data(cfg.data), cfg.model).train.get(0)
    if cp > 1:
        sample = ring_attention.split_batch(sample, target, 0, cp)[0]
    dtype = getattr(torch, cfg.train.param_dtype)
    b_low, b_high = min(sizes), max(sizes)
    amp = compute_dtype(cfg.train.precision)
    compiled = compile_options(cfg)  # train.compile: the layers' compiled costs
    low = profile_layers(spec, sample[:b_low], device, dtype, cfg.plan.repeats, split_backward=True, autocast_dtype=amp,
                         compiled=compiled, context_parallel=cp)
    high = low if b_high == b_low else profile_layers(
        spec, sample[:b_high], device, dtype, cfg.plan.repeats, split_backward=True, autocast_dtype=amp,
        compiled=compiled, context_parallel=cp)
    return list(low), b_low, list(high), b_high
