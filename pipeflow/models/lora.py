"""LoRA (``model.lora``): ``peft``'s LoRA layers injected into each layer's own modules, base frozen.

``model.lora.rank`` (0 or absent: no LoRA), ``alpha``, ``dropout`` and ``targets`` (module-name
globs: a glob without a dot matches a module's own name, ``q_proj``; one with a dot the module's
whole path in the model, ``model.layers.1*.self_attn.q_proj``). Each built layer gets
``peft.inject_adapter_in_model`` with the ``LoraConfig`` these settings make, restricted to the
``nn.Linear`` modules of that layer the targets match: peft wraps each in its own
``lora.Linear`` (the base weight under ``<path>.base_layer.weight``, the adapters under
``<path>.lora_A.default.weight`` and ``lora_B``) and freezes every other parameter of the layer;
a layer that no target matches is frozen whole. The adapters are initialised as peft does
(A Kaiming-uniform, B zero) under the layer's own seed (:meth:`ModelSpec._build_one`), so every
rank builds the same ones.

The exported ``adapter_config.json`` holds the same targets (plain names as peft's list, which it
matches against module names; globs as one regular expression, :attr:`LoraSettings.pattern`), so
``peft.PeftModel.from_pretrained`` adapts the same modules of the whole model. Out of scope, named errors (:class:`~pipeflow.errors.LoraError`): LoRA on
embeddings or the output head, QLoRA (quantised base weights). With ``parallel.tp`` each adapter
splits with the Linear it wraps (pipeflow/runtime/parallel/tensor_parallel_lora.py). ``peft`` is imported
only when a layer is adapted.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

import torch
from torch import nn

from pipeflow.errors import LoraError

KEYS = ("rank", "alpha", "dropout", "targets")
ADAPTER = "default"  # peft's adapter name inside a layer's state dict (``lora_A.default.weight``)


@dataclass(frozen=True)
class LoraSettings:
    """``model.lora``, checked: rank r > 0, alpha (the update is scaled by alpha / r), dropout on
    the adapters' input, targets (module-name globs)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    # the whole model's fused expert weights (3-D parameters, not Linear modules) the targets name,
    # adapted through peft's target_parameters (filled by check_targets)
    parameters: tuple[str, ...] = ()

    @property
    def pattern(self) -> str:
        """The targets as one regular expression over module paths (peft's ``target_modules`` string
        form, matched with ``re.fullmatch``): ``(?:.*\\.)?`` before a glob without a dot."""
        parts = [("" if "." in glob else r"(?:.*\.)?") + fnmatch.translate(glob) for glob in self.targets]
        return "|".join(f"(?:{part})" for part in parts)

    def matches(self, path: str) -> bool:
        """Whether the module at `path` is a target."""
        return re.fullmatch(self.pattern, path) is not None

    def peft_config(self, target_modules: Any = None, **extra: Any) -> Any:
        """peft's ``LoraConfig`` of these settings, for `target_modules` (default: the targets, as a
        list where they are plain module names, else as :attr:`pattern`)."""
        from peft import LoraConfig

        if target_modules is None:  # plain names as peft's own list (it matches module names), globs as the pattern
            plain = not any(c in glob for glob in self.targets for c in ".*?[")
            target_modules = list(self.targets) if plain else self.pattern
        if self.parameters and "target_parameters" not in extra:
            extra["target_parameters"] = list(self.parameters)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=target_modules, **extra)


