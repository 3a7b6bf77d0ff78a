"""Checkpoints that survive a change of pipeline and data-parallel degree, written atomically.

This module writes them and is the API of the parts beside it: the tensors' names
(:mod:`pipeflow.checkpoint.names`), loading (:mod:`pipeflow.checkpoint.loading`), finding and
verifying (:mod:`pipeflow.checkpoint.find`) and export (:mod:`pipeflow.checkpoint.exporting`).

Model and optimizer state are saved with ``torch.distributed.checkpoint`` (DCP) under global,
layer-indexed names that do not depend on the layout: ``model.layers.<i>.<name>`` for layer i's
``state_dict()`` entries and ``optim.layers.<i>.<param>.<field>`` for its AdamW state.  Each
rank writes the layers it holds (DCP keeps one copy of what dp replicas or tied copies hold
twice) and loads the layers it holds now, whatever the layout was, so a pp=4 run resumes with
pp=2 or pp=1, another dp and another ``parallel.shard`` (with ZeRO-1 a rank writes and loads
the AdamW state of the parameters it owns only, under the same names; with ``full`` the
parameters and their AdamW state are DTensors sharded over each stage's dp group, which DCP
writes shard by shard under the same names, their global shapes in its metadata, and loads into
whatever the resuming run holds, shards or whole tensors; the export is the same).  Beside them:
``meta.json`` (step, loss scale, layout) and each rank's RNG states.  The data position is the
step: batch k is a pure function of k.

Atomicity: every rank writes into ``step_<n>.<job>.tmp`` (``<job>``: the token of the job that
holds the run directory's lock, :mod:`pipeflow.checkpoint.lock`); after a barrier the ranks hash every
file together, rank 0 writes ``meta.json`` (with the digests, :mod:`pipeflow.checkpoint.integrity`)
last and renames the directory to ``step_<n>``, then points ``latest`` at it (a ``latest`` that
is a directory is left alone, with a warning: the newest step folder is found without it).  A
complete checkpoint is a ``step_<n>`` directory (it always holds ``meta.json``); a crash mid-save
leaves only a ``.tmp`` directory, which loading ignores.  A save removes only its own job's leftovers;
those of dead jobs are removed when the run directory's lock is taken (:func:`remove_leftovers`).
The Trainer saves only after a step whose loss and gradients were finite and checks the weights
themselves before the save (:class:`~pipeflow.errors.NonFiniteError`), so ``latest`` only ever
points at a finite, complete checkpoint.  Needs a file system that every rank sees (a shared
one across nodes), unless ``train.checkpoint_storage=local``: then each host writes its own part
into its own folder (its ranks' shards under their global ranks, its own ``.metadata``,
``meta.json`` and ``latest``; :func:`_finish_part`, :mod:`pipeflow.checkpoint.storage`), and
``python -m pipeflow.checkpoint gather`` merges the parts (:mod:`pipeflow.checkpoint.gather`).

Every step of a save ends with the ranks sharing their outcome (one all-gather), so a failure on
any rank (a full disk, a lost run-directory lock: :func:`pipeflow.checkpoint.lock.verify_held`, checked
first, then a checkpoints folder removed after this job saved there, which is not made again)
stops every rank with the same error naming each rank's own cause (``rank 1: OSError:
[Errno 28] No space left on device``), and rank 0 removes the partial folder at once; a peer that
dies or stops during the save is a :class:`~pipeflow.errors.CheckpointPeerLostError` naming the
step.  Its collectives run under the process group's timeout, ``comm.timeout_s`` (plus a margin)
once the first step is done.

Loading verifies the digests first (:func:`verify`); ``latest`` is followed only inside its
checkpoints folder (a damaged one is skipped with a warning); DCP's ``.metadata`` pickle is read
with an allowlist (:class:`~pipeflow.models.dcp_metadata.SafeReader`) by every load and export,
so a planted one runs nothing; the RNG files load with ``weights_only=True``.

Export (:mod:`pipeflow.checkpoint.exporting`) to one file under the model's own names, or a Hugging Face
folder::

    python -m pipeflow.checkpoint export <checkpoint dir or checkpoints root> model.pt
    python -m pipeflow.checkpoint export --format hf <checkpoint dir or checkpoints root> <folder>
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from pipeflow.errors import CheckpointError, CheckpointPeerLostError, RunDirLostError
from pipeflow.models.dcp_metadata import SafeReader  # noqa: F401 - the reader every load uses, for callers
from pipeflow.checkpoint import integrity, lock, retention
from pipeflow.checkpoint.replicas import replicate
from pipeflow.checkpoint.storage import HostPart, host_part
from pipeflow.checkpoint.find import (  # noqa: F401 - part of this module's API
    LATEST, META, candidates, checkpoints_of, choose, find_latest, is_checkpoint, read_meta, resolve, verify,
)
from pipeflow.checkpoint.loading import load, saved_layout, saved_rank  # noqa: F401 - part of this module's API
from pipeflow.checkpoint.names import (  # noqa: F401 - part of this module's API
    ADAM_FIELDS, model_state, optimizer_state, param_names, whole_strided,
)
from pipeflow.checkpoint.exporting import export, main  # noqa: F401 - part of this module's API (the CLI)

__all__ = [
    "ADAM_FIELDS", "LATEST", "META", "SafeReader", "candidates", "checkpoints_of", "choose", "export", "find_latest",
    "is_checkpoint", "load", "main", "model_state", "optimizer_state", "param_names", "read_meta", "remove_leftovers",
    "resolve", "save", "saved_layout", "saved_rank", "verify", "whole_strided",
]

log = logging.getLogger("pipeflow")

_written: dict[tuple[str, str], str] = {}  # (job, checkpoints folder) -> the newest checkpoint that job wrote there
_warned_latest: set[str] = set()  # the `latest` paths found to be directories (warned once)
# what a CheckpointPeerLostError says of the peer, wherever a save meets one
PEER_GONE = "(it died, was stopped, or hangs; the launcher's report names a rank that ended)"


def rng_state() -> dict[str, Any]:
    """This rank's RNG states, as a checkpoint keeps them (taken when the state is)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@dataclass
