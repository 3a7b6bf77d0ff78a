"""A user's own model as pipeline stages, selected from the command line without editing pipeflow.

    torchrun --nproc-per-node 2 train.py model=mlp data=gaussian \
        model._target_=examples.custom_model.build_residual_mlp

The one way a config names a model is ``model._target_``, the import path of a builder; there is
no name table to register into. The builder receives the keys of the `model` config group as
keyword arguments (here those of `model=mlp`) and returns a ModelSpec: lazily built layers plus
the loss. Its signature's defaults are the only defaults: for a typed config group of your own,
store ``pipeflow.config.schema.model_schema(build_residual_mlp)`` in Hydra's ConfigStore, or keep a
YAML that sets `_target_` (examples/configs/model/residual_mlp.yaml).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeflow.models import LayerSpec, ModelSpec


class ResidualBlock(nn.Module):
    """x (B, C) -> x + W2 gelu(W1 norm(x)): a pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One residual update."""
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def build_residual_mlp(
    in_features: int = 32, hidden: int = 64, num_layers: int = 4, num_classes: int = 10, seed: int = 0
) -> ModelSpec:
    """Input projection, `num_layers` residual blocks, classifier head; cross-entropy loss."""
    layers = [LayerSpec("input", nn.Linear, (in_features, hidden))]
    layers += [LayerSpec(f"block.{k}", ResidualBlock, (hidden,)) for k in range(num_layers)]
    layers.append(LayerSpec("head", nn.Linear, (hidden, num_classes)))
    return ModelSpec("residual_mlp", layers, loss_fn=F.cross_entropy, seed=seed)