@dataclass
class LoraConfig:
    """``model.lora`` as the model schemas default it: rank 0 is no LoRA; alpha scales the
    update by alpha / rank; targets are module-name globs (``q_proj``, or a dotted path glob such
    as ``model.layers.1*.mlp.*``)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


def lora_settings(value: Any) -> LoraSettings | None:
    """``model.lora`` as settings; None for absent or rank 0 (no LoRA).

    Raises:
        LoraError: an unknown key, a negative rank, alpha <= 0, dropout outside [0, 1), or
            targets that are not a non-empty list of names.
    """
    if value is None:
        return None
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if not isinstance(value, Mapping):
        raise LoraError(f"model.lora must be a mapping with keys {list(KEYS)}; got {value!r}")
    unknown = sorted(set(map(str, value)) - set(KEYS) - {"quantize", "load_in_4bit"})
    if unknown:
        raise LoraError(f"model.lora has no key(s) {unknown}; its keys are {list(KEYS)}")
    if value.get("quantize") or value.get("load_in_4bit"):
        raise LoraError("QLoRA (LoRA over quantised base weights) is out of scope: model.lora trains adapters over "
                        "the base weights in train.param_dtype; remove model.lora.quantize / load_in_4bit")
    rank = int(value.get("rank") or 0)
    if rank < 0:
        raise LoraError(f"model.lora.rank={rank} must be >= 0 (0: no LoRA)")
    if rank == 0:
        return None
    alpha = float(value.get("alpha", 16.0))
    dropout = float(value.get("dropout", 0.0))
    targets = value.get("targets", LoraSettings.targets)
    if isinstance(targets, str):
        targets = [targets]
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise LoraError(f"model.lora.targets={targets!r} must be a non-empty list of module-name globs, e.g. "
                        f"[q_proj,v_proj]")
    if alpha <= 0 or not 0.0 <= dropout < 1.0:
        raise LoraError(f"model.lora: alpha={alpha} must be > 0 and dropout={dropout} in [0, 1)")
    return LoraSettings(rank, alpha, dropout, tuple(targets))


def check_targets(settings: LoraSettings, modules: Iterable[tuple[str, nn.Module]],
                  out_of_scope: Mapping[str, str]) -> LoraSettings:
    """`settings` with the fused expert weights its targets name (:attr:`LoraSettings.parameters`),
    checked against the whole model's `modules` (on meta).

    Args:
        settings: the LoRA settings.
        modules: ``(path, module)`` of the whole model (a meta skeleton's ``named_modules()``, or
            :func:`layer_modules`: nothing is materialised).
        out_of_scope: ``{module path: what it is}`` LoRA must not adapt (the output head).

    Raises:
        LoraError: the targets match no Linear module nor fused expert weight, or match an
            embedding or `out_of_scope`.
    """
    chosen, refused, linear, fused = [], [], set(), []
    for path, module in modules:
        if isinstance(module, nn.Linear):
            linear.add(path.rpartition(".")[2])
        elif not isinstance(module, nn.Embedding):
            fused += fused_weights(settings, path, module)
        if not path or not settings.matches(path) or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if isinstance(module, nn.Embedding) or path in out_of_scope:
            refused.append(f"{path} ({out_of_scope.get(path, 'an embedding')})")
        else:
            chosen.append(path)
    if refused:
        raise LoraError(f"model.lora.targets={list(settings.targets)} match {', '.join(refused[:4])}: LoRA on "
                        f"embeddings and the output head is out of scope; target the blocks' Linear modules instead "
                        f"(model=hf: e.g. [q_proj,k_proj,v_proj,o_proj])")
    if not chosen and not fused:
        raise LoraError(f"model.lora.targets={list(settings.targets)} match no Linear module of the model; its Linear "
                        f"modules are named {sorted(linear)}")
    return dataclasses.replace(settings, parameters=tuple(fused))


def fused_weights(settings: LoraSettings, path: str, module: nn.Module) -> list[str]:
    """The paths of `module`'s own 3-D parameters (a mixture of experts' fused weights, one
    ``(experts, in, out)`` tensor for all) that the targets name, as peft's target_parameters."""
    return [f"{path}.{name}" for name, p in module.named_parameters(recurse=False)
            if p.dim() == 3 and settings.matches(f"{path}.{name}")]


