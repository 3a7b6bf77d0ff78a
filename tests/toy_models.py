"""Test helpers: a toy model whose layers pass a tuple (activation, integer mask), and batches.

Not a test file.  Everything is deterministic from a seed; floating tensors are float64 so the
pipelined and unsplit models can be compared to float64 rounding.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeflow.models import LayerSpec, ModelSpec, build_gpt, build_mlp, derive_seed


class MaskedInput(nn.Module):
    """x (B, dim) float -> (h (B, dim), mask (B, dim) int64 0/1) with mask = (x > 0)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Project x and compute its positivity mask (an integer tensor, no grad)."""
        return F.gelu(self.linear(x)), (x > 0).long()


class MaskedBlock(nn.Module):
    """(h, mask) -> (h + gelu(linear(h)) * mask, mask): the mask passes through untouched."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, h: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Masked residual update."""
        return h + F.gelu(self.linear(h)) * mask, mask


class MaskedHead(nn.Module):
    """(h, mask) -> (B, dim) Tensor: linear(h * mask)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        """Final projection of the masked activation."""
        return self.linear(h * mask)


def mse_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over the micro-batch."""
    return F.mse_loss(output, target)


def build_masked_mlp(dim: int = 16, num_layers: int = 4, seed: int = 0) -> ModelSpec:
    """A model of num_layers + 2 layers (``input``, ``block.0``.., ``head``) passing (h, mask).

    Args:
        dim: width of activations, mask and output.
        num_layers: number of middle ``block.k`` layers.
        seed: model seed.

    Returns:
        A ModelSpec with MSE loss against a (B, dim) target.
    """
    layers = [LayerSpec("input", MaskedInput, (dim,))]
    layers += [LayerSpec(f"block.{k}", MaskedBlock, (dim,)) for k in range(num_layers)]
    layers.append(LayerSpec("head", MaskedHead, (dim,)))
    return ModelSpec(name="masked_mlp", layers=layers, loss_fn=mse_loss, seed=seed)


def random_batch(
    kind: str,
    batch_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    **sizes: Any,
) -> tuple[Tensor, Tensor]:
    """Make (inputs, targets) for a model kind, deterministic from `seed`.

    Args:
        kind: "gpt" (sizes: vocab_size=64, seq_len=16), "mlp" (in_features=32, num_classes=10)
            or "masked_mlp" (dim=16).
        batch_size: B.
        seed: batch seed.
        dtype: dtype of floating tensors.
        sizes: overrides of the sizes above; they must match the model's.

    Returns:
        gpt: (idx (B, T) long, targets (B, T) long); mlp: (x (B, in) float, y (B,) long);
        masked_mlp: (x (B, dim) float, target (B, dim) float).
    """
    gen = torch.Generator().manual_seed(derive_seed("random-batch", kind, seed))
    if kind == "gpt":
        vocab, seq_len = sizes.get("vocab_size", 64), sizes.get("seq_len", 16)
        tokens = torch.randint(vocab, (batch_size, seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    if kind == "mlp":
        in_features, classes = sizes.get("in_features", 32), sizes.get("num_classes", 10)
        x = torch.randn(batch_size, in_features, generator=gen, dtype=dtype)
        return x, torch.randint(classes, (batch_size,), generator=gen)
    if kind == "masked_mlp":
        dim = sizes.get("dim", 16)
        x = torch.randn(batch_size, dim, generator=gen, dtype=dtype)
        return x, torch.randn(batch_size, dim, generator=gen, dtype=dtype)
    raise ValueError(f"unknown kind {kind!r}; use 'gpt', 'mlp' or 'masked_mlp'")


def build_toy(kind: str, seed: int = 0, **sizes: Any) -> ModelSpec:
    """Build the ModelSpec matching `random_batch(kind, ...)` with small default sizes."""
    if kind == "gpt":
        return build_gpt(
            vocab_size=sizes.get("vocab_size", 64), block_size=sizes.get("seq_len", 16),
            n_layer=sizes.get("n_layer", 4), n_head=sizes.get("n_head", 2),
            n_embd=sizes.get("n_embd", 16), seed=seed,
        )
    if kind == "mlp":
        return build_mlp(
            in_features=sizes.get("in_features", 32), hidden=sizes.get("hidden", 16),
            num_layers=sizes.get("num_layers", 4), num_classes=sizes.get("num_classes", 10),
            seed=seed,
        )
    if kind == "masked_mlp":
        dim, num_layers = sizes.get("dim", 16), sizes.get("num_layers", 4)
        return build_masked_mlp(dim=dim, num_layers=num_layers, seed=seed)
    raise ValueError(f"unknown kind {kind!r}; use 'gpt', 'mlp' or 'masked_mlp'")


# ----------------------------------------------------------------- plain nn.Modules for from_module


def mlp_sequential(in_features: int = 32, hidden: int = 16, num_classes: int = 10) -> nn.Sequential:
    """A plain nn.Sequential classifier: children 0..6 (Linear, GELU, ..., Linear)."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, num_classes))


SEQUENTIAL_GROUPS = [["0", "1"], ["2", "3"], ["4", "5"], ["6"]]


class SkipNet(nn.Module):
    """x -> h0 = inp(x) -> b1 -> b2 -> b3 -> out(h3 + h0): h0 skips over three split points."""

    def __init__(self, in_features: int = 32, hidden: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.b1 = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.b2 = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.b3 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes)."""
        h0 = F.gelu(self.inp(x))
        h3 = self.b3(self.b2(self.b1(h0)))
        return self.out(h3 + h0)


SKIP_SPLIT_POINTS = ["b1", "b2", "b3"]


class DataDependent(nn.Module):
    """A forward that branches on a tensor's value: untraceable."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        """b(a(x)), or a(x) when its sum is negative."""
        h = self.a(x)
        if h.sum() > 0:
            return self.b(h)
        return h


class SizeAcross(nn.Module):
    """A forward whose int (x.size(1)) is made before a split point and used after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        """b(a(x)) viewed as (B, 2, width / 2)."""
        width = x.size(1)
        return self.b(self.a(x)).view(-1, 2, width // 2)
