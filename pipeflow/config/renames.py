"""Config keys under their old names: overrides, YAML files and saved run configs keep working.

A renamed key that an issue, the README, the docs or an example named is a deprecated alias: it
works and warns (:class:`~pipeflow.errors.DeprecatedKeyWarning`) naming the new key.  A name
that was never published, and a config group that is gone, are errors naming what to write
instead.  A run directory's ``config.yaml`` written under old names is read under the new ones
(:func:`pipeflow.config.saved.upgrade_saved`), so ``train.resume=auto`` and
``python -m pipeflow.generate`` continue it.
docs/reference/renames.md lists the same table for readers.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, NamedTuple

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeflow.errors import ConfigError, DeprecatedKeyWarning

_ABSENT = object()
_SHOWN: dict = {}  # warnings already shown: once per process (a sweep composes every job's config)
SHAPE_MODES = ("static", "per_step", "per_microbatch")  # comm.shapes, each learning more than the last


def _stronger_shapes(current: Any, mapped: Any) -> Any:
    """The two old booleans set one key: the mode that learns more wins (``false`` never lowers)."""
    if current not in SHAPE_MODES:
        return mapped
    return max(current, mapped, key=lambda mode: SHAPE_MODES.index(str(mode)))


def _set_one_wins(current: Any, old: Any) -> Any:
    """``metrics.log_every`` beside ``train.log_every``: it won where it was set (null: it was not)."""
    return current if old is None else old


class KeyRename(NamedTuple):
    """One renamed key: `old` -> `new`, its values translated by `values` where the meaning moved
    (``comm.dynamic_shapes=true`` -> ``comm.shapes=per_step``), `combine` merging the value with
    the new key's current one where two old keys became one; `deprecated`: still accepted."""

    old: str
    new: str
    values: dict[Any, Any] | None = None
    combine: Callable[[Any, Any], Any] | None = None
    deprecated: bool = True


RENAMES: tuple[KeyRename, ...] = (
    KeyRename("train.dtype", "train.param_dtype"),
    KeyRename("comm.dynamic_shapes", "comm.shapes", {True: "per_step", False: "static"}, _stronger_shapes),
    KeyRename("comm.variable_shapes", "comm.shapes", {True: "per_microbatch", False: "static"}, _stronger_shapes),
    KeyRename("comm.recvs_ahead", "comm.post_recvs", {True: "ahead", False: "at_step", "auto": "auto"}),
    KeyRename("pipeline.max_activations", "schedule.max_inflight_microbatches"),
    KeyRename("pipeline.stages_per_rank", "schedule.stages_per_rank"),
    KeyRename("pipeline.placement", "schedule.placement"),
    KeyRename("pipeline.stage_to_rank", "schedule.stage_to_rank"),
    KeyRename("plan.tp", "plan.tp_sizes"),
    KeyRename("plan.offload", "plan.offload_modes"),
    KeyRename("metrics.log_every", "train.log_every", combine=_set_one_wins),  # one key per logging interval
)
BY_OLD = {rename.old: rename for rename in RENAMES}
# groups of one option, now plain sections of the schema: `pipeline=default` names nothing
REMOVED_GROUPS = ("pipeline", "metrics", "plan", "optim")


def new_value(rename: KeyRename, value: Any, current: Any = None) -> Any:
    """The value `rename.new` takes for `value` given under `rename.old` (`current`: the new key's
    value so far, for keys two old keys became).

    Raises:
        ConfigError: a value the old key did not take either, naming both keys.
    """
    if rename.values is None:
        return rename.combine(current, value) if rename.combine is not None else value
    # exact types: 1 is not true, as the old key's check said
    found = [new for old, new in rename.values.items() if old == value and type(old) is type(value)]
    if not found:
        words = [str(v).lower() if isinstance(v, bool) else str(v) for v in rename.values]
        raise ConfigError(f"{rename.old}={value!r} must be {', '.join(words[:-1])} or {words[-1]}; the key is "
                          f"deprecated: set {rename.new}={'|'.join(dict.fromkeys(map(str, rename.values.values())))}")
    return rename.combine(current, found[0]) if rename.combine is not None else found[0]


