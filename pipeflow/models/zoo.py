"""torchvision classification models, unmodified, split by `from_module` (``model=torchvision``).

A recipe per family says what runs before the blocks, which containers hold the blocks, what runs
after, and the initialisation torchvision's constructor does beyond each module's own
``reset_parameters`` (an init hook, so every layer gets torchvision's init from its own seed):

- ResNet / ResNeXt / Wide ResNet: ``stem`` (conv1, bn1, relu, maxpool), one layer per residual
  block (``layer1.0`` ..), ``head`` (avgpool, flatten, fc);
- ViT: ``stem`` (patch projection, class token, position embedding), one layer per encoder block,
  ``head`` (final norm, class token, heads);
- ConvNeXt: ``stem``, one layer per CNBlock and per downsampling module, ``head``; stochastic
  depth is off unless ``stochastic_depth_prob`` is set (each drop would then be drawn from the
  global RNG of the rank running the block, so pipelined and unsplit runs would differ).

``model=resnet18|resnet50`` (`build_resnet`) are ResNets whose stem may be the small-image one
(3x3 stride-1 conv, no max-pool) for CIFAR and MNIST, layer names ``stem``, ``layer1.0`` ..,
``head``. BatchNorm in train mode normalises with each micro-batch's statistics (as any pipeline
or DDP without SyncBatchNorm); in eval mode the pipelined model equals the unsplit one exactly.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pipeflow.errors import ConfigError
from pipeflow.models.losses import classification_loss
from pipeflow.models.module_spec import from_module
from pipeflow.models.pieces import Adapter
from pipeflow.models.spec import ModelSpec

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
# Refused by name: what makes them something other than one chain of activations.
UNSPLITTABLE = {
    "googlenet": "auxiliary classifiers (aux_logits): in training forward returns two extra outputs from the "
                 "middle of the network, which the loss needs",
    "inception_v3": "an auxiliary classifier (aux_logits): in training forward returns an extra output from the "
                    "middle of the network, which the loss needs",
}


@dataclass(frozen=True)
class Recipe:
    """How from_module splits one family of torchvision models."""

    before: list[str]
    blocks: list[str]
    after: list[str]
    before_fn: Adapter | None = None
    after_fn: Adapter | None = None
    init: Callable[[str, nn.Module], None] | None = None
    tp_plan: dict[str, str] | None = None  # parallel.tp: {glob of module paths: style} (None: no plan)


# ----------------------------------------------------------------- ResNet


def resnet_head(m: nn.Module, x: Tensor) -> Tensor:
    """ResNet after its blocks: pool each channel, flatten, classify."""
    return m.fc(torch.flatten(m.avgpool(x), 1))


def resnet_init(name: str, module: nn.Module, zero_init_residual: bool = False) -> None:
    """torchvision's ResNet init: kaiming normal (fan_out, relu) convolutions (norms are 1 and 0
    by their own reset_parameters, which ran before)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif zero_init_residual and isinstance(module, Bottleneck):
        nn.init.constant_(module.bn3.weight, 0)
    elif zero_init_residual and isinstance(module, BasicBlock):
        nn.init.constant_(module.bn2.weight, 0)


def _resnet(zero_init_residual: bool = False) -> Recipe:
    return Recipe(["conv1", "bn1", "relu", "maxpool"], ["layer1", "layer2", "layer3", "layer4"], ["avgpool", "fc"],
                  after_fn=resnet_head, init=functools.partial(resnet_init, zero_init_residual=zero_init_residual))


# ----------------------------------------------------------------- ViT


def vit_stem(m: nn.Module, x: Tensor) -> Tensor:
    """VisionTransformer before its encoder blocks: patches, class token, position embedding."""
    n = x.shape[0]
    x = m.conv_proj(x)  # (n, hidden, h / p, w / p)
    x = x.reshape(n, x.shape[1], -1).permute(0, 2, 1)  # (n, patches, hidden)
    x = torch.cat([m.class_token.expand(n, -1, -1), x], dim=1)
    return m.encoder.dropout(x + m.encoder.pos_embedding)


