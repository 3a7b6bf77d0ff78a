"""Did-you-mean for a config key that does not exist: Hydra's error for an unknown override
(``pipeline.num_microbatch=4``) names the nearest known keys, for ``@hydra.main`` and
``hydra.compose`` alike."""
from __future__ import annotations

import difflib
import warnings
from typing import Any

from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from pipeflow.errors import ConfigError
from pipeflow.config.renames import rename_keys, rename_overrides

_SHOWN: dict = {}  # sweep warnings already shown: once per process (every job's config is composed twice)


class ComposingConfigError(ConfigError, ConfigCompositionException):
    """A :class:`~pipeflow.errors.ConfigError` raised while Hydra composes (an old key's value it
    never took, a group that is gone): Hydra prints it as its one message, not a traceback."""


def config_keys(cfg: Any) -> list[str]:
    """Every dotted key of `cfg` (leaves and inner nodes), missing values included."""
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            keys.append(path)
            child = node._get_node(key) if OmegaConf.is_config(node) else None
            if OmegaConf.is_dict(child):
                walk(child, f"{path}.")

    walk(cfg, "")
    return keys


def suggest_keys(key: str, known: list[str], count: int = 2) -> list[str]:
    """The known keys nearest to the unknown `key` (difflib): when its parent exists, the
    parent's keys whose last name is nearest to its last name; else the nearest whole keys."""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    if parent in known or not parent:
        return [siblings[name] for name in difflib.get_close_matches(leaf, list(siblings), n=count, cutoff=0.6)]
    return difflib.get_close_matches(key, known, n=count, cutoff=0.8)


def _model_key_given_as_data(key: str, value: str, cfg: Any) -> Exception | None:
    """``data.vocab_size=64`` where the data source has no such key but the model does (the
    vocabulary of ``data=tokens`` is the model's): the error names the model's key (None: another
    case).  Without it the nearest key by spelling, ``data.batch_size``, would be suggested."""
    section, _, leaf = key.partition(".")
    data = OmegaConf.select(cfg, "data", throw_on_missing=False)
    model = OmegaConf.select(cfg, "model", throw_on_missing=False)
    if section != "data" or "." in leaf or not OmegaConf.is_dict(data) or "name" not in data:
        return None
    if not OmegaConf.is_dict(model) or leaf not in model:
        return None
    return ConfigCompositionException(f"Could not override '{key}': data={data.name} has no key {leaf}; it is the "
                                      f"model's here: model.{leaf}={value}. data={data.name}'s keys: {', '.join(data)}")


def _with_suggestion(exc: Exception, overrides: list[Any], cfg: Any) -> Exception | None:
    """Hydra's 'Could not override' error for an unknown key, with a did-you-mean (None: another error)."""
    text = str(exc)
    if not text.startswith("Could not override '"):
        return None
    key = text[len("Could not override '"):].split("'", 1)[0]
    value = next((o.input_line.partition("=")[2] for o in overrides if o.key_or_group == key), "...")
    moved = _model_key_given_as_data(key, value, cfg)
    if moved is not None:
        return moved
    close = suggest_keys(key, config_keys(cfg))
    if close:
        options = " or ".join(f"{k}={value}" for k in close)
        return ConfigCompositionException(
            f"Could not override '{key}': the config has no such key. Did you mean {options}?\n"
            f"(To add a new key anyway: +{key}={value})"
        )
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else None
    if not OmegaConf.is_dict(node):
        return None
    # a section of its own schema per option (data=chat): name the option and the keys it has
    if parent == "data" and "name" in node:  # a schema per source: another source's key is never added
        return ConfigCompositionException(f"Could not override '{key}': data={node.name} has no key "
                                          f"{key.rpartition('.')[2]}; its keys: {', '.join(node)}")
    return ConfigCompositionException(
        f"Could not override '{key}': {parent} has no key {key.rpartition('.')[2]}; its keys: {', '.join(node)}\n"
        f"(To add a new key anyway: +{key}={value})"
    )


def install_key_suggestions() -> None:
    """Wrap Hydra's override step so that an unknown key's error names the nearest known keys
    (``pipeline.num_microbatch=4`` -> ``Did you mean pipeline.num_microbatches=4?``) and an old
    key name is read as its new one (:mod:`pipeflow.config.renames`), in overrides and YAML
    files, for ``@hydra.main`` and ``hydra.compose`` alike.  Hydra has no hook for it: its
    (private) ``ConfigLoaderImpl._apply_overrides_to_config`` and ``_load_single_config`` are
    wrapped once; where they are missing (another Hydra), the errors stay Hydra's own."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
    except ImportError:
        return
    apply = getattr(ConfigLoaderImpl, "_apply_overrides_to_config", None)
    if apply is None or getattr(apply, "_pipeflow_suggests", False):
        return
    _install_file_renames(ConfigLoaderImpl)

    def apply_with_suggestions(overrides: list[Any], cfg: Any) -> None:
        overrides = sweep_data_overrides(overrides, cfg)
        try:  # old key names: warned, or refused naming the new
            overrides = rename_overrides(overrides, cfg)
        except ConfigError as exc:
            raise ComposingConfigError(str(exc)) from None
        try:
            apply(overrides, cfg)
        except ConfigCompositionException as exc:
            better = _with_suggestion(exc, overrides, cfg)
            if better is None:
                raise
            raise better from exc.__cause__

    apply_with_suggestions._pipeflow_suggests = True  # type: ignore[attr-defined]
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply_with_suggestions)


def sweep_data_overrides(overrides: list[Any], cfg: Any) -> list[Any]:
    """Hydra's parsed overrides of one job, less, in a multirun (``-m``: ``hydra.mode=MULTIRUN``
    among them), each ``data.<key>`` that the job's data source does not take but another one does
    (warned once): a sweep over sources (``-m data=markov,text data.path=my.txt``) gives each
    source the keys it takes.  Outside a sweep such a key is refused, naming the source's keys."""
    from pipeflow.config.data import DATA_SCHEMAS, data_keys

    if not any(o.key_or_group == "hydra.mode" and str(o.value()) == "MULTIRUN" for o in overrides):
        return overrides
    data = OmegaConf.select(cfg, "data", throw_on_missing=False)
    if not OmegaConf.is_dict(data) or "name" not in data:
        return overrides
    others = {key for source in DATA_SCHEMAS for key in data_keys(source)}
    kept = []
    for override in overrides:
        section, _, key = override.key_or_group.partition(".")
        if section == "data" and key in others and key not in data:
            warnings.warn_explicit(f"{override.input_line} left out of the jobs with data={data.name}: that source "
                                   f"takes no {key}", UserWarning, filename="sweep", lineno=0, registry=_SHOWN)
            continue
        kept.append(override)
    return kept


def _install_file_renames(loader: Any) -> None:
    """Wrap Hydra's loading of one YAML file so that its old key names become the new ones before
    it is merged into the schema (a user's experiment file written before a rename)."""
    load = getattr(loader, "_load_single_config", None)
    if load is None:
        return

    def load_with_renames(self: Any, default: Any, repo: Any) -> Any:
        result = load(self, default, repo)
        if OmegaConf.is_dict(result.config) and not default.config_path.startswith("hydra/"):
            try:
                rename_keys(result.config, where=f"{default.config_path}.yaml")
            except ConfigError as exc:
                raise ComposingConfigError(str(exc)) from None
        return result

    loader._load_single_config = load_with_renames
