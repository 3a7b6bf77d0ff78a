"""A torchvision ResNet as pipeline layers: ``stem``, one layer per residual block, ``head``.

Layers: ``stem`` (conv1, bn1, relu, maxpool), ``layer1.0``, ``layer1.1``, .. ``layer4.{n-1}``
(each a torchvision ``BasicBlock`` or ``Bottleneck``), ``head`` (avgpool, flatten, fc).  Every
layer builds only its own modules, with torchvision's own block classes, downsample construction
and init, so the chain is torchvision's ResNet: its state dict keys are torchvision's
(``conv1.weight`` in the stem, ``weight`` of ``layer1.0.conv1`` in layer ``layer1.0``, ``fc.weight``
in the head; see `split_state_dict` / `merge_state_dicts`).
Shapes: B = batch, C = channels, H x W = image size; the head returns logits (B, num_classes).

BatchNorm under pipelining.  In train mode every BatchNorm normalises with the statistics of the
micro-batch it sees, so a pipelined step equals the unsplit model run micro-batch by micro-batch
(same losses, gradients and running statistics, updated once per micro-batch in order), NOT the
unsplit model run on the whole batch at once: the loss then depends on how the batch is split.
In eval mode (running statistics) the pipelined model equals the unsplit model exactly.  Running
statistics are buffers, not parameters: data-parallel replicas are not synchronised (as with
DDP without SyncBatchNorm), and any extra train-mode forward (recomputation, a profiling pass on
the live modules) updates them again.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from pipeflow.errors import ConfigError
from pipeflow.models.spec import LayerSpec, ModelSpec

# arch -> (block type, blocks per stage), as torchvision.models.resnet18/34/50/101/152 build them.
ARCHS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}
EXPANSION = {"basic": 1, "bottleneck": 4}  # BasicBlock.expansion, Bottleneck.expansion
WIDTHS = (64, 128, 256, 512)  # planes of layer1..layer4
STEM_KEYS = ("conv1", "bn1")  # the stem's torchvision state dict prefixes
HEAD_KEYS = ("fc",)


def _init_like_torchvision(module: nn.Module) -> None:
    """torchvision's ResNet init: kaiming normal (fan_out, relu) convs; BatchNorm 1 and 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


class Stem(nn.Module):
    """conv1, bn1, relu, maxpool: images (B, in_channels, H, W) -> (B, 64, H', W').

    small_input (CIFAR, MNIST): 3x3 stride-1 conv and no max-pool, H' = H.  Otherwise
    torchvision's ImageNet stem: 7x7 stride-2 conv and a 3x3 stride-2 max-pool, H' = H / 4.
    """

    def __init__(self, in_channels: int = 3, small_input: bool = True) -> None:
        super().__init__()
        if small_input:
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        _init_like_torchvision(self)

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> features (B, 64, H', W')."""
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    """avgpool, flatten, fc: features (B, C, h, w) -> logits (B, num_classes).

    fc keeps PyTorch's default Linear init, as torchvision's ResNet does.
    """

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Pool each channel to one value and classify: (B, C, h, w) -> (B, num_classes)."""
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_block(
    kind: str, inplanes: int, planes: int, stride: int = 1, zero_init_residual: bool = False
) -> nn.Module:
    """Build one residual block exactly as torchvision's ``ResNet._make_layer`` does.

    Args:
        kind: "basic" (BasicBlock) or "bottleneck" (Bottleneck).
        inplanes: input channels.
        planes: the block's width; it outputs planes * expansion channels.
        stride: 2 for the first block of layer2..layer4, else 1.
        zero_init_residual: set the last BatchNorm weight of the residual branch to 0.

    Returns:
        The block, initialised like torchvision's ResNet.
    """
    if kind not in EXPANSION:
        raise ConfigError(f"unknown residual block kind {kind!r}; valid: {', '.join(EXPANSION)}")
    # torchvision is imported here, not at module level: importing it costs ~1 s per process.
    from torchvision.models.resnet import BasicBlock, Bottleneck, conv1x1

    block = BasicBlock if kind == "basic" else Bottleneck
    out = planes * block.expansion
    downsample = None
    if stride != 1 or inplanes != out:  # the shortcut must change shape: 1x1 conv + BN
        downsample = nn.Sequential(conv1x1(inplanes, out, stride), nn.BatchNorm2d(out))
    module = block(inplanes, planes, stride, downsample)
    _init_like_torchvision(module)
    if zero_init_residual:
        nn.init.constant_(module.bn3.weight if kind == "bottleneck" else module.bn2.weight, 0)
    return module


