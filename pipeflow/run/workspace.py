"""The run directory of one job, made ready by rank 0 for every rank (collective).

Rank 0 chooses it (:mod:`pipeflow.run.run_dir`; with ``train.resume=auto`` and no directory
named, the newest matching earlier run, :mod:`pipeflow.run.discover`), checks it is usable,
takes its lock (:mod:`pipeflow.checkpoint.lock`), removes what dead jobs' interrupted saves left and
writes ``config.yaml``.  Every rank gets the directory and the job token, or the same error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pipeflow.errors import ConfigError, PipeflowError, RunDirLostError
from pipeflow.checkpoint import saving as checkpoint, storage
from pipeflow.run import discover
from pipeflow.run import run_dir as run_dirs
from pipeflow.checkpoint.lock import Loss, RunLock, find_loss, lost_error


@dataclass
class Workspace:
    """Where a job writes, and its lock (held on rank 0 only; None elsewhere)."""

    run_dir: str
    token: str
    lock: RunLock | None = None

    def release(self) -> None:
        """Give the run directory up (rank 0; a no-op elsewhere)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def lost(self) -> bool:
        """True once the lock's watch (rank 0) found the run directory or its lock gone or taken;
        read at every step (an attribute: no file system access, no device sync)."""
        return self.lock is not None and self.lock.lost is not None

    def lost_error(self, step: int) -> RunDirLostError:
        """What every rank raises when step `step`'s all-reduce says rank 0 lost the run directory:
        rank 0's finding, or on the other ranks what they find themselves (the directory is shared)."""
        loss = self.lock.lost if self.lock is not None else None
        if loss is not None and not loss.dir_gone and not os.path.isdir(self.run_dir):
            loss = None  # the watch saw the lock go first, the directory was being removed: say that
        if loss is None:
            loss = find_loss(self.run_dir, self.token) or Loss(
                self.run_dir, f"rank 0 found that this job no longer holds run directory {self.run_dir}")
        return lost_error(f"training stopped at step {step}", loss)


def _source_key(cfg: DictConfig) -> str:
    if cfg.train.run_dir:
        return "train.run_dir"
    return "hydra.run.dir" if run_dirs.explicit_hydra_dir("run.dir") else "the default run directory"


def check_usable(path: str, key: str) -> None:
    """Make `path` (a directory) if needed and check it can be written.

    Raises:
        ConfigError: it is a file, cannot be made, or is not writable (naming `key`).
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is a file, not a directory; point {key} at a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}={path!r} cannot be made ({exc.strerror}); choose a writable directory") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path!r} is not writable by this user; choose a writable directory")


def _rank0(cfg: DictConfig, run_dir: str) -> tuple[RunLock, str]:
    check_usable(run_dir, _source_key(cfg))
    lock = RunLock(run_dir)
    token = lock.acquire()
    checkpoint.remove_leftovers(os.path.join(run_dir, "checkpoints"))  # no other live job is here now
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    return lock, token


def prepare(cfg: DictConfig) -> Workspace:
    """Choose, check, lock the run directory and write its config (collective).

    Raises:
        ConfigError: the directory is unusable; RunDirLockedError: a live job holds it (on every rank).
    """
    rank = dist.get_rank()
    found = None
    if rank == 0 and _discovers(cfg):
        found = discover.find_run(run_dirs.ROOT, cfg)
    run_dir = run_dirs.agree_run_dir(cfg.train.run_dir or found)
    outcome: list[Any] = [None, None]
    lock = None
    if rank == 0:
        try:
            lock, outcome[0] = _rank0(cfg, run_dir)
        except PipeflowError as exc:
            outcome[1] = exc
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    try:
        own_disks = storage.check_shared(run_dir, outcome[0], cfg.train.checkpoint_storage)
    except PipeflowError:
        if lock is not None:
            lock.release()  # this job never starts: the run directory is free again
        raise
    if own_disks and rank != 0 and storage.first_of_host():  # no other live job saves on this host's disk
        checkpoint.remove_leftovers(os.path.join(run_dir, "checkpoints"))
    return Workspace(run_dir, outcome[0], lock)


def _discovers(cfg: DictConfig) -> bool:
    """``train.resume=auto`` with no run directory named (neither train.run_dir nor hydra.run.dir)."""
    return cfg.train.resume == "auto" and not cfg.train.run_dir and run_dirs.explicit_hydra_dir("run.dir") is None
