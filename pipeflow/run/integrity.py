"""Digests of checkpoint files: written into ``meta.json`` at save, verified before a load.

Every file of a checkpoint (DCP's data and ``.metadata``, each rank's RNG state) gets a SHA-256
digest.  The files are hashed by all ranks together (rank r hashes files r, r + world, ...; the
checkpoint folder is shared), one ``all_gather_object`` brings the shares together.  A
checkpoint saved before digests existed has none: it loads with one warning per process.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping

import torch.distributed as dist

from pipeflow.errors import CheckpointError, PipeflowError

log = logging.getLogger("pipeflow")

CHUNK = 1 << 22
PEER_SIGNS = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe")
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


def digest_files(folder: str) -> dict[str, str]:
    """Digests of every file of `folder`, hashed by all ranks together (collective when a process
    group is up; call after the barrier that ends the writes)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {rel: sha256(os.path.join(folder, rel)) for rel in _share(data_files(folder), rank, world)}
    merged: dict[str, str] = {}
    for part in _gather(mine):
        merged.update(part)  # type: ignore[arg-type]
    return merged


def first_problem(folder: str, digests: Mapping[str, str] | None, collective: bool = True) -> str | None:
    """What is wrong with the files of checkpoint `folder` against `digests` (from its meta), or
    None when every file is present and unchanged.  Collective unless `collective` is false (one
    process checks every file).  No digests (an older checkpoint): None, with a warning once."""
    global _warned_no_digests
    if digests is None:
        if not _warned_no_digests:
            log.warning("checkpoint %s has no file digests (saved by an older pipeflow): loading it unverified", folder)
            _warned_no_digests = True
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective and dist.is_initialized() else (0, 1)
    problems = []
    for rel in _share(sorted(digests), rank, world):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif sha256(path) != digests[rel]:
            problems.append(f"{path} does not match its digest in {os.path.join(folder, META)} (the file was changed or damaged)")
    found = [p for part in (_gather(problems) if collective else [problems]) for p in part]  # type: ignore[union-attr]
    return found[0] + (f" (and {len(found) - 1} more files)" if len(found) > 1 else "") if found else None


def call_named(call: Callable[[], object], what: str) -> object:
    """Run `call`; any failure (torch's CheckpointException is a BaseException) is re-raised as a
    :class:`~pipeflow.errors.CheckpointError` saying `what` was being done (with the path)."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit, PipeflowError):
        raise
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        first = str(exc).strip().splitlines()
        text = f"{what}: {type(exc).__name__}: {first[0] if first else ''}"[:2000]
        if any(sign in str(exc) for sign in PEER_SIGNS):
            text += (" - a peer stopped taking part in this collective save or load (dead, stuck, or its launcher "
                     "is gone); the checkpoint before it is intact")
        raise CheckpointError(text) from exc