class _Saving:
    """One collective save under way: where it writes, and how its steps agree or fail."""

    root: str
    step: int
    final: str
    tmp: str
    rank: int
    tidy: int = 0  # the rank that removes a partial folder: rank 0, or each host's first with local storage
    renamed: bool = False  # local storage: this host's part was renamed into place (removed if another's failed)
    group: Any = None  # the process group its steps agree on (None: the default group)
    part: HostPart | None = None  # local storage: this rank's host's part
    job: str = ""
    replicas: int = 1  # local storage: hosts holding each host's part (train.checkpoint_replicas)

    @property
    def what(self) -> str:
        """``checkpoint of step <n>``, how messages name this save."""
        return f"checkpoint of step {self.step}"

    def agree(self, doing: str, outcome: integrity.Outcome) -> list[Any]:
        """Share this rank's `outcome` of step `doing` with every rank (one all-gather, the save's
        barrier); returns every rank's value, or raises on every rank if any rank failed."""
        if outcome.peer_lost:
            self.lost_peer(doing, outcome.errors[0][1])
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(everyone, outcome, group=self.group)
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL: a peer died, was stopped, or hangs
            self.lost_peer(doing, integrity.describe(exc, self.rank)[0][1])
        failed = [o for o in everyone if o.errors]
        if failed:
            self.failed(doing, failed)
        return [o.value for o in everyone]

    def _remove_partial(self) -> str:
        """Rank 0: remove the partial folder; returns what ``latest`` still names, in words."""
        if self.rank == self.tidy:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.renamed:  # another host's part failed: this one alone is no checkpoint
                shutil.rmtree(self.final, ignore_errors=True)
        last = find_latest(self.root)
        return f"latest still names {last}" if last else "there is no earlier checkpoint"

    def lost_peer(self, doing: str, said: str) -> NoReturn:
        """Raise :class:`CheckpointPeerLostError` (the group cannot agree on anything any more)."""
        left = self._remove_partial()
        raise CheckpointPeerLostError(
            f"{self.what} not written ({self.tmp}): a peer stopped taking part while {doing} {PEER_GONE}: {said}. "
            f"The partial folder is removed "
            f"(by rank 0, if it is alive); {left}"
        )

    def failed(self, doing: str, failed: list[integrity.Outcome]) -> NoReturn:
        """Raise on every rank what the failed ranks reported, after removing the partial folder."""
        kinds = {o.kind for o in failed}
        errors = sorted({e for o in failed for e in o.errors})
        hints = list(dict.fromkeys(h for o in failed for h in o.hints))
        left = self._remove_partial()
        if len(errors) == 1 and None not in kinds:  # one rank's own named error (a lost lock): as it is
            raise next(iter(kinds))(errors[0][1])
        per_rank = "; ".join(f"rank {r}: {text}" for r, text in errors)
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise CheckpointError(f"{self.what} not written ({self.tmp}): {doing} failed on {per_rank}{hint}; the partial "
                              f"folder was removed, {left}")


