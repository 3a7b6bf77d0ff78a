"""Digests of checkpoint files, and what each rank's failure in a checkpoint operation was.

Every file of a checkpoint (DCP's data and ``.metadata``, each rank's RNG state) gets a SHA-256
digest, written into ``meta.json`` at save and verified before a load.  The files are hashed by
all ranks together (rank r hashes files r, r + world, ...; the checkpoint folder is shared), one
``all_gather_object`` brings the shares together.  A checkpoint saved before digests existed has
none: it loads with one warning per process.

A failure is described per rank (:func:`describe`): torch's ``CheckpointException`` carries every
rank's own exception, each named with its rank (``rank 1: OSError: [Errno 28] No space left on
device``), and :func:`attempt` keeps one rank's outcome for the ranks to agree on.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from pipeflow.errors import CheckpointError, PipeflowError
from pipeflow.runtime.failures import CONNECTION_LOST_SIGNS

log = logging.getLogger("pipeflow")

CHUNK = 1 << 22
PEER_SIGNS = ("Timed out", "timed out", *CONNECTION_LOST_SIGNS)  # a peer left, or stopped answering
# What an OSError's errno says about the file system, and what to do.
OS_HINTS = {
    errno.ENOSPC: "the file system is full: free space there, or point train.run_dir at another disk",
    errno.EDQUOT: "the disk quota is used up: free space, or point train.run_dir at another disk",
    errno.EROFS: "the file system is read-only: point train.run_dir at a writable one",
    errno.EACCES: "permission denied: make the run directory writable by this user",
    errno.EIO: "an I/O error: check the disk (or the network file system) it is on",
}
META = "meta.json"
_warned_no_digests = False


def sha256(path: str) -> str:
    """The SHA-256 of the file at `path`, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def data_files(folder: str) -> list[str]:
    """Every file of checkpoint `folder` but ``meta.json``, as sorted relative paths."""
    found = []
    for here, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(here, name), folder)
            if rel != META and not rel.endswith(".part"):
                found.append(rel)
    return sorted(found)


def _share(items: list[str], rank: int, world: int) -> list[str]:
    return items[rank::world]


def _gather(value: object) -> list[object]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def digest_share(folder: str, rank: int, world: int) -> dict[str, str]:
    """Digests of rank `rank`'s share of the files of `folder` (files rank, rank + world, ...)."""
    return {rel: sha256(os.path.join(folder, rel)) for rel in _share(data_files(folder), rank, world)}


def digest_files(folder: str) -> dict[str, str]:
    """Digests of every file of `folder`, hashed by all ranks together (collective when a process
    group is up; call after the barrier that ends the writes)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = digest_share(folder, rank, world)
    merged: dict[str, str] = {}
    for part in _gather(mine):
        merged.update(part)  # type: ignore[arg-type]
    return merged


def first_problem(folder: str, digests: Mapping[str, str] | None, collective: bool = True,
                  share: tuple[int, int] | None = None, label: str = "", known: str | None = None) -> str | None:
    """What is wrong with the files of checkpoint `folder` against `digests` (from its meta), or
    None when every file is present and unchanged.  Collective unless `collective` is false (one
    process checks every file).  `share` (index, count): this process's share of the files, where
    not (rank, world size): a host's ranks checking their host's own part; `label` starts each of
    this process's findings (``on host node1: ``); `known`: a problem found already (its meta
    unreadable), shared with the others in the same gather.  No digests (an older checkpoint):
    None, with a warning once."""
    global _warned_no_digests
    if digests is None:
        if not _warned_no_digests:
            log.warning("checkpoint %s has no file digests (saved by an older pipeflow): loading it unverified", folder)
            _warned_no_digests = True
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective and dist.is_initialized() else (0, 1)
    rank, world = share if share is not None and collective else (rank, world)
    problems = [f"{label}{known}"] if known and rank == 0 else []  # said once (per host)
    for rel in _share(sorted(digests), rank, world):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            problems.append(f"{label}{path} is missing")
        elif sha256(path) != digests[rel]:
            problems.append(f"{label}{path} does not match its digest in {os.path.join(folder, META)} (the file was changed or damaged)")
    found = [p for part in (_gather(problems) if collective else [problems]) for p in part]  # type: ignore[union-attr]
    return found[0] + (f" (and {len(found) - 1} more files)" if len(found) > 1 else "") if found else None


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: first line of the message`` (cut to `limit` characters)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[:limit] + " ..."


def describe(exc: BaseException, rank: int) -> list[tuple[int, str]]:
    """Each rank's own error in `exc`, as ``(rank, "Type: message")``: torch's
    ``CheckpointException`` holds every rank's (its ``failures``); any other is `rank`'s."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        return [(int(r), _one_line(pair[0] if isinstance(pair, tuple) else pair)) for r, pair in sorted(failures.items())]
    return [(rank, _one_line(exc))]


def os_hints(exc: BaseException) -> list[str]:
    """What the OSErrors inside `exc` (its ``failures``, its causes) say about the file system."""
    found: list[BaseException] = [exc]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping):
        found += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    hints = []
    for item in found:
        while item is not None:
            hint = OS_HINTS.get(getattr(item, "errno", None) or -1) if isinstance(item, OSError) else None
            if hint and hint not in hints:
                hints.append(hint)
            item = item.__cause__
    return hints


def lost_peer(text: str) -> bool:
    """Whether a collective's error text says a peer stopped taking part (closed, reset, timed out)."""
    return any(sign in text for sign in PEER_SIGNS)


@dataclass
class Outcome:
    """One rank's part of a step of a collective checkpoint operation: a value, or its errors."""

    value: Any = None
    errors: list[tuple[int, str]] = field(default_factory=list)  # (rank, "Type: message")
    hints: list[str] = field(default_factory=list)
    kind: type | None = None  # the pipeflow error class raised, to raise again on every rank
    peer_lost: bool = False  # a collective inside the step failed: the group cannot agree any more


def attempt(call: Callable[[], Any], rank: int) -> Outcome:
    """Run `call`; its value, or what failed (per rank) without raising."""
    try:
        return Outcome(value=call())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        kind = type(exc) if isinstance(exc, PipeflowError) else None
        text = str(exc) if kind is not None else _one_line(exc)
        errors = [(rank, text)] if kind is not None else describe(exc, rank)
        return Outcome(errors=errors, hints=os_hints(exc), kind=kind,
                       peer_lost=kind is None and not hasattr(exc, "failures") and lost_peer(str(exc)))


def call_named(call: Callable[[], object], what: str) -> object:
    """Run `call`; any failure (torch's CheckpointException is a BaseException) is re-raised as a
    :class:`~pipeflow.errors.CheckpointError` saying `what` was being done (with the path) and
    each rank's own error."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit, PipeflowError):
        raise
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        if getattr(exc, "failures", None):
            said = f"{type(exc).__name__}: " + "; ".join(f"rank {r}: {text}" for r, text in describe(exc, 0))
        else:
            said = _one_line(exc, 2000)
        text = f"{what}: {said}"[:2000]
        if lost_peer(str(exc)):
            text += (" - a peer stopped taking part in this collective save or load (dead, stuck, or its launcher "
                     "is gone); the checkpoint before it is intact")
        raise CheckpointError(text) from exc
