"""The model schemas: one typed config per model builder, read from its signature, so the
builder is the one source of a model's defaults (``model=gpt|mlp|resnet18|...``)."""
from __future__ import annotations

import copy
import inspect
from dataclasses import field, is_dataclass, make_dataclass
from typing import Any, Callable, get_type_hints

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import build_gpt
from pipeflow.models.hf import build_hf
from pipeflow.models.mlp import build_mlp
from pipeflow.models.module_spec import build_module
from pipeflow.models.sleep import build_sleep
from pipeflow.models.zoo import build_resnet, build_torchvision


def model_schema(builder: Callable[..., Any], name: str | None = None) -> type:
    """The config schema of a model: ``_target_`` naming `builder`, then one field per keyword
    argument of its signature, typed by its annotation, defaulting to the builder's default.

    The builder is the one source of a model's defaults; the schema only reads them. A user's
    model gets a typed config group the same way:
    ``ConfigStore.instance().store(group="model", name="base_mine", node=model_schema(build_mine))``.

    Args:
        builder: a function returning a ModelSpec, every parameter a keyword with a default.
        name: the schema's class name; default ``<Builder>Config``.

    Returns:
        A dataclass type for Hydra's ConfigStore.

    Raises:
        ConfigError: a parameter has no default (the schema could not default it).
    """
    hints = get_type_hints(builder)
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=f"{builder.__module__}.{builder.__qualname__}"))]
    for param in inspect.signature(builder).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            raise ConfigError(f"{builder.__qualname__}({param.name}) has no default; a model schema needs one")
        default = param.default  # a nested config (model.moe) as a fresh copy per instance
        spec = field(default_factory=lambda d=default: copy.deepcopy(d)) if is_dataclass(default) else field(default=default)
        fields.append((param.name, hints.get(param.name, Any), spec))
    doc = (builder.__doc__ or "").strip().splitlines()
    cls_name = name or "".join(part.title() for part in builder.__name__.split("_")) + "Config"
    return make_dataclass(cls_name, fields, namespace={"__doc__": doc[0] if doc else None, "__module__": __name__})


# The built-in models' schemas (``model=gpt|mlp|resnet18|resnet50|sleep|torchvision|module|hf``): their defaults are the builders'.
GPTModelConfig = model_schema(build_gpt, "GPTModelConfig")
MLPModelConfig = model_schema(build_mlp, "MLPModelConfig")
ResNetModelConfig = model_schema(build_resnet, "ResNetModelConfig")
SleepModelConfig = model_schema(build_sleep, "SleepModelConfig")
TorchvisionModelConfig = model_schema(build_torchvision, "TorchvisionModelConfig")
ModuleModelConfig = model_schema(build_module, "ModuleModelConfig")
HFModelConfig = model_schema(build_hf, "HFModelConfig")  # model=hf: transformers is imported only when it builds