def save(
    root: str, step: int, layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer, meta: dict[str, Any],
    job: str = "", storage: str = "shared", keep_last: int | None = None, replicas: int = 1,
) -> str:
    """Write checkpoint ``<root>/step_<step>`` atomically (collective: every rank calls it).

    Each step of the save ends with every rank sharing its outcome (one all-gather), so a
    failure on any rank (a full disk, a lost lock) stops every rank with the same error, naming
    each failed rank's own cause, and the partial folder is removed at once.  The same steps
    run in the background with ``train.checkpoint_mode=async`` (:mod:`pipeflow.checkpoint.background`:
    :func:`begin`, :func:`state_to_save`, then :func:`finish` once the files are written).

    Args:
        root: the checkpoints directory (shared by all ranks).
        step: steps done; training resumes at this step.
        layers: this rank's layers by global index.
        optimizer: the AdamW over their parameters.
        meta: JSON-able extras written by rank 0 (layout, loss scale).
        job: the token of the job saving (in the temporary directory's name, so that a save
            removes only its own leftovers); when this process holds that job's run directory
            lock, the lock is checked first (:func:`pipeflow.checkpoint.lock.verify_held`).
        storage: ``shared`` (one folder every rank sees) or ``local`` (each host writes its own
            part: :func:`_finish_part`).
        keep_last: ``train.keep_last``: once complete, older checkpoints beyond the newest K
            removed (:mod:`pipeflow.checkpoint.retention`); None: all kept.
        replicas: ``train.checkpoint_replicas``: with local storage, each host's part also kept
            on the next ``replicas - 1`` hosts (:mod:`pipeflow.checkpoint.replicas`).

    Returns:
        The checkpoint directory.

    Raises:
        RunDirLostError: the run directory or its lock vanished, or the lock names another job.
        CheckpointPeerLostError: a peer died, was stopped or hangs during the save.
        CheckpointError: the write failed (naming the directory and each rank's error).
    """
    saving = begin(root, step, job, storage, replicas=replicas)
    state = state_to_save(layers, optimizer)
    written = integrity.attempt(lambda: _write(state, saving.tmp, saving.part), saving.rank)
    return finish(saving, meta, written, rng_state(), keep_last)


def begin(root: str, step: int, job: str = "", storage: str = "shared", group: Any = None,
          part: HostPart | None = None, replicas: int = 1) -> _Saving:
    """The first step of a save (collective over `group`, default: the world): the tidy rank checks
    the lock and the folder and removes this job's leftover of the same step; every rank agrees.
    `part`: local storage's host part to use (default :func:`~pipeflow.checkpoint.storage.host_part`)."""
    rank = dist.get_rank()
    if storage == "local" and part is None:
        part = host_part()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = f"{final}.{job}.tmp" if job else f"{final}.tmp"
    saving = _Saving(root, step, final, tmp, rank, part.first if part else 0, group=group, part=part, job=job,
                     replicas=replicas)
    saving.agree("preparing", integrity.attempt(lambda: _prepare(saving, job) if rank == saving.tidy else None, rank))
    return saving


