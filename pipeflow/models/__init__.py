"""Built-in models as ordered layer lists.

A model is named by its builder's import path, the one way a config names a model
(``model._target_=pkg.module.build_mine``; the built-in groups ``model=gpt|mlp|resnet18|...`` set
it for you). There is no name table to register into: write a function that returns a
`ModelSpec` and point ``_target_`` at it. In Python, import the builder; `get_model_builder`
looks up a built-in one by its short name (``gpt`` is ``pipeflow.models.build_gpt``).

An ``nn.Module`` you already have needs no rewriting: `from_module` splits it into layers
(``model=module`` / ``model=torchvision`` from the config; see docs/start/2-your-model.md). A Hugging Face
decoder of the Llama family is `build_hf` (``model=hf model.path=<folder>``; transformers is
imported only when it runs).
"""
from __future__ import annotations

from typing import Callable

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import build_gpt
from pipeflow.models.hf import build_hf  # model=hf; transformers is imported only when it runs
from pipeflow.models.mlp import build_mlp
from pipeflow.models.module_spec import build_module, from_blocks, from_module, from_sequential, from_traced
from pipeflow.models.sleep import build_sleep
from pipeflow.models.spec import LayerSpec, ModelSpec, derive_seed, run_layers
from pipeflow.models.zoo import build_resnet, build_resnet18, build_resnet50, build_torchvision

__all__ = [
    "LayerSpec",
    "ModelSpec",
    "build_gpt",
    "build_hf",
    "build_mlp",
    "build_module",
    "build_resnet",
    "build_resnet18",
    "build_resnet50",
    "build_sleep",
    "build_torchvision",
    "builtin_models",
    "derive_seed",
    "from_blocks",
    "from_module",
    "from_sequential",
    "from_traced",
    "get_model_builder",
    "run_layers",
]

ModelBuilder = Callable[..., ModelSpec]


def builtin_models() -> list[str]:
    """The short names of the built-in builders: ``<name>`` for each ``pipeflow.models.build_<name>``."""
    return sorted(key.removeprefix("build_") for key in __all__ if key.startswith("build_"))


def get_model_builder(name: str) -> ModelBuilder:
    """A built-in builder by its short name: ``gpt`` is ``pipeflow.models.build_gpt`` (no table:
    the names are those of the ``build_<name>`` functions here).

    Args:
        name: a built-in model's short name (see `builtin_models`).

    Returns:
        The builder function.

    Raises:
        ConfigError: no built-in builder has that name; the message lists them and how to name
            a model of your own (its import path in ``model._target_``).
    """
    if name not in builtin_models():
        raise ConfigError(
            f"unknown model {name!r}; built-in: {', '.join(builtin_models())}; a model of your own "
            f"is named by its builder's import path: model._target_=pkg.module.build_mine"
        )
    return globals()[f"build_{name}"]
