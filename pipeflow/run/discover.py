"""``train.resume=auto`` without ``train.run_dir``: continue the newest matching run under ``outputs/``.

Each run writes its resolved config to ``<run_dir>/config.yaml``.  A later launch with
``train.resume=auto`` and no run directory of its own looks at every ``outputs/<dir>`` that has
one, newest first (by its last checkpoint), and continues the first whose config matches this
one and that holds a complete checkpoint and no live job (:mod:`pipeflow.checkpoint.lock`).

Matching ignores what says how long, how loudly and in which layout to run (:data:`IGNORED_KEYS`,
:data:`IGNORED_PREFIXES`): the trajectory of training is decided by the model, the data, the
optimizer, ``train.param_dtype`` and ``train.precision``, and checkpoints load into any pp x dp
layout, schedule and micro-batch count.  Every ignored key that differs is logged; a changed
``train.max_steps`` moves the end of the cosine learning-rate decay.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from omegaconf import OmegaConf

from pipeflow.checkpoint import lock
from pipeflow.checkpoint.find import candidates
from pipeflow.config.saved import upgrade_saved
from pipeflow.run.guard import flatten_config

log = logging.getLogger("pipeflow")

CONFIG_FILE = "config.yaml"
IGNORED_KEYS = frozenset({
    "train.max_steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.save_every",
    "train.run_dir", "train.resume", "train.check_finite", "train.save_on_signal",  # how a run stops: not what it trains
})
IGNORED_PREFIXES = ("metrics.", "plan.", "parallel.", "pipeline.", "schedule.", "comm.", "dist.")
SHOWN_RUNS = 3
SHOWN_KEYS = 6


def ignored(key: str) -> bool:
    """Whether `key` may differ between a run and the launch that continues it."""
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value now) for every key whose value differs (absent: ``"(absent)"``).
    A key absent on one side and null on the other is no difference: a key added since, unset."""
    out = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key, "(absent)"), now.get(key, "(absent)")
        if (old is None and new == "(absent)") or (new is None and old == "(absent)"):
            continue
        if json.dumps(old, default=str) != json.dumps(new, default=str):
            out.append((key, old, new))
    return out


def _text(diffs: list[tuple[str, Any, Any]]) -> str:
    shown = [f"{k} {json.dumps(a, default=str)} -> {json.dumps(b, default=str)}" for k, a, b in diffs[:SHOWN_KEYS]]
    return ", ".join(shown) + (f" and {len(diffs) - SHOWN_KEYS} more" if len(diffs) > SHOWN_KEYS else "")


def _runs(root: str) -> list[str]:
    """Run directories under `root` (those with a config.yaml), newest first by last checkpoint."""
    if not os.path.isdir(root):
        return []
    runs = [os.path.join(root, n) for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, CONFIG_FILE))]

    def newest(run: str) -> float:
        marks = [os.path.join(run, CONFIG_FILE), os.path.join(run, "checkpoints", "latest"), os.path.join(run, "checkpoints")]
        return max(os.path.getmtime(m) for m in marks if os.path.exists(m))

    return sorted(runs, key=newest, reverse=True)


def find_run(root: str, cfg: Any) -> str | None:
    """The run directory under `root` that ``train.resume=auto`` continues, or None (start fresh);
    logs the choice, every ignored key that differs, or why nothing matched."""
    now = flatten_config(cfg)
    runs = _runs(root)
    rejected: list[str] = []
    for run in runs:
        try:
            path = os.path.join(run, CONFIG_FILE)
            saved = flatten_config(upgrade_saved(OmegaConf.load(path), path))  # a run from before a rename
        except Exception as exc:  # noqa: BLE001 - an unreadable old config only disqualifies its run
            rejected.append(f"{run}: config.yaml unreadable ({type(exc).__name__})")
            continue
        diffs = differences(saved, now)
        deciding = [d for d in diffs if not ignored(d[0])]
        if deciding:
            rejected.append(f"{run}: {_text(deciding)}")
            continue
        if not candidates(os.path.join(run, "checkpoints")):
            rejected.append(f"{run}: same config, no complete checkpoint")
            continue
        holder = lock.live_holder(run)
        if holder is not None:
            rejected.append(f"{run}: same config, but a live job holds it ({holder})")
            continue
        _log_match(run, [d for d in diffs if d[0] not in ("train.run_dir", "train.resume")])
        return run
    why = f"no run under {root}/ has a config.yaml" if not runs else (
        f"none of the {len(runs)} runs under {root}/ can be continued: " + "; ".join(rejected[:SHOWN_RUNS])
        + (f"; ... {len(rejected) - SHOWN_RUNS} more" if len(rejected) > SHOWN_RUNS else ""))
    log.info("train.resume=auto: starting fresh: %s", why)
    return None


def _log_match(run: str, diffs: list[tuple[str, Any, Any]]) -> None:
    log.info("train.resume=auto: continuing %s (its config.yaml matches this config%s)", run,
             "" if diffs else " in every key")
    for key, old, new in diffs:
        note = ""
        if key == "train.max_steps":
            note = f" - the learning-rate schedule's horizon moves: the cosine decay now ends at step {new}"
        log.info("  differs (allowed): %s %s -> %s%s", key, json.dumps(old, default=str), json.dumps(new, default=str), note)
