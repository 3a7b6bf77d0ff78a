"""Models as ordered lists of lazily built layers, seeded so every rank builds the same weights.

A model is a `ModelSpec`: a name, an ordered list of `LayerSpec`s and a loss.  Nothing is built
until a rank asks for its own layers with `ModelSpec.build_layers`, so a big model never exists
whole on one rank.  Layer i is always built from the same seed, derived from (model seed, i), so
the pipelined model is exactly the unsplit one.

Layer calling convention (see `run_layers`): a layer returns a Tensor or a tuple of Tensors; a
tuple is unpacked as the positional arguments of the next layer, a Tensor is its single argument.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from pipeflow.errors import ConfigError

LossFn = Callable[[Any, Tensor], Tensor]
IGNORE_INDEX = -100  # F.cross_entropy's default: a target equal to it is not counted by the loss


def counted_targets(targets: Any, ignore_index: int | None = IGNORE_INDEX) -> int:
    """The targets a mean loss counts: integer targets other than `ignore_index` (every one when
    it is None), every element of floating ones (regression), of each tensor of a list or tuple.

    Counted on the host: call it on the CPU batch, before it moves to the device (a count of a
    device tensor would make the host wait for the device)."""
    if isinstance(targets, list | tuple):
        return sum(counted_targets(t, ignore_index) for t in targets)
    if ignore_index is None or targets.is_floating_point() or targets.dtype == torch.bool:
        return targets.numel()
    if targets.device.type == "cpu":  # host data counted as such: no tensor op, nothing a device could wait for
        return int(np.count_nonzero(targets.numpy() != ignore_index))
    return int((targets != ignore_index).sum())

# How a tensor-parallel plan (ModelSpec.tp_plan) splits a submodule over the tp ranks of a stage
# (pipeflow/runtime/parallel/tensor_parallel.py turns them into torch's DTensor parallel styles):
TP_STYLES = {
    "colwise": "a Linear's output features split (its weight's rows); the input whole",
    "colwise_qkv": "a Linear whose output is [q; k; v] stacked: each third's rows split alike, so a rank "
                   "holds the q, k and v of the same heads",
    "rowwise": "a Linear's input features split (its weight's columns); the partial outputs summed",
    "colwise_out": "a Linear's output features split and gathered again (an output head: whole logits)",
    "embedding": "an Embedding's rows (the vocabulary) split; the looked-up rows summed",
    "norm": "with parallel.sequence_parallel, a norm (or dropout) run on the rank's slice of the sequence",
    "norm_gathered": "with parallel.sequence_parallel, a norm run on the rank's slice, its output gathered whole "
                     "(for modules after it that read the sequence's length off their input: Hugging Face's attention)",
    "colwise_whole": "as colwise, its input whole even with sequence parallelism (after a norm_gathered)",
    "sequence_out": "with parallel.sequence_parallel, the layer's (whole) output cut to the rank's slice of "
                    "the sequence",
}


def derive_seed(*parts: int | str) -> int:
    """Mix integers (and string tags) into one 63-bit seed, the same in every process and run.

    Args:
        parts: what to mix, e.g. (model seed, layer index) or ("markov", data seed, step).

    Returns:
        A non-negative seed suitable for `torch.Generator.manual_seed`.
    """
    key = repr(tuple(p if isinstance(p, str) else int(p) for p in parts)).encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class LayerSpec:
    """A layer described but not built: `builder(*args, **kwargs)` is called only by `build()`."""

    name: str
    builder: Callable[..., nn.Module]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def build(self) -> nn.Module:
        """Build the layer now.

        Returns:
            The module returned by the builder.

        Raises:
            ConfigError: the builder returned something that is not an `nn.Module`.
        """
        module = self.builder(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"layer {self.name!r}: builder {self.builder!r} returned "
                f"{type(module).__name__}, expected an nn.Module"
            )
        return module


@dataclass
class ModelSpec:
    """An ordered list of lazy layers plus the loss on the last layer's output.

    Attributes:
        name: the model's name (for logs).
        layers: the layers in forward order; names must be unique.
        loss_fn: (output of the last layer, targets) -> scalar loss, the MEAN over the micro-batch.
        seed: layer i is built under a CPU RNG seeded from (seed, i).
        tied: parameters shared by several layers, declared once: ``{tie name: [(layer name,
            parameter path), ...]}``, e.g. GPT's ``{"wte": [("embedding", "wte.weight"),
            ("head", "lm_head.weight")]}``. The first entry's initial value is used everywhere.
        export_name: ``export_name(layer index, key in that layer's state dict)`` -> the name the
            parameter has in the model's own format (a Hugging Face model's ``model.layers.3.
            mlp.up_proj.weight``), for exporting a checkpoint that its library loads; None: the
            model has no such names.
        save_config: ``save_config(directory)`` writes the model's own config there (a Hugging
            Face ``config.save_pretrained``), beside an exported checkpoint; None: none to write.
        compile_unit: ``compile_unit(layer index, built layer)`` -> the module ``train.compile``
            compiles for that layer (a submodule whose forward Dynamo can capture whole, the rest
            of the layer staying eager); None: the layer itself.
        tp_plan: how ``parallel.tp`` splits each layer: ``tp_plan(layer index, built layer, tp)``
            -> ``{submodule path: style}`` (styles: :data:`TP_STYLES`; "" is the layer itself;
            raising ConfigError for sizes tp does not divide), or a dict ``{glob pattern of
            submodule paths: style}`` applied to every layer; None: the model cannot run with tp.
        ignore_index: the target value the loss ignores (cross entropy's -100, the default); a
            micro-batch weighs by the targets it counts, so masked prompts and padding weigh
            nothing; None: every target counts.
        count_fn: ``count_fn(targets) -> int``, the number of targets the loss averages over, for
            a loss that counts otherwise (a mask of its own); None: ``ignore_index`` decides.
        lora: ``model.lora`` (:class:`~pipeflow.models.lora.LoraSettings`): each layer is built with
            peft's LoRA layers around its targeted modules, everything else frozen; None: no LoRA.
        routed_experts: the routed experts of each MoE layer, for a model whose config is not
            pipeflow's ``model.moe`` (a Hugging Face MoE family); 0: as ``model.moe`` says.
        as_stored: ``as_stored({export name: tensor})`` -> the tensors as the model's library
            stores them on disk (a Hugging Face MoE's per-expert tensors), for ``export --format
            hf``; None: as exported.
    """

    name: str
    layers: list[LayerSpec]
    loss_fn: LossFn
    seed: int = 0
    tied: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    export_name: Callable[[int, str], str] | None = None
    save_config: Callable[[str], None] | None = None
    compile_unit: Callable[[int, nn.Module], nn.Module] | None = None
    tp_plan: Callable[[int, nn.Module, int], dict[str, str]] | dict[str, str] | None = None
    ignore_index: int | None = IGNORE_INDEX
    count_fn: Callable[[Any], int] | None = None
    lora: Any = None
    routed_experts: int = 0
    as_stored: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def loss_count(self, targets: Any) -> int:
        """How many of `targets` the loss averages over: what weighs a micro-batch's mean loss in
        the batch's (``count_fn`` when given; else :func:`counted_targets` with ``ignore_index``)."""
        if self.count_fn is not None:
            return int(self.count_fn(targets))
        return counted_targets(targets, self.ignore_index)

    def tensor_plan(self, index: int, layer: nn.Module, tp: int) -> dict[str, str]:
        """Layer `index`'s tensor-parallel plan for `tp` ranks (see ``tp_plan``): {submodule path: style}.

        Raises:
            ConfigError: the model has no plan, a style is unknown, or (from the model's plan) a
                size that tp does not divide.
        """
        if self.tp_plan is None:
            raise ConfigError(f"model {self.name!r} has no tensor-parallel plan, so parallel.tp={tp} cannot split its "
                              f"layers: give its ModelSpec a tp_plan (from_module: tp_plan={{'<glob of module paths>': "
                              f"'colwise' | 'rowwise' | ...}}), or set parallel.tp=1")
        if callable(self.tp_plan):
            plan = dict(self.tp_plan(index, layer, tp))
        else:
            import fnmatch

            plan = {path: style for path, _ in layer.named_modules() for pattern, style in self.tp_plan.items()
                    if fnmatch.fnmatchcase(path, pattern)}
        unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
        if unknown:
            raise ConfigError(f"model {self.name!r}, layer {self.layers[index].name!r}: tensor-parallel style(s) "
                              f"{unknown} unknown; valid: {', '.join(TP_STYLES)}")
        return plan

    def unit_to_compile(self, index: int, layer: nn.Module) -> nn.Module:
        """What ``train.compile`` compiles of layer `index` (built as `layer`): see ``compile_unit``."""
        return layer if self.compile_unit is None else self.compile_unit(index, layer)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError(f"model {self.name!r} has no layers")
        names = self.layer_names()
        duplicates = sorted(n for n, count in collections.Counter(names).items() if count > 1)  # linear: 1e5 layers
        if duplicates:
            raise ConfigError(f"model {self.name!r}: duplicate layer names {duplicates}")
        known = set(names)
        for tie, members in self.tied.items():
            unknown = [layer for layer, _ in members if layer not in known]
            if unknown or len(members) < 2:
                raise ConfigError(
                    f"model {self.name!r}: tied parameter {tie!r} needs two or more members among "
                    f"the layers {names}; got {members}"
                )

    def __len__(self) -> int:
        return len(self.layers)

    def layer_names(self) -> list[str]:
        """Return the layer names in forward order."""
        return [layer.name for layer in self.layers]

    def build_layers(
        self,
        indices: Sequence[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> list[nn.Module]:
        """Build only the layers at `indices`, each with the weights it has in the whole model.

        Layer i is built in float32 on the CPU under a CPU RNG seeded from (seed, i) inside
        `torch.random.fork_rng(devices=[])`, so the global RNG is untouched and any process that
        builds layer i gets identical weights.  It is then moved with `.to(device, dtype)`
        (`dtype` applies to floating parameters and buffers only).

        Args:
            indices: layer indices, in the order the modules should be returned.
            device: where to move the built layers (default: stay on the CPU).
            dtype: floating dtype to cast to (default: stay float32).

        Returns:
            The built modules, one per index.

        Raises:
            ConfigError: an index is out of range.
        """
        for i in indices:
            if not 0 <= i < len(self.layers):
                raise ConfigError(
                    f"model {self.name!r} has {len(self.layers)} layers "
                    f"(indices 0..{len(self.layers) - 1}); cannot build layer {i}"
                )
        return [self._build_one(i).to(device=device, dtype=dtype) for i in indices]

    def build_all(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> list[nn.Module]:
        """Build every layer (the unsplit reference model); see `build_layers`."""
        return self.build_layers(range(len(self.layers)), device=device, dtype=dtype)

    def _build_one(self, index: int) -> nn.Module:
        """Build layer `index` in float32 on the CPU from its own seed; global state untouched."""
        old_dtype = torch.get_default_dtype()
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            # Seed only the CPU generator: torch.manual_seed would also reseed CUDA generators,
            # which fork_rng(devices=[]) does not restore.
            torch.default_generator.manual_seed(derive_seed(self.seed, index))
            torch.set_default_dtype(torch.float32)
            try:
                layer = self.layers[index].build()
                if self.lora is not None:  # the adapters drawn under the layer's seed too
                    from pipeflow.models.lora import inject

                    layer = inject(self.lora, layer)
                return layer
            finally:
                torch.set_default_dtype(old_dtype)


def run_layers(layers: Sequence[nn.Module], inputs: Any) -> Any:
    """Chain `layers` on `inputs` following the layer calling convention.

    A tuple (from the input or a layer) is unpacked as the next layer's positional arguments;
    anything else is passed as its single argument.

    Args:
        layers: modules in forward order.
        inputs: the first layer's input: a Tensor or a tuple of Tensors.

    Returns:
        The last layer's output (the inputs unchanged when `layers` is empty).
    """
    out = inputs
    for layer in layers:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    return out