def vit_head(m: nn.Module, x: Tensor) -> Tensor:
    """VisionTransformer after its blocks: final norm, the class token's features, the heads."""
    return m.heads(m.encoder.ln(x)[:, 0])


def vit_init(name: str, module: nn.Module) -> None:
    """torchvision's VisionTransformer init beyond each module's own (no representation layer)."""
    from torchvision.models.vision_transformer import MLPBlock

    if name == "conv_proj":
        fan_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        nn.init.trunc_normal_(module.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(module.bias)
    elif name == "encoder" and isinstance(getattr(module, "pos_embedding", None), nn.Parameter):
        nn.init.normal_(module.pos_embedding, std=0.02)  # class_token: zeros, as pieces start
    elif isinstance(module, MLPBlock):
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                nn.init.xavier_uniform_(sub.weight)
                nn.init.normal_(sub.bias, std=1e-6)
    elif name == "heads.head":
        nn.init.zeros_(module.weight)
        nn.init.zeros_(module.bias)


# parallel.tp: each encoder block's MLP column then row (nn.MultiheadAttention checks its whole
# width, so attention stays whole on every tp rank)
VIT = Recipe(["conv_proj", "class_token", "encoder.pos_embedding", "encoder.dropout"], ["encoder.layers"],
             ["encoder.ln", "heads"], before_fn=vit_stem, after_fn=vit_head, init=vit_init,
             tp_plan={"encoder.layers.*.mlp.0": "colwise", "encoder.layers.*.mlp.3": "rowwise"})


# ----------------------------------------------------------------- ConvNeXt


def convnext_init(name: str, module: nn.Module, layer_scale: float = 1e-6) -> None:
    """torchvision's ConvNeXt init: truncated normal (0.02) conv and linear weights, zero biases;
    each CNBlock's layer scale at its constructor's value."""
    from torchvision.models.convnext import CNBlock

    if isinstance(module, (nn.Conv2d, nn.Linear)):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, CNBlock):
        nn.init.constant_(module.layer_scale, layer_scale)


# parallel.tp: each CNBlock's pointwise MLP (Linear 4x, GELU, Linear back) column then row
CONVNEXT = Recipe(["features.0"], [f"features.{k}" for k in range(1, 8)], ["avgpool", "classifier"],
                  init=convnext_init, tp_plan={"features.*.*.block.3": "colwise", "features.*.*.block.5": "rowwise"})


def _recipe(name: str) -> Recipe:
    """The recipe of torchvision model `name`, or a ConfigError naming what cannot be split."""
    if name in UNSPLITTABLE:
        raise ConfigError(f"model.name={name!r} cannot be split into a pipeline: it has {UNSPLITTABLE[name]}; "
                          f"a pipeline stage passes one chain of activations. Build it with aux_logits=False "
                          f"and split it with model=module (split_points) instead")
    if name.startswith(("resnet", "resnext", "wide_resnet")):
        return _resnet()
    if name.startswith("vit_"):
        return VIT
    if name.startswith("convnext_"):
        return CONVNEXT
    raise ConfigError(f"model.name={name!r} has no recipe; model=torchvision splits resnet*, resnext*, "
                      f"wide_resnet*, vit_* and convnext_*; any other module: model=module with before/blocks/after "
                      f"or split_points")


