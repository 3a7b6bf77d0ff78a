"""The counts and deadlines of a config, each checked against its least value, naming the key.

These checks need no process group: each section's ``__post_init__`` runs them when
:func:`pipeflow.config.schema.check_values` makes the composed config typed, which ``train.py`` does
before any rank joins: a ``comm.join_timeout_s=0`` is refused as a bad value, not reported as a
rank that never arrived.
"""
from __future__ import annotations

import math
from typing import Any


from pipeflow.errors import ConfigError

# (key, least value, whether null is allowed, what the key counts or what its edge values mean)
COUNT_KEYS: tuple[tuple[str, int, bool, str], ...] = (
    ("parallel.dp", 1, False, "data-parallel replicas; auto: world size / (pp x tp)"),
    ("parallel.pp", 1, True, "pipeline ranks; null: world size / (dp x tp)"),
    ("parallel.tp", 1, False, "ranks per stage; 1: no tensor parallelism"),
    ("parallel.ep", 1, False, "ranks each stage's experts are split over; 1: no expert parallelism"),
    ("train.keep_last", 1, True, "checkpoints kept (the newest, besides pinned ones); null: every one"),
    ("parallel.cp", 1, False, "ranks each sequence is split over (ring attention); 1: no context parallelism"),
    ("pipeline.num_microbatches", 1, False, "micro-batches per step"),
    ("schedule.stages_per_rank", 1, True, "model chunks per rank; null: the schedule's own"),
    ("train.max_steps", 1, False, "the steps to train"),
    ("train.log_every", 1, False, "steps per log interval"),
    ("train.eval_every", 0, False, "0: never evaluate"),
    ("train.eval_batches", 0, False, "held-out batches per evaluation; 0: none"),
    ("train.save_every", 0, False, "0: never save"),
    ("metrics.timed_every", 1, False, "1: every step timed by CUDA events"),
    ("metrics.rehearse_steps", 0, True, "0: no rehearsal; null: automatic"),
)
LAYOUT_KEYS = ("dp", "pp", "tp", "cp")  # parallel.*: checked again by resolve_layout, which tests call alone
_ABSENT = object()
# (key, default): the deadlines, in seconds
DEADLINE_KEYS: tuple[tuple[str, float], ...] = (
    ("comm.timeout_s", 300), ("comm.first_step_timeout_s", 900), ("comm.join_timeout_s", 120),
)


# counts that may also be `auto` (dp: derived from the world size; pp, tp: chosen by parallel.replan)
AUTO_KEYS = frozenset({"parallel.dp", "parallel.pp", "parallel.tp"})


def check_count(key: str, value: Any, least: int, nullable: bool, note: str) -> None:
    """Raise ConfigError unless `value` is an int of at least `least` (or null where `nullable`,
    or ``auto`` for the keys of :data:`AUTO_KEYS`)."""
    if (value is None and nullable) or (value == "auto" and key in AUTO_KEYS):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be a whole number of at least {least} ({note})")
    if value < least:
        bound = "at least 1" if least == 1 else f">= {least}"
        raise ConfigError(f"{key}={value} must be {bound} ({note})")


def check_section_counts(section: str, node: Any) -> None:
    """Every count of :data:`COUNT_KEYS` under `section` (``"train"``, ...) that `node` has is at least
    its least value (the section's ``__post_init__`` runs this on the typed config).

    Raises:
        ConfigError: naming the key, its value, the least value and what the key means.
    """
    for key, least, nullable, note in COUNT_KEYS:
        prefix, _, name = key.rpartition(".")
        if prefix == section and hasattr(node, name):
            check_count(key, getattr(node, name), least, nullable, note)


def check_layout_counts(parallel: Any) -> None:
    """``parallel.dp``, ``parallel.pp`` and ``parallel.tp`` are at least 1 (pp and tp may be null).

    Raises:
        ConfigError: naming the key.
    """
    notes = {key.rpartition(".")[2]: spec for key, *spec in COUNT_KEYS if key.startswith("parallel.")}
    for name in LAYOUT_KEYS:
        least, nullable, note = notes[name]
        value = getattr(parallel, name, 1)
        check_count(f"parallel.{name}", value, least, nullable or name == "tp", note)


def check_deadlines(comm: Any) -> None:
    """Every deadline of :data:`DEADLINE_KEYS` that `comm` has is a finite number of seconds > 0.

    Raises:
        ConfigError: naming the key and its default.
    """
    for key, default in DEADLINE_KEYS:
        value = getattr(comm, key.rpartition(".")[2])
        if not (isinstance(value, (int, float)) and value > 0):  # nan and null fail here too
            raise ConfigError(f"{key}={value} must be > 0 seconds (default {default:g})")
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number of seconds (default {default:g}); to wait "
                              f"very long, give a large number (e.g. {key}=86400)")
