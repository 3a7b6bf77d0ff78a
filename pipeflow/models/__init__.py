"""Built-in models as ordered layer lists, and the registry for a user's own."""
from __future__ import annotations

from typing import Callable, TypeVar

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import build_gpt
from pipeflow.models.mlp import build_mlp
from pipeflow.models.resnet import build_resnet, build_resnet18, build_resnet50
from pipeflow.models.spec import LayerSpec, ModelSpec, derive_seed, run_layers

__all__ = [
    "MODEL_BUILDERS",
    "LayerSpec",
    "ModelSpec",
    "build_gpt",
    "build_mlp",
    "build_resnet",
    "derive_seed",
    "get_model_builder",
    "register_model",
    "run_layers",
]

ModelBuilder = Callable[..., ModelSpec]
B = TypeVar("B", bound=ModelBuilder)

MODEL_BUILDERS: dict[str, ModelBuilder] = {
    "gpt": build_gpt,
    "mlp": build_mlp,
    "resnet": build_resnet,
    "resnet18": build_resnet18,
    "resnet50": build_resnet50,
}


def register_model(
    name: str, builder: B | None = None, *, overwrite: bool = False
) -> B | Callable[[B], B]:
    """Register a function that returns a ModelSpec under `name`.

    Use directly, ``register_model("mine", build_mine)``, or as a decorator,
    ``@register_model("mine")``.

    Args:
        name: the name configs use (``model.name``).
        builder: the function; omit it to get a decorator.
        overwrite: allow replacing an existing entry.

    Returns:
        The builder itself, or a decorator that registers and returns it.

    Raises:
        ConfigError: `name` is already registered and overwrite is False.
    """

    def register(fn: B) -> B:
        if name in MODEL_BUILDERS and not overwrite and MODEL_BUILDERS[name] is not fn:
            raise ConfigError(
                f"model {name!r} is already registered; pass overwrite=True to replace it"
            )
        MODEL_BUILDERS[name] = fn
        return fn

    return register if builder is None else register(builder)


def get_model_builder(name: str) -> ModelBuilder:
    """Look up a registered model builder.

    Args:
        name: a registered model name.

    Returns:
        The builder function.

    Raises:
        ConfigError: no model is registered under `name`; the message lists the valid names.
    """
    try:
        return MODEL_BUILDERS[name]
    except KeyError:
        valid = ", ".join(sorted(MODEL_BUILDERS))
        raise ConfigError(f"unknown model {name!r}; valid names: {valid}") from None