def check_fused_targets(settings: LoraSettings | None, ep: int, tp: int, shard: str) -> None:
    """Refuse by name what LoRA on fused expert weights does not run with.

    Raises:
        LoraError: the targets adapt fused expert weights with parallel.ep, tp or shard=full.
    """
    if settings is None or not settings.parameters:
        return
    why = [(ep > 1, f"parallel.ep={ep}: peft keeps each expert's rank-r factors interleaved with the others', "
                    f"so they cannot be split with the experts"),
           (tp > 1, f"parallel.tp={tp}: the adapters of fused experts are not split by tensor parallelism"),
           (shard == "full", "parallel.shard=full: peft applies them as a parametrization of the fused weight, "
                             "which FSDP2's sharded parameters do not take")]
    for bad, reason in why:
        if bad:
            raise LoraError(f"model.lora.targets={list(settings.targets)} adapt the fused expert weights "
                            f"{', '.join(settings.parameters[:2])}{' ...' if len(settings.parameters) > 2 else ''} "
                            f"(peft's target_parameters), which does not run with {reason}; adapt them on ep=1, "
                            f"tp=1 without parallel.shard=full, or target Linear modules only")


def layer_modules(spec: Any) -> Iterable[tuple[str, nn.Module]]:
    """``(path, module)`` of every layer of `spec`, built one at a time on the meta device."""
    for index in range(len(spec)):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            layer = spec.layers[index].build()
        yield from layer.named_modules()


def inject(settings: LoraSettings, layer: nn.Module) -> nn.Module:
    """`layer` with peft's LoRA layers around its targeted Linear modules and fused expert weights
    (in place) and every other parameter frozen; a layer without targets is frozen whole."""
    paths = [path for path, module in layer.named_modules()
             if path and isinstance(module, nn.Linear) and settings.matches(path)]
    fused = ([w for path, module in layer.named_modules() if not isinstance(module, (nn.Linear, nn.Embedding))
              for w in fused_weights(settings, path, module)] if settings.parameters else [])
    if not paths and not fused:
        layer.requires_grad_(False)
        return layer
    from peft import inject_adapter_in_model

    config = settings.peft_config(target_modules=paths or None, target_parameters=fused)
    adapted = inject_adapter_in_model(config, layer, adapter_name=ADAPTER)
    for name, p in adapted.named_parameters():  # peft freezes the rest; say so here too (bias, norms)
        p.requires_grad_(".lora_" in f".{name}")
    return adapted


def count(params: Iterable[nn.Parameter]) -> tuple[int, int]:
    """(trainable, all) elements of `params` (each once)."""
    unique = {id(p): p for p in params}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)


def amount(n: float) -> str:
    """``4.2 M``, ``1.1 B``, ``640``: a parameter count for a person."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)}"


def describe(trainable: int, total: int) -> str:
    """``trainable 4.2 M of 1.1 B`` (parameters)."""
    return f"trainable {amount(trainable)} of {amount(total)}"


def base_key(key: str) -> str | None:
    """A LoRA layer's state-dict `key` under the base model's name (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``); None for an adapter's own tensor."""
    if ".lora_" in f".{key}":
        return None
    while ".base_layer." in key:  # a fused weight two adapters wrap: experts.base_layer.base_layer.gate_up_proj
        key = key.replace(".base_layer.", ".")
    return key


def count_model(spec: Any) -> tuple[int, int]:
    """(trainable, all) parameters of `spec`'s whole model, one layer at a time on the meta device
    (nothing materialised), a tied parameter once."""
    trainable = total = 0
    names = spec.layer_names()
    repeats = {(layer, path) for members in spec.tied.values() for layer, path in members[1:]}
    for index in range(len(spec)):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            layer = spec.layers[index].build()
            if spec.lora is not None:
                layer = inject(spec.lora, layer)
        again = {path for name, path in repeats if name == names[index]}
        params = [p for name, p in layer.named_parameters() if name not in again]
        t, n = count(params)
        trainable, total = trainable + t, total + n
    return trainable, total


def report(spec: Any) -> str:
    """The start-of-run line of a LoRA run: ``model.lora: rank 8, alpha 16.0, targets [q_proj, v_proj]
    (peft): trainable 4.2 M of 1.1 B parameters (...)``."""
    lora = spec.lora
    trainable, total = count_model(spec)
    return (f"model.lora: rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, targets "
            f"[{', '.join(lora.targets)}] (peft): {describe(trainable, total)} parameters; gradients, AdamW state "
            f"and the dp reduction for those only, the base frozen")
