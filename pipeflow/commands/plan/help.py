"""``python -m pipeflow.plan --help``: the usage, the config groups as Hydra lists them, and the
``plan.*`` keys with their defaults and the comments their schema carries (the one place those
are written)."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from pipeflow.config.schema import PlanConfig, register_configs

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
USAGE = "usage: python -m pipeflow.plan [key=value ...]"


def _schema_keys(schema: type) -> list[str]:
    """``key: default  # comment`` for every field of a config dataclass: its defaults (made by
    its default factory where it has one) and the comments in its source, the one place they are
    written: beside the key, or as ``# ...`` lines above it where the source has them there."""
    beside, above = _field_comments(inspect.getsource(schema))
    lines = []
    for f in dataclasses.fields(schema):
        lines += [f"# {text}" for text in above.get(f.name, [])]
        lines.append(f"{f.name}: {default_text(f)}" + (f"  # {beside[f.name]}" if f.name in beside else ""))
    return lines


def _field_comments(source: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The comment beside each field of a dataclass's `source`, and the comment lines just above it."""
    beside: dict[str, str] = {}
    above: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in source.splitlines():
        comment = re.match(r"^\s+#\s?(.*)$", line)
        key = re.match(r"^\s+(\w+):[^#]*(?:#\s*(.*))?$", line)
        if comment:
            pending.append(comment.group(1))
        elif key:
            if key.group(2):
                beside[key.group(1)] = key.group(2)
            if pending:
                above[key.group(1)] = pending
            pending = []
        else:
            pending = []
    return beside, above


def default_text(f: dataclasses.Field) -> str:
    """A dataclass field's default as a YAML override writes it (``[none]``, ``null``, ``true``;
    ``???`` for a field without one)."""
    if f.default is not dataclasses.MISSING:
        return _yaml_text(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml_text(f.default_factory())
    return "???"


def _yaml_text(value: Any) -> str:
    """`value` in YAML's flow style, as a ``key=value`` override takes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def help_text() -> str:
    """What ``python -m pipeflow.plan --help`` prints: the usage line, what the planner does, the
    config groups (as Hydra's ``--help`` lists them) and the ``plan.*`` keys with their defaults."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        hydra_app = GlobalHydra.instance().hydra
        assert hydra_app is not None
        groups = hydra_app.format_config_groups(lambda group: not group.startswith("hydra"))
    plan_keys = _schema_keys(PlanConfig)
    return "\n".join([
        USAGE, "",
        "Predict the best pipeline layout before running: profile every layer on this machine, simulate",
        "every (schedule x micro-batch count x stages per rank x split), print the fastest that fit",
        "plan.memory_limit_gb with the train.py overrides that run them.  Takes the same key=value",
        "overrides as train.py (configs/); parallel.pp (the pipeline ranks) is required.", "",
        "== Config groups (group=option) ==", groups,
        "== The planner's keys (plan.<key>=value, defaults) ==", *plan_keys, "",
        "example: python -m pipeflow.plan model=gpt parallel.pp=4 plan.memory_limit_gb=2 plan.top=5",
        "exit status: 0 a layout fits, 1 none fits the memory limit, 2 a bad command line or config",
    ])