def resnet_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy: logits (B, num_classes), targets (B,) long -> scalar."""
    return F.cross_entropy(logits, targets)


def _block_specs(kind: str, counts: Sequence[int], zero_init_residual: bool) -> list[LayerSpec]:
    """One LayerSpec per residual block, named ``layer{k}.{j}`` as in torchvision."""
    expansion = EXPANSION[kind]
    specs, inplanes = [], 64
    for k, (planes, count) in enumerate(zip(WIDTHS, counts), start=1):
        for j in range(count):
            stride = 2 if (k > 1 and j == 0) else 1
            args = (kind, inplanes, planes, stride, zero_init_residual)
            specs.append(LayerSpec(f"layer{k}.{j}", build_block, args))
            inplanes = planes * expansion
    return specs


def build_resnet(
    arch: str = "resnet18",
    num_classes: int = 10,
    small_input: bool = True,
    seed: int = 0,
    in_channels: int = 3,
    zero_init_residual: bool = False,
) -> ModelSpec:
    """Describe a torchvision ResNet as lazy layers: stem, one per residual block, head.

    Args:
        arch: resnet18, resnet34, resnet50, resnet101 or resnet152.
        num_classes: outputs of the head.
        small_input: CIFAR/MNIST stem (3x3 stride-1 conv, no max-pool) for 32x32 or 28x28
            images; False gives torchvision's ImageNet stem (7x7 stride-2 conv, max-pool).
        seed: the model seed every layer's init derives from.
        in_channels: image channels (1 for MNIST).
        zero_init_residual: zero the last BatchNorm weight of each residual branch.

    Returns:
        A ModelSpec of 2 + (number of blocks) layers whose loss is the mean cross entropy;
        resnet18 has 10 layers, resnet50 18.

    Raises:
        ConfigError: unknown arch, or num_classes / in_channels < 1.
    """
    if arch not in ARCHS:
        raise ConfigError(f"unknown model.arch={arch!r}; valid: {', '.join(ARCHS)}")
    if num_classes < 1 or in_channels < 1:
        raise ConfigError(
            f"model.num_classes={num_classes} and model.in_channels={in_channels} must be >= 1"
        )
    kind, counts = ARCHS[arch]
    layers = [LayerSpec("stem", Stem, (in_channels, small_input))]
    layers += _block_specs(kind, counts, zero_init_residual)
    layers.append(LayerSpec("head", Head, (512 * EXPANSION[kind], num_classes)))
    return ModelSpec(name=arch, layers=layers, loss_fn=resnet_loss, seed=seed)


def _fixed_arch(arch: str, given: str) -> str:
    """Return `arch`; raise ConfigError when a config asks for another one."""
    if given != arch:
        raise ConfigError(f"model {arch!r} cannot build model.arch={given!r}; use model=resnet")
    return arch


def build_resnet18(arch: str = "resnet18", **kwargs) -> ModelSpec:
    """`build_resnet` with arch="resnet18" (the registry's "resnet18")."""
    return build_resnet(arch=_fixed_arch("resnet18", arch), **kwargs)


def build_resnet50(arch: str = "resnet50", **kwargs) -> ModelSpec:
    """`build_resnet` with arch="resnet50" (the registry's "resnet50")."""
    return build_resnet(arch=_fixed_arch("resnet50", arch), **kwargs)


def _owner(key: str, names: set[str]) -> tuple[str, str]:
    """The layer owning a torchvision ResNet state-dict key, and the key inside that layer."""
    first = key.split(".", 1)[0]
    if first in STEM_KEYS:
        return "stem", key
    if first in HEAD_KEYS:
        return "head", key
    parts = key.split(".")  # layer1.0.conv1.weight -> layer "layer1.0", key "conv1.weight"
    name = ".".join(parts[:2])
    if name in names:
        return name, ".".join(parts[2:])
    raise KeyError(key)


def split_state_dict(
    state_dict: Mapping[str, Tensor], layer_names: Sequence[str]
) -> dict[str, dict[str, Tensor]]:
    """Split a torchvision ResNet state dict into one state dict per pipeline layer.

    Use it to load torchvision weights into a stage: ``layer.load_state_dict(parts[name])``.
    The keys of the stem and head are unchanged (``conv1.weight``, ``fc.bias``); a block's keys
    lose their ``layer1.0.`` prefix.

    Args:
        state_dict: e.g. ``torchvision.models.resnet18(num_classes=10).state_dict()``.
        layer_names: ``spec.layer_names()``.

    Returns:
        {layer name: its state dict}, for every name in `layer_names`.

    Raises:
        ConfigError: a key belongs to no layer of `layer_names`.
    """
    names = set(layer_names)
    parts: dict[str, dict[str, Tensor]] = {name: {} for name in layer_names}
    for key, value in state_dict.items():
        try:
            owner, inner = _owner(key, names)
        except KeyError:
            raise ConfigError(
                f"state dict key {key!r} belongs to no layer of {sorted(names)}"
            ) from None
        parts[owner][inner] = value
    return parts


def merge_state_dicts(layers: Mapping[str, nn.Module]) -> dict[str, Tensor]:
    """The inverse of `split_state_dict`: {layer name: module} -> one torchvision state dict."""
    merged = {}
    for name, module in layers.items():
        prefix = "" if name in ("stem", "head") else f"{name}."
        merged.update({prefix + k: v for k, v in module.state_dict().items()})
    return merged
