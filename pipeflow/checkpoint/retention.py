"""``train.keep_last``: a run keeps its K newest complete checkpoints, and any a user pinned.

Saving often fills disks (torchtitan's ``keep_latest_k``).  After each save is complete (every
rank's part written, ``latest`` pointed at it) the rank that tidies the checkpoints folder (rank 0;
with ``train.checkpoint_storage=local`` each host's first rank, on its own disk) removes the older
complete ``step_<n>`` folders beyond the K newest, never the one ``latest`` names nor a pinned
one (``python -m pipeflow.checkpoint pin <checkpoint>`` leaves a :data:`PIN` file in it, which
the checkpoint's digests do not cover).  A folder that cannot be removed is a warning: the save
it follows is complete either way.
"""
from __future__ import annotations

import logging
import os
import shutil

from pipeflow.errors import ConfigError
from pipeflow.checkpoint.find import candidates, find_latest, is_checkpoint

log = logging.getLogger("pipeflow")

PIN = "PINNED"  # a file in a checkpoint folder: train.keep_last never removes it


def is_pinned(path: str) -> bool:
    """Whether checkpoint `path` is pinned."""
    return os.path.isfile(os.path.join(path, PIN))


def prune(root: str, keep_last: int | None) -> list[str]:
    """Remove the complete checkpoints of `root` older than its `keep_last` newest (by step),
    except the one ``latest`` names and pinned ones; returns what was removed (None or 0: keep all)."""
    if not keep_last:
        return []
    newest = sorted(candidates(root), key=os.path.basename, reverse=True)  # step_<8 digits>: by step
    latest = find_latest(root)
    removed = []
    for path in newest[keep_last:]:
        if is_pinned(path) or (latest is not None and os.path.realpath(path) == os.path.realpath(latest)):
            continue
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("train.keep_last=%d: could not remove %s (%s); it stays", keep_last, path, exc)
            continue
        removed.append(path)
    if removed:
        log.info("train.keep_last=%d: removed %d older checkpoint(s) (%s)", keep_last, len(removed),
                 ", ".join(os.path.basename(p) for p in removed))
    return removed


def pin(path: str, pinned: bool = True) -> None:
    """Pin (or unpin) checkpoint `path`: ``train.keep_last`` never removes a pinned one.

    Raises:
        ConfigError: `path` is no complete checkpoint.
    """
    if not is_checkpoint(path):
        raise ConfigError(f"{path} is not a complete checkpoint (a step_<n> folder with meta.json): name the step "
                          f"folder to pin")
    marker = os.path.join(path, PIN)
    if pinned:
        with open(marker, "w", encoding="utf-8") as f:
            f.write("kept by train.keep_last\n")
    elif os.path.exists(marker):
        os.remove(marker)
