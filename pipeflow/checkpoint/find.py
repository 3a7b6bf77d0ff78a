"""Finding checkpoints: which ``step_<n>`` directories are complete, which one a path or
``train.resume`` names, whether its files are intact (digests, :mod:`pipeflow.checkpoint.integrity`),
and reading DCP's ``.metadata`` without letting it run code (:mod:`pipeflow.models.dcp_metadata`).

``latest`` is followed only inside its own checkpoints folder; a damaged one (not a name, a
name that is no complete checkpoint, a directory) is ignored with a warning naming it, and the
newest step folder is used instead.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch.distributed as dist

from pipeflow.errors import CheckpointError, ConfigError
from pipeflow.checkpoint import integrity

log = logging.getLogger("pipeflow")

META = "meta.json"
LATEST = "latest"
_warned: set[tuple[str, str]] = set()


def is_checkpoint(path: str) -> bool:
    """True for a complete checkpoint directory."""
    return os.path.isfile(os.path.join(path, META)) and not path.rstrip("/").endswith((".tmp", ".old"))


def _warn_once(pointer: str, why: str, after: str = f"the next save rewrites {LATEST}") -> None:
    """Warn (once per process and reason) that ``latest`` file `pointer` is ignored because `why`;
    `after` says what happens to it next."""
    if (pointer, why) not in _warned:
        _warned.add((pointer, why))
        log.warning("%s %s: ignored; the newest complete step_<n> folder beside it is used instead (%s)",
                    pointer, why, after)


def _pointed_name(pointer: str) -> str | None:
    """The folder name ``latest`` file `pointer` holds, or None (with a warning) if it holds no name."""
    try:
        with open(pointer, "rb") as f:
            raw = f.read(4096)
    except OSError as exc:
        _warn_once(pointer, f"cannot be read ({exc.strerror})")
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        _warn_once(pointer, f"is damaged (not text: {raw[:16]!r}...)")
        return None
    if not name or "\x00" in name or "\n" in name:
        _warn_once(pointer, f"is damaged ({'empty' if not name else 'not one folder name: ' + repr(name[:40])})")
        return None
    return name


def _pointed(root: str) -> str | None:
    """The checkpoint ``<root>/latest`` names, if it is a complete one inside `root`; a damaged
    ``latest`` (not a name, outside `root`, no complete checkpoint, a directory) is None, with a
    warning."""
    pointer = os.path.join(root, LATEST)
    if os.path.isdir(pointer):
        _warn_once(pointer, "is a directory, not the file naming the newest checkpoint",
                   f"saves leave it as it is: move it away to have {LATEST} written again")
        return None
    if not os.path.isfile(pointer):
        return None
    name = _pointed_name(pointer)
    if name is None:
        return None
    candidate = os.path.join(root, name)
    if os.path.dirname(os.path.realpath(candidate)) != os.path.realpath(root):
        _warn_once(pointer, f"names {candidate}, which is not inside {root}")
        return None
    if not is_checkpoint(candidate):
        _warn_once(pointer, f"names {name}, which is not a complete checkpoint (missing, or without {META})")
        return None
    return candidate


def candidates(root: str) -> list[str]:
    """The complete checkpoints under `root`, newest first (``latest`` first, then by step)."""
    if not os.path.isdir(root):
        return []
    done = sorted((n for n in os.listdir(root) if n.startswith("step_") and is_checkpoint(os.path.join(root, n))), reverse=True)
    found = [os.path.join(root, n) for n in done]
    first = _pointed(root)
    return ([first] if first else []) + [p for p in found if first is None or os.path.realpath(p) != os.path.realpath(first)]


def find_latest(root: str) -> str | None:
    """The newest complete checkpoint under `root` (``latest`` first, else the highest step)."""
    found = candidates(root)
    return found[0] if found else None


def checkpoints_of(path: str) -> list[str]:
    """The checkpoints an explicit path names, newest first: a checkpoint directory itself, a
    run directory (its ``checkpoints/``), or a checkpoints folder."""
    if is_checkpoint(path):
        return [path]
    inner = os.path.join(path, "checkpoints")
    return candidates(inner if os.path.isdir(inner) else path)


def resolve(resume: str | None, default_root: str) -> str | None:
    """The checkpoint ``train.resume`` names: None, ``auto`` (newest under `default_root`, or
    None for a fresh start), a checkpoint directory, a run directory or a checkpoints folder
    (its newest).

    Raises:
        ConfigError: a path that holds no complete checkpoint.
    """
    if not resume:
        return None
    if resume == "auto":
        return find_latest(default_root)
    found = checkpoints_of(resume)
    if not found:
        raise ConfigError(
            f"train.resume={resume!r} holds no complete checkpoint (a step_<n> directory with {META}); "
            f"use a checkpoint directory, its checkpoints folder, its run directory, or train.resume=auto"
        )
    return found[0]


def read_meta(path: str) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint `path`.

    Raises:
        CheckpointError: missing or not JSON (naming the file).
    """
    file = os.path.join(path, META)
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged: "
                              f"resume from an earlier one (train.resume=<its step_<n> directory>)") from exc
    if not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointError(f"{file} is not a pipeflow checkpoint's meta (no 'step'); the checkpoint is damaged")
    return meta


def verify(path: str, collective: bool = True, share: tuple[int, int] | None = None, label: str = "") -> str | None:
    """What is wrong with checkpoint `path` (garbled meta, a missing or changed file), or None
    (collective unless `collective` is false; every rank gets the same answer; `share` and
    `label`: see :func:`pipeflow.checkpoint.integrity.first_problem`)."""
    try:
        meta = read_meta(path)
    except CheckpointError as exc:
        if collective and dist.is_initialized() and dist.get_world_size() > 1:  # hosts of their own disks
            return integrity.first_problem(path, {}, collective, share, label, known=str(exc))  # others gather too
        return str(exc)
    return integrity.first_problem(path, meta.get("files"), collective, share, label)


def choose(resume: str | None, root: str) -> str | None:
    """The checkpoint to resume from (collective: every rank verifies a share of its files).

    ``auto``: the newest good checkpoint under `root`; a damaged one is skipped with a warning
    naming the bad file; None (start fresh, logged) when there is none.  A path (checkpoint, run
    directory or checkpoints folder): its newest checkpoint, which must be intact.

    Raises:
        CheckpointError: the checkpoint a path names is damaged (naming the file).
        ConfigError: a path that holds no complete checkpoint.
    """
    if not resume:
        return None
    auto = resume == "auto"
    found = candidates(root) if auto else [resolve(resume, root)]
    main = not dist.is_initialized() or dist.get_rank() == 0
    for path in found:
        problem = verify(path)
        if problem is None:
            return path
        if not auto:
            raise CheckpointError(f"train.resume={resume!r}: {problem}")
        if main:
            log.warning("train.resume=auto: skipping damaged checkpoint %s: %s; trying the previous one", path, problem)
    if main:
        why = "every checkpoint there is damaged" if found else "it holds no complete checkpoint"
        log.info("train.resume=auto: starting fresh from step 0 in %s: %s", root, why)
    return None