def state_to_save(layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP writes: the layers' and the optimizer's tensors under their layout-free names."""
    state, _ = whole_strided({**model_state(layers), **optimizer_state(optimizer, layers, fill=False)}, gather=True)
    return state


def finish(saving: _Saving, meta: dict[str, Any], written: integrity.Outcome, rng: dict[str, Any],
           keep_last: int | None = None, proceed: Callable[[], bool] | None = None) -> str:
    """The steps of a save after DCP wrote (or failed to write: `written`) this rank's files:
    the RNG states `rng`, then, agreed across ranks, the digests, ``meta.json``, the rename,
    ``latest`` and the retention (collective over the save's group).  `proceed` (a background
    save): asked on every rank before anything is committed; if any says no, the save is
    refused on every rank.  Returns the checkpoint directory; raises as :func:`save` does."""
    rank, part = saving.rank, saving.part
    if not written.errors:
        written = integrity.attempt(lambda: _save_rng(saving.tmp, rank, rng), rank)
    saving.agree("writing its files", written)
    if part is not None:
        final = _finish_part(saving, meta, part, saving.job, proceed, keep_last)
        if rank == saving.tidy:  # each host its own disk's
            retention.prune(saving.root, keep_last)
        return final
    world = dist.get_world_size()
    hashed = integrity.attempt(lambda: integrity.digest_share(saving.tmp, rank, world), rank)
    shares = saving.agree("hashing its files", hashed)
    files = {rel: digest for share in shares for rel, digest in share.items()}
    meta = {**meta, "step": saving.step, "world_size": world, "files": files}
    _agree_to_commit(saving, proceed)
    committed = integrity.attempt(lambda: _commit(saving.root, saving.tmp, saving.final, meta) if rank == 0 else None,
                                  rank)
    saving.agree("committing it", committed)
    if saving.job:
        _written[(saving.job, os.path.abspath(saving.root))] = saving.final
    if rank == 0:
        retention.prune(saving.root, keep_last)
    return saving.final


def _write(state: dict[str, Any], tmp: str, part: HostPart | None) -> None:
    """DCP's save into `tmp`: by every rank into one folder, or by each host's ranks into their own
    folder (`part`: shards named by global rank, the host's first rank writing its ``.metadata``)."""
    if part is None:
        dcp.save(state, checkpoint_id=tmp)
    else:
        dcp.save(state, storage_writer=part.writer(tmp), process_group=part.group)


def _agree_to_commit(saving: _Saving, proceed: Callable[[], bool] | None) -> None:
    """Every rank says whether the save may still commit (`proceed`); one no refuses it everywhere."""
    if proceed is None:
        return

    def ask() -> None:
        if not proceed():
            raise CheckpointError(f"{saving.what} given up before it was committed (a preemption's grace ran out "
                                  f"while it was written in the background)")
    saving.agree("deciding to commit it", integrity.attempt(ask, saving.rank))


def _finish_part(saving: _Saving, meta: dict[str, Any], part: HostPart, job: str,
                 proceed: Callable[[], bool] | None = None, keep_last: int | None = None) -> str:
    """Local storage, after every host wrote its files: each host hashes its own (shared among its
    ranks), its first rank writes the host's ``meta.json`` and renames its folder (and copies it
    to other hosts: ``train.checkpoint_replicas``); only once every host's part is in place does
    each point its own ``latest`` at it."""
    rank, world = saving.rank, dist.get_world_size()
    hashed = integrity.attempt(lambda: integrity.digest_share(saving.tmp, part.index, len(part.ranks)), rank)
    shares = saving.agree("hashing its files", hashed)
    files = {rel: digest for r in part.ranks for rel, digest in shares[r].items()}
    meta = {**meta, "step": saving.step, "world_size": world, "files": files, "storage": "local", "host": part.host,
            "host_ranks": list(part.ranks), "hosts": [[name, list(ranks)] for name, ranks in part.hosts]}
    _agree_to_commit(saving, proceed)
    committed = integrity.attempt(lambda: _commit_part(saving, meta) if rank == saving.tidy else None, rank)
    saving.agree("committing its host's part", committed)
    if saving.replicas > 1 and len(part.hosts) > 1:
        copied = integrity.attempt(lambda: replicate(saving.root, saving.final, part, saving.replicas, keep_last)
                                   if rank == saving.tidy else None, rank)
        saving.agree("copying its host's part to other hosts", copied)
    pointed = integrity.attempt(lambda: _point_latest(saving.root, saving.final) if rank == saving.tidy else None, rank)
    saving.agree(f"pointing {LATEST} at it", pointed)
    if job:
        _written[(job, os.path.abspath(saving.root))] = saving.final
    return saving.final


def _commit_part(saving: _Saving, meta: dict[str, Any]) -> None:
    """A host's first rank: its ``meta.json`` last, then the rename (``latest`` waits for every host)."""
    write_atomic(os.path.join(saving.tmp, META), json.dumps(meta, indent=1))
    old = saving.tmp.removesuffix(".tmp") + ".old"
    if os.path.exists(saving.final):
        os.rename(saving.final, old)
    os.rename(saving.tmp, saving.final)
    saving.renamed = True
    shutil.rmtree(old, ignore_errors=True)


def _prepare(saving: _Saving, job: str) -> None:
    """Rank 0: check the run directory's lock and that the folder this job saved into is still
    there, make the folder (the first save), remove this job's own leftover."""
    lock.verify_held(job, saving.what)
    _check_not_removed(saving, job)
    os.makedirs(saving.root, exist_ok=True)
    shutil.rmtree(saving.tmp, ignore_errors=True)  # this job's own leftover of an interrupted save of this step


def _check_not_removed(saving: _Saving, job: str) -> None:
    """Refuse to make the checkpoints folder again once job `job` has saved there: it was removed
    while the job ran, and a new folder would hold only later steps, the loss unsaid.

    Raises:
        RunDirLostError: naming the folder, the newest checkpoint this job wrote there and what to do.
    """
    last = _written.get((job, os.path.abspath(saving.root)))
    if last is None or os.path.isdir(saving.root):
        return
    run_dir = os.path.dirname(os.path.abspath(saving.root))
    raise RunDirLostError(
        f"{saving.what} refused: the checkpoints folder {saving.root} is gone (removed while this job ran), and with "
        f"it {os.path.basename(last)} and every earlier checkpoint this job saved there; the job stops rather than "
        f"start a new folder that would hold only later steps. To go on, restore {saving.root} and resume "
        f"(train.resume=auto train.run_dir={run_dir}), or start the run again"
    )


def _save_rng(tmp: str, rank: int, state: dict[str, Any]) -> None:
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(state, os.path.join(tmp, "rng", f"rank{rank}.pt"))


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all: into ``<path>.part``, synced, then renamed."""
    try:
        with open(path + ".part", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".part", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".part")  # no half-written file left beside `path`
        raise


def _commit(root: str, tmp: str, final: str, meta: dict[str, Any]) -> None:
    """Rank 0: meta.json last, then the rename that makes the checkpoint visible."""
    write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=1))
    old = tmp.removesuffix(".tmp") + ".old"
    if os.path.exists(final):  # saving the same step again: keep the old one until the swap
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    _point_latest(root, final)


def _point_latest(root: str, final: str) -> None:
    """Rank 0: write ``<root>/latest`` naming `final`; a ``latest`` that is a directory is left as
    it is, with a warning once (the checkpoint is complete; ``train.resume=auto`` and export take
    the newest step folder when ``latest`` names none)."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isdir(pointer):
        write_atomic(pointer, os.path.basename(final))
    elif pointer not in _warned_latest:
        _warned_latest.add(pointer)
        log.warning("%s is a directory, not the file naming the newest checkpoint: left as it is, so it does not name "
                    "%s (saved and complete); train.resume=auto takes the newest complete step_<n> folder instead. "
                    "Move it away to have saves write it again", pointer, final)


def remove_leftovers(root: str) -> list[str]:
    """Remove the ``.tmp``/``.old`` directories of interrupted saves under `root`; returns their
    names.  Only for the holder of the run directory's lock: no other live job saves there."""
    if not os.path.isdir(root):
        return []
    gone = [n for n in os.listdir(root) if n.endswith((".tmp", ".old"))]
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone


if __name__ == "__main__":
    raise SystemExit(main())
