"""Built-in models as ordered layer lists.

A model is named by its builder's import path, the one way a config names a model
(``model._target_=pkg.module.build_mine``; the built-in groups ``model=gpt|mlp|resnet18|...`` set
it for you). There is no name table to register into: write a function that returns a
`ModelSpec` and point ``_target_`` at it. `get_model_builder` resolves the same names in Python.
"""
from __future__ import annotations

import importlib
from typing import Callable

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import build_gpt
from pipeflow.models.mlp import build_mlp
from pipeflow.models.resnet import build_resnet, build_resnet18, build_resnet50
from pipeflow.models.sleep import build_sleep
from pipeflow.models.spec import LayerSpec, ModelSpec, derive_seed, run_layers

__all__ = [
    "LayerSpec",
    "ModelSpec",
    "build_gpt",
    "build_mlp",
    "build_resnet",
    "build_resnet18",
    "build_resnet50",
    "build_sleep",
    "builtin_models",
    "derive_seed",
    "get_model_builder",
    "run_layers",
]

ModelBuilder = Callable[..., ModelSpec]


def builtin_models() -> list[str]:
    """The short names of the built-in builders: ``<name>`` for each ``pipeflow.models.build_<name>``."""
    return sorted(key.removeprefix("build_") for key in __all__ if key.startswith("build_"))


def get_model_builder(name: str) -> ModelBuilder:
    """The builder a model name stands for, resolved as a config's ``_target_`` is.

    Args:
        name: an import path ``pkg.module.function`` (what ``model._target_`` holds), or the short
            name of a built-in builder (``gpt`` for ``pipeflow.models.build_gpt``).

    Returns:
        The builder function.

    Raises:
        ConfigError: `name` names no function; the message lists the built-in names.
    """
    module_name, _, attr = name.rpartition(".")
    if not module_name and name in builtin_models():
        return globals()[f"build_{name}"]
    try:
        builder = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        builder = None
    if not callable(builder):
        raise ConfigError(
            f"unknown model {name!r}; give the import path of a builder (pkg.module.build_mine) "
            f"or a built-in name: {', '.join(builtin_models())}"
        )
    return builder
