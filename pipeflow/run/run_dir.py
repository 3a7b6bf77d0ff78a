"""Where a run writes: one directory, chosen once by rank 0 and shared by every rank.

A run writes into ``train.run_dir``; unset, into ``hydra.run.dir`` when the user set it (on the
command line or in their config), else into ``outputs/<time>``.  A sweep (``train.py -m``) writes
into ``train.run_dir``, else an explicit ``hydra.sweep.dir``, else ``outputs/sweep_<time>``.

configs/config.yaml sets ``hydra.run.dir: .`` and ``hydra.sweep.dir: outputs`` (the defaults
below): directories that exist or that pipeflow uses anyway, so Hydra, which makes its directory
on every rank before the job starts, leaves nothing stray.  Only rank 0's choice counts: a
``${now:...}`` in a Hydra directory resolves on each rank by its own clock (hydra#2070), so a rank
whose resolution differs removes the directory Hydra made for it, if that holds only what Hydra
put there.
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

ROOT = "outputs"
# configs/config.yaml's hydra.run.dir and hydra.sweep.dir: "pipeflow chooses" (tests/test_run_dir.py checks).
HYDRA_DEFAULTS = {"run.dir": ".", "sweep.dir": ROOT}
_HYDRA_FILES = ("multirun.yaml",)  # what Hydra writes into a sweep directory (output_subdir is null)


def timestamp() -> str:
    """Now, as the name of a directory (``2024-05-01_12-30-59``)."""
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def hydra_dir(key: str) -> str | None:
    """``hydra.<key>`` (``run.dir`` or ``sweep.dir``) of the running Hydra job, resolved; None
    outside a Hydra job."""
    if not HydraConfig.initialized():
        return None
    return str(OmegaConf.select(HydraConfig.get(), key))


def explicit_hydra_dir(key: str) -> str | None:
    """``hydra.<key>`` (``run.dir`` or ``sweep.dir``) when the user set it: overridden on the
    command line (even to the default), or set to another value than configs/config.yaml's;
    None otherwise, and outside a Hydra job.  ``run.dir`` counts only in a single run and
    ``sweep.dir`` only in a multirun."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if (hydra_cfg.mode == RunMode.MULTIRUN) != (key == "sweep.dir"):
        return None
    value = hydra_dir(key)
    named = any(o.split("=", 1)[0].lstrip("+~") == f"hydra.{key}" for o in hydra_cfg.overrides.hydra)
    return value if named or value != HYDRA_DEFAULTS[key] else None


def choose(train_run_dir: str | None, explicit: str | None, default: str) -> str:
    """The first that is set: ``train.run_dir``, the explicit Hydra directory, the default."""
    return train_run_dir or explicit or default


def agree_run_dir(train_run_dir: str | None) -> str:
    """The run directory of a single run, chosen by rank 0 and received by every rank
    (collective): `train_run_dir`, else an explicit ``hydra.run.dir``, else ``outputs/<time>``."""
    return _agree(train_run_dir, "run.dir", os.path.join(ROOT, timestamp()))


def agree_sweep_dir(train_run_dir: str | None) -> str:
    """The directory of a whole sweep, chosen by rank 0 and received by every rank (collective):
    `train_run_dir`, else an explicit ``hydra.sweep.dir``, else ``outputs/sweep_<time>``."""
    return _agree(train_run_dir, "sweep.dir", os.path.join(ROOT, "sweep_" + timestamp()))


def _agree(train_run_dir: str | None, key: str, default: str) -> str:
    mine = explicit_hydra_dir(key)
    shared = [choose(train_run_dir, mine, default), mine]
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    chosen, rank0_hydra = shared
    if mine is not None and rank0_hydra is not None and mine != rank0_hydra:
        discard_stray(mine, chosen)
    return chosen


def discard_stray(path: str, keep: str) -> None:
    """Remove the directory Hydra made at `path` (and its parents it made) for this rank alone:
    only what is empty once Hydra's own files are gone, never `keep` or a directory above it.
    Ranks may race to remove the same directory; whoever loses ignores it."""
    path, keep = os.path.abspath(path), os.path.abspath(keep)
    with contextlib.suppress(OSError):
        if set(os.listdir(path)) <= set(_HYDRA_FILES):
            for name in _HYDRA_FILES:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(path, name))
        while path not in (keep, os.getcwd()) and not keep.startswith(path + os.sep) and not os.listdir(path):
            os.rmdir(path)
            path = os.path.dirname(path)
