"""The model a run is built from: the ``model`` config's builder called with only the keys it
takes (one line naming a key it does not, never a TypeError inside Hydra's instantiation), its
own pipeflow errors surfaced as themselves, and what only the rank building a layer can see
agreed over the world."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, TypeVar

import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from pipeflow.errors import ConfigError, PipeflowError
from pipeflow.models.spec import ModelSpec

T = TypeVar("T")


def built_on_every_rank(build: Callable[[], T]) -> T:
    """`build()` (this rank's stages), agreed over the world by one small all-gather: a pipeflow
    error that only the rank building a layer can see (NaN in the weights it loads, a key missing
    from ``model.init_from``) is raised by every rank, one named line each, rather than by that
    rank alone while its peers meet a closed connection later.

    Raises:
        PipeflowError: this rank's own, else the lowest failing rank's.
    """
    try:
        built, error = build(), None
    except PipeflowError as exc:
        built, error = None, exc
    errors = [error]
    if dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = error or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return built  # type: ignore[return-value]


def build_spec(model_cfg: DictConfig) -> ModelSpec:
    """The model the ``model`` config's builder (``_target_``) returns.

    A pipeflow error the builder raises (a ConfigError naming ``model.path``, a CheckpointError
    naming a damaged weights file) reaches the caller as itself, one line, not wrapped in Hydra's
    ``InstantiationException`` (which stays its ``__context__``).

    Raises:
        ConfigError: a key the builder takes no argument for, the builder's own, or the builder
            returned something else than a ModelSpec.
    """
    target = OmegaConf.select(model_cfg, "_target_")
    if isinstance(target, str):
        try:
            get_method(target)
        except Exception as exc:  # noqa: BLE001 - Hydra's text is several lines with no key in it
            cause = str(exc.__cause__ or exc).strip().splitlines()
            raise ConfigError(f"model._target_={target!r} cannot be imported ({cause[-1] if cause else type(exc).__name__}"
                              f"): give the import path of a builder that returns a ModelSpec, e.g. "
                              f"pipeflow.models.build_gpt, on the PYTHONPATH of every rank "
                              f"(docs/start/2-your-model.md)") from exc
    try:
        spec = instantiate(builder_config(model_cfg))
    except InstantiationException as exc:
        named = _named_cause(exc)
        if named is None:
            raise
        raise named  # noqa: B904 - the builder's own error, its cause kept; Hydra's wrapper its context
    if not isinstance(spec, ModelSpec):
        target = OmegaConf.select(model_cfg, "_target_")
        raise ConfigError(
            f"model._target_={target!r} returned a {type(spec).__name__}, not a pipeflow ModelSpec; a model "
            f"builder must return ModelSpec(layers=[LayerSpec(...), ...], loss_fn=...): see docs/start/2-your-model.md"
        )
    return spec


def _named_cause(exc: BaseException) -> PipeflowError | None:
    """The pipeflow error under Hydra's (possibly nested) instantiation wrappers, if any."""
    seen: set[int] = set()
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc if isinstance(exc, PipeflowError) else None


def builder_config(model_cfg: DictConfig) -> DictConfig:
    """The ``model`` config with only keys its builder (``_target_``) takes: a key left at null or
    at its schema's default that the builder has no argument for is dropped (a user's builder on a
    built-in schema, such as ``base_mlp``, which gained ``init_from``, or ``gpt``, which gained
    ``moe``); any other such key is one line naming it and the
    builder's arguments, not a TypeError inside Hydra's instantiation traceback. A builder that
    cannot be imported or takes ``**kwargs`` is left to Hydra.

    Raises:
        ConfigError: naming the key (``+model.foo=1``), the builder and the keys it takes.
    """
    target = OmegaConf.select(model_cfg, "_target_")
    try:
        params = inspect.signature(get_method(target)).parameters
    except Exception:  # noqa: BLE001 - no importable target: Hydra's own error says so
        return model_cfg
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return model_cfg
    unknown = [key for key in model_cfg if not str(key).startswith("_") and key not in params]
    defaults = _schema_defaults(model_cfg)
    given = [key for key in unknown if OmegaConf.select(model_cfg, str(key)) is not None
             and _plain(OmegaConf.select(model_cfg, str(key))) != defaults.get(str(key), _NO_DEFAULT)]
    if given:
        taken = ", ".join(name for name, p in params.items() if p.kind != p.VAR_POSITIONAL)
        raise ConfigError(f"model.{given[0]} is not an argument of {target}, which takes: {taken}; remove "
                          f"model.{given[0]} (a key added with +model.{given[0]}=... reaches the builder as is)")
    if not unknown:
        return model_cfg
    kept = OmegaConf.to_container(model_cfg, resolve=True)
    return OmegaConf.create({key: value for key, value in kept.items() if key not in unknown})


_NO_DEFAULT = object()


def _plain(value: Any) -> Any:
    """A config value as plain Python (containers resolved)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _schema_defaults(model_cfg: DictConfig) -> dict[str, Any]:
    """The defaults of the structured schema `model_cfg` was made from, as plain Python (none
    for a plain config)."""
    schema = OmegaConf.get_type(model_cfg)
    if not dataclasses.is_dataclass(schema):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        out[f.name] = _plain(OmegaConf.structured(value)) if dataclasses.is_dataclass(value) else value
    return out
