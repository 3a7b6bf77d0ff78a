"""Dropout keyed by sample and layer, never by rank: the same masks under any layout.

``train.dropout_rng=sample`` (the default): each dropout module of layer ``l`` draws element
``e`` of sample ``r`` (the sample's row in the global batch) of step ``s`` from a hash of
``(seed, s, l, the module's place in the layer, r, e)``: a counter-based draw (splitmix64's
mixer on int64 tensors) that depends on nothing a layout changes — not the rank, not how the
batch is split into replicas and micro-batches, not which stage holds the layer, not the device
(integer arithmetic is exact on CPU and GPU alike), not recomputation (the same keys give the
same mask).  So a run with dropout gives the losses of the unsplit model, and a run re-planned
onto another layout (``parallel.replan``) those of the run it continues.  ``rank`` keeps torch's
own generator on each rank (faster for large activations on GPU; masks then follow the layout).

A stage runs each layer of a training micro-batch through :func:`run_keyed` (the checkpointed
call itself, so a recomputation in backward draws the same masks); outside it (profiling,
warm-up) a keyed module falls back to torch's dropout.  Dim 0 of a dropout's input is the
sample; under ``parallel.cp`` a rank's elements are those of its chunks (masks then follow cp).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models.spec import derive_seed

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: the Weyl step between counters
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB
LIST_ROWS = 1 << 32  # a batch given as micro-batches: micro-batch j's rows are keyed j * LIST_ROWS + row


@dataclass(frozen=True)
class SampleKeys:
    """One training step's keys: the run's seed and step, and each micro-batch's first global row."""

    seed: int
    step: int
    first_rows: Sequence[int]


    def of(self, microbatch: int) -> tuple[int, int]:
        """Micro-batch `microbatch`'s keys: (the step's key, its first global row)."""
        return derive_seed(self.seed, "dropout", self.step), self.first_rows[microbatch]


_local = threading.local()  # per thread: the pipeline's paired F and B, and autograd's recomputation, run on others


def _scopes() -> list[tuple[int, int]]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


def run_keyed(keys: tuple[int, int], layer: Callable[..., Any], *args: Any) -> Any:
    """`layer` on `args` with its keyed dropout drawn from `keys` (:meth:`SampleKeys.of`); the
    stage checkpoints this call, so a recomputation (on any thread) draws the same masks."""
    scopes = _scopes()
    scopes.append(keys)
    try:
        return layer(*args)
    finally:
        scopes.pop()


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: int64 in, well-mixed int64 out (products wrap modulo 2**64)."""
    x = (x ^ _shift(x, 30)) * _MUL1
    x = (x ^ _shift(x, 27)) * _MUL2
    return x ^ _shift(x, 31)


def keep_mask(shape: Sequence[int], p: float, key: int, first_row: int, device: torch.device,
              heads: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The bool mask that keeps each element with probability 1 - `p`: element e of row r drawn
    from ``(key, first_row + r, e)``.  `heads` = (dim, first, whole): the tensor holds a slice of
    dim `dim` starting at `first` of a whole of size `whole` (a tensor-parallel rank's heads), so
    elements are numbered as in the whole tensor."""
    rows, per_row = shape[0], 1
    for size in shape[1:]:
        per_row *= size
    row_keys = _mix(torch.arange(first_row, first_row + rows, dtype=torch.int64, device=device) * _GOLDEN + key)
    element = torch.arange(per_row, dtype=torch.int64, device=device)
    if heads is not None:
        dim, first, whole = heads
        inner = 1
        for size in shape[dim + 1:]:
            inner *= size
        local, outer = shape[dim], per_row // (shape[dim] * inner)
        index = element.view(outer, local, inner)
        element = (index // (local * inner) * whole + first) * inner + index % (local * inner)
        element = element.reshape(-1)
    draws = _mix(row_keys[:, None] + element[None, :] * _GOLDEN)
    uniform = _shift(draws, 40).to(torch.float32) * 2.0 ** -24  # the top 24 bits: exact in float32
    return (uniform >= p).view(*shape)


class _Masked(torch.autograd.Function):
    """x * keep / (1 - p), the bool mask saved for backward (as torch's dropout saves its own)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


def keyed_dropout(x: torch.Tensor, p: float, site: int, heads: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Dropout of `x` keyed by the current :func:`sample_scope` and `site` (a module's key), or
    torch's dropout outside a scope."""
    scopes = _scopes()
    if not scopes:
        return nn.functional.dropout(x, p, training=True)
    if p >= 1.0:
        return x * 0.0
    step_key, first_row = scopes[-1]
    keep = keep_mask(x.shape, p, step_key ^ site, first_row, x.device, heads)
    return _Masked.apply(x, keep, 1.0 / (1.0 - p))


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` whose masks are keyed by sample, layer and place (see the module doc).

    A layer that drops attention weights through such a module (``keyed`` is true) computes the
    weights explicitly and passes `heads` (dim, first head, all heads) so a tensor-parallel
    rank's heads draw the whole model's masks (the built-in GPT does)."""

    keyed = True

    def __init__(self, p: float, site: int) -> None:
        super().__init__(p)
        self.site = site

    def forward(self, x: torch.Tensor, heads: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Drop elements of `x` (training), or pass it through."""
        if not self.training or self.p == 0.0:
            return x
        return keyed_dropout(x, self.p, self.site, heads)


def key_dropout(layer: nn.Module, index: int, where: str) -> int:
    """Replace every ``nn.Dropout`` inside `layer` (layer `index` of the model) by a
    :class:`KeyedDropout` keyed by (index, its place in the layer); returns how many.

    Raises:
        ConfigError: attention dropout drawn inside a kernel (a Hugging Face attention's
            ``attention_dropout``), which no key reaches.
    """
    keyed = 0
    for name, module in list(layer.named_modules()):
        inside = float(getattr(module, "attention_dropout", 0.0) or 0.0)
        if inside > 0.0 and module.training:
            raise ConfigError(
                f"{where}: layer {index}'s {name or 'module'} drops attention weights inside its attention kernel "
                f"(attention_dropout={inside}), which train.dropout_rng=sample cannot key by sample: set the model's "
                "attention_dropout to 0, or train.dropout_rng=rank (each rank's own generator: masks then follow the "
                "layout)")
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout and child.p > 0.0:
                place = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, KeyedDropout(child.p, derive_seed("dropout-site", index, place)))
                keyed += 1
    return keyed