def _constructor(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    import torchvision

    try:
        build = torchvision.models.get_model_builder(name)
    except ValueError:
        raise ConfigError(f"model.name={name!r} is not a torchvision model; torchvision has "
                          f"{', '.join(torchvision.models.list_models(torchvision.models))}") from None
    return functools.partial(build, weights=None, **kwargs)


def build_torchvision(
    name: str = "resnet18",
    num_classes: int = 10,
    image_size: int = 32,
    stochastic_depth_prob: float = 0.0,
    seed: int = 0,
    init_from: str | None = None,
) -> ModelSpec:
    """A torchvision classification model, unmodified, as pipeline layers (see the module docstring).

    Args:
        name: the torchvision builder's name: resnet18, resnet50, vit_b_16, convnext_tiny, ...
        num_classes: outputs of the classifier.
        image_size: the input side in pixels (ViT's position embedding is sized for it).
        stochastic_depth_prob: ConvNeXt's stochastic depth (0: off, so runs are reproducible).
        seed: layer i is initialised from (seed, i), as torchvision's constructor initialises.
        init_from: a state dict of the unsplit model to load instead (e.g. pretrained weights
            saved with ``torch.save(model.state_dict(), path)``).

    Returns:
        A ModelSpec whose loss is the mean cross entropy.

    Raises:
        ConfigError: an unknown name, or a model that is not one chain (auxiliary outputs).
    """
    recipe = _recipe(name)
    kwargs: dict[str, Any] = {"num_classes": num_classes}
    if recipe is VIT:
        kwargs["image_size"] = image_size
    if recipe is CONVNEXT:
        kwargs["stochastic_depth_prob"] = stochastic_depth_prob
    return from_module(_constructor(name, **kwargs), before=recipe.before, blocks=recipe.blocks, after=recipe.after,
                       before_fn=recipe.before_fn, after_fn=recipe.after_fn, init=recipe.init, seed=seed,
                       init_from=init_from, loss_fn=classification_loss, names=("stem", "head"), name=name,
                       tp_plan=recipe.tp_plan)


def _small_resnet(arch: str, num_classes: int, small_input: bool, in_channels: int) -> nn.Module:
    """torchvision's ResNet, its stem changed for small images (CIFAR, MNIST) or other channels."""
    import torchvision

    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if small_input:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def build_resnet(
    arch: str = "resnet18",
    num_classes: int = 10,
    small_input: bool = True,
    seed: int = 0,
    in_channels: int = 3,
    zero_init_residual: bool = False,
    init_from: str | None = None,
) -> ModelSpec:
    """A torchvision ResNet as layers: ``stem``, one per residual block, ``head``.

    Args:
        arch: resnet18, resnet34, resnet50, resnet101 or resnet152.
        num_classes: outputs of the head.
        small_input: CIFAR/MNIST stem (3x3 stride-1 conv, no max-pool) for 32x32 or 28x28
            images; False gives torchvision's ImageNet stem (7x7 stride-2 conv, max-pool).
        seed: the model seed every layer's init derives from.
        in_channels: image channels (1 for MNIST).
        zero_init_residual: zero the last BatchNorm weight of each residual branch.
        init_from: a state dict of the unsplit model (torchvision's keys) to load instead.

    Returns:
        A ModelSpec of 2 + (number of blocks) layers whose loss is the mean cross entropy;
        resnet18 has 10 layers, resnet50 18.

    Raises:
        ConfigError: unknown arch, or num_classes / in_channels < 1.
    """
    if arch not in ARCHS:
        raise ConfigError(f"unknown model.arch={arch!r}; valid: {', '.join(ARCHS)}")
    if num_classes < 1 or in_channels < 1:
        raise ConfigError(f"model.num_classes={num_classes} and model.in_channels={in_channels} must be >= 1")
    recipe = _resnet(zero_init_residual)
    return from_module(functools.partial(_small_resnet, arch, num_classes, small_input, in_channels),
                       before=recipe.before, blocks=recipe.blocks, after=recipe.after, after_fn=recipe.after_fn,
                       init=recipe.init, seed=seed, init_from=init_from, loss_fn=classification_loss,
                       names=("stem", "head"), name=arch)


def _fixed_arch(arch: str, given: str) -> str:
    """Return `arch`; raise ConfigError when a config asks for another one."""
    if given != arch:
        raise ConfigError(f"model {arch!r} cannot build model.arch={given!r}; use model=resnet")
    return arch


def build_resnet18(arch: str = "resnet18", **kwargs: Any) -> ModelSpec:
    """`build_resnet` with arch="resnet18" (``model=resnet18``)."""
    return build_resnet(arch=_fixed_arch("resnet18", arch), **kwargs)


def build_resnet50(arch: str = "resnet50", **kwargs: Any) -> ModelSpec:
    """`build_resnet` with arch="resnet50" (``model=resnet50``)."""
    return build_resnet(arch=_fixed_arch("resnet50", arch), **kwargs)