def _say(rename: KeyRename, value: Any, where: str) -> None:
    """Warn that `rename.old` is deprecated, or raise where it was never published."""
    shown = str(value).lower() if isinstance(value, bool) else value
    advice = f"{rename.new}={rename.values.get(value, value) if rename.values is not None else shown}"
    if not rename.deprecated:
        raise ConfigError(f"{rename.old} was renamed {rename.new}{f' ({where})' if where else ''}: write {advice} "
                          f"(docs/reference/renames.md)")
    if os.environ.get("RANK", "0") != "0":  # every rank composes the same config: one says it
        return
    # shown as "<file or override>:0: DeprecatedKeyWarning: ...", not as a line of Hydra's
    warnings.warn_explicit(f"{rename.old}={shown} is deprecated: write {advice} (docs/reference/renames.md)",
                           DeprecatedKeyWarning, filename=where or "override", lineno=0, registry=_SHOWN)


def rename_overrides(overrides: list[Any], cfg: DictConfig) -> list[Any]:
    """Hydra's parsed overrides with every old key under its new name and value (warning for each);
    `cfg` (the config they apply to) gives a merged key its current value.

    Raises:
        ConfigError: a removed group chosen (``pipeline=default``), or a name never published.
    """
    from hydra.core.override_parser.types import OverrideType

    pending: dict[str, Any] = {}
    out = []
    for override in overrides:
        key = override.key_or_group
        if key in REMOVED_GROUPS and isinstance(override.value(), str):
            raise ConfigError(f"{override.input_line}: {key} is no longer a config group (it had one option); set its "
                              f"keys directly, e.g. {key}.<key>=<value> (python train.py --cfg job lists them)")
        rename = BY_OLD.get(key)
        if rename is None:
            out.append(override)
            continue
        value = override.value()
        current = pending.get(rename.new, OmegaConf.select(cfg, rename.new, default=None))
        mapped = value if override.is_delete() else new_value(rename, value, current)
        _say(rename, value, "")
        pending[rename.new] = mapped
        kind = OverrideType.CHANGE if override.type == OverrideType.ADD else override.type
        out.append(dataclasses.replace(override, key_or_group=rename.new, _value=mapped, type=kind,
                                       input_line=f"{rename.new}={mapped}"))
    return out


def rename_override_text(item: str) -> str:
    """A ``key=value`` given outside Hydra (``python -m pipeflow.generate``) with an old key written
    under its new name and value (warning), else as it is."""
    import yaml

    prefix = item[: len(item) - len(item.lstrip("+~"))]
    key, equals, text = item[len(prefix):].partition("=")
    rename = BY_OLD.get(key)
    if rename is None:
        return item
    value = yaml.safe_load(text) if text else None
    _say(rename, value, "")
    mapped = new_value(rename, value) if equals and rename.values is not None else text
    return f"{prefix.replace('+', '')}{rename.new}{equals}{mapped}"


def rename_keys(cfg: DictConfig, where: str = "", warn: bool = True) -> list[KeyRename]:
    """Move every old key of `cfg` (a YAML file's or a saved run's config, at the root package)
    to its new name, in place, warning for each unless not `warn` (`where`: the file, for the message).

    Returns:
        The renames applied.
    """
    done = []
    for rename in RENAMES:
        value = OmegaConf.select(cfg, rename.old, default=_ABSENT, throw_on_missing=False)
        if value is _ABSENT:
            continue
        parent_key, _, leaf = rename.old.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        current = OmegaConf.select(cfg, rename.new, default=None, throw_on_missing=False)
        mapped = new_value(rename, value, current)
        if warn or not rename.deprecated:
            _say(rename, value, where)
        with open_dict(parent):
            del parent[leaf]
        with open_dict(cfg):
            OmegaConf.update(cfg, rename.new, mapped, force_add=True)
        done.append(rename)
    return done
