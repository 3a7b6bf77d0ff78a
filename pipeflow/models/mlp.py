"""A small MLP classifier as an ordered list of layers: ``input``, ``hidden.0`` .., ``head``."""
from __future__ import annotations

from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models.losses import classification_loss
from pipeflow.models.materialise import layers_from
from pipeflow.models.spec import LayerSpec, ModelSpec


def _linear_gelu(in_features: int, out_features: int) -> nn.Module:
    """Linear followed by GELU: (B, in) -> (B, out)."""
    return nn.Sequential(nn.Linear(in_features, out_features), nn.GELU())


def build_mlp(
    in_features: int = 32,
    hidden: int = 64,
    num_layers: int = 4,
    num_classes: int = 10,
    seed: int = 0,
    init_from: str | None = None,
) -> ModelSpec:
    """Describe an MLP classifier as num_layers + 2 lazy layers.

    Args:
        in_features: input width.
        hidden: hidden width.
        num_layers: number of hidden blocks (Linear + GELU) between ``input`` and ``head``.
        num_classes: number of classes (logit width).
        seed: the model seed every layer's init derives from.
        init_from: a file or DCP directory of the layers' weights under ``<layer index>.<key>``
            (what ``export`` writes), loaded instead of the seeded init; each rank reads its own.

    Returns:
        A ModelSpec: ``input`` (Linear in->hidden + GELU), ``hidden.k`` (Linear + GELU),
        ``head`` (Linear hidden->classes), with mean cross-entropy loss.

    Raises:
        ConfigError: a size is not positive or num_layers is negative.
    """
    sizes = {"in_features": in_features, "hidden": hidden, "num_classes": num_classes}
    for key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"model.{key}={value} must be >= 1")
    if num_layers < 0:
        raise ConfigError(f"model.num_layers={num_layers} must be >= 0")
    layers = [LayerSpec("input", _linear_gelu, (in_features, hidden))]
    layers += [LayerSpec(f"hidden.{k}", _linear_gelu, (hidden, hidden)) for k in range(num_layers)]
    layers.append(LayerSpec("head", nn.Linear, (hidden, num_classes)))
    return ModelSpec(name="mlp", layers=layers_from(layers, init_from), loss_fn=classification_loss, seed=seed)
