"""Whether the job's hosts share one run directory, and each host's part of a checkpoint when not.

At start (:func:`check_shared`, after the run directory is locked) the first rank of each host
(:func:`pipeflow.runtime.world.hosts.table`) writes a probe file into the run directory; after a
barrier each looks which probes it sees and one all-gather brings the views together.  Hosts
that do not all see every probe have their own disks: with ``train.checkpoint_storage=shared``
(the default) every rank stops with :class:`~pipeflow.errors.RunDirNotSharedError` listing what
each host sees; with ``local`` each host writes its own part of every checkpoint
(:class:`HostPart`: its ranks' DCP shards under their global ranks, its own ``.metadata``,
``meta.json`` and ``latest``), which ``python -m pipeflow.checkpoint gather`` merges.  On one
host there is nothing to check.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix

from pipeflow.errors import CheckpointError, ConfigError, RunDirNotSharedError
from pipeflow.checkpoint.find import candidates, resolve, verify
from pipeflow.runtime.world import hosts

log = logging.getLogger("pipeflow")

PROBE = ".shared-probe"  # <run_dir>/.shared-probe.<job token>.<host index>
FIX = ("put train.run_dir on a file system every host mounts (NFS, Lustre, ...), or set "
       "train.checkpoint_storage=local so that each host keeps its own ranks' part of every checkpoint "
       "(python -m pipeflow.checkpoint gather merges the parts; docs/guides/multinode.md, Storage)")


@dataclass(frozen=True)
class HostPart:
    """This rank's host in a checkpoint written with ``train.checkpoint_storage=local``.

    Attributes:
        host: the host's name.
        ranks: its global ranks (the first one writes the host's ``meta.json`` and ``latest``).
        index: this rank's place among them.
        group: a process group of those ranks (each host's DCP save and load runs on it, its
            first rank the coordinator that writes the host's ``.metadata``).
        hosts: every host's (name, global ranks), in order of their first rank.
        leaders: a gloo group of every host's first rank (copies of the parts travel on it:
            :mod:`pipeflow.checkpoint.replicas`).
    """

    host: str
    ranks: tuple[int, ...]
    index: int
    group: Any
    hosts: tuple[tuple[str, tuple[int, ...]], ...]
    leaders: Any = None

    @property
    def first(self) -> int:
        """The global rank that tidies and commits this host's part."""
        return self.ranks[0]

    def writer(self, path: str) -> FileSystemWriter:
        """A DCP writer for this host's part: shards named by global rank (``__<rank>_0.distcp``),
        so the parts of all hosts merge without clashes."""
        return _GlobalNames(path, self.ranks)


class _GlobalNames(FileSystemWriter):
    """DCP's file system writer, naming each rank's shard file by its global rank (DCP names it by
    the rank in the save's process group)."""

    def __init__(self, path: str, ranks: tuple[int, ...]) -> None:
        super().__init__(path)
        self._ranks = ranks

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """Each plan's files prefixed ``__<global rank>_``."""
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self._ranks[i]}_"))
                for i, plan in enumerate(plans)]


_PART: HostPart | None = None


def host_part() -> HostPart:
    """This rank's :class:`HostPart` (collective the first time: every rank makes each host's group)."""
    global _PART
    if _PART is None:
        rows = _first_ranks() or [("localhost", tuple(range(dist.get_world_size())))]
        rank = dist.get_rank()
        groups = {ranks: dist.new_group(list(ranks)) for _, ranks in rows}  # every rank makes every group, in order
        leaders = dist.new_group([ranks[0] for _, ranks in rows], backend="gloo")
        name, ranks = next((n, r) for n, r in rows if rank in r)
        _PART = HostPart(name, ranks, ranks.index(rank), groups[ranks], tuple(rows), leaders)
    return _PART


def _first_ranks() -> list[tuple[str, tuple[int, ...]]]:
    """Every host's (name, global ranks) from the job's host table, in order of their first rank."""
    return [(h[0], tuple(h[2])) for h in hosts.table().hosts]


def check_shared(run_dir: str, token: str, storage: str) -> bool:
    """Stop every rank if the hosts do not share `run_dir` and `storage` is ``shared`` (collective;
    nothing on one host).  With ``local`` on hosts of their own disks, each host's first rank
    makes the folder on its own disk.  Returns whether the hosts have disks of their own.

    Raises:
        RunDirNotSharedError: naming which hosts see which probes, and the fix.
        ConfigError: ``local`` where some hosts share the folder and others do not.
    """
    rows = _first_ranks()
    if len(rows) < 2:
        return False
    rank = dist.get_rank()
    mine = next((i for i, (_, ranks) in enumerate(rows) if ranks[0] == rank), None)
    probe = os.path.join(run_dir, f"{PROBE}.{token}.{mine}")
    if mine is not None:
        with contextlib.suppress(OSError):
            os.makedirs(run_dir, exist_ok=True)
            with open(probe, "w") as f:
                f.write(rows[mine][0])
    dist.barrier()
    seen = _seen(run_dir, token) if mine is not None else None
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, seen)
    if mine is not None:
        with contextlib.suppress(OSError):
            os.remove(probe)
    problem = sharing_problem(run_dir, rows, [views[ranks[0]] for _, ranks in rows], storage)
    if problem is not None:
        raise problem
    return storage == "local"


def first_of_host() -> bool:
    """Whether this rank is the first of its host (each host's first rank when the table is empty)."""
    rank = dist.get_rank()
    return any(ranks[0] == rank for _, ranks in _first_ranks()) or (not _first_ranks() and rank == 0)


def _seen(run_dir: str, token: str) -> list[int]:
    """The host indices whose probes of job `token` this host sees in `run_dir`."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    prefix = f"{PROBE}.{token}."
    return sorted(int(n[len(prefix):]) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit())


def sharing_problem(run_dir: str, rows: list[tuple[str, tuple[int, ...]]], seen: list[list[int]],
                    storage: str) -> ConfigError | None:
    """The error for hosts `rows` (name, global ranks) whose first ranks saw the probes `seen` (host
    indices, by host), or None where every host sees every probe, or each only its own with
    ``local`` storage."""
    every = list(range(len(rows)))
    if all(sorted(s) == every for s in seen):
        if storage == "local":
            return RunDirNotSharedError(
                f"train.checkpoint_storage=local, but all {len(rows)} hosts see one run directory {run_dir} (a shared "
                f"file system): their parts would overwrite each other; set train.checkpoint_storage=shared")
        return None
    said = "; ".join(f"host {name} (global ranks {hosts.rank_ranges(ranks)}) sees "
                     f"{_names(rows, s, i)}" for i, ((name, ranks), s) in enumerate(zip(rows, seen)))
    if storage == "local":
        if all(s == [i] for i, s in enumerate(seen)):
            return None
        return ConfigError(f"train.checkpoint_storage=local needs each host to have its own run directory {run_dir}, "
                           f"but some hosts share one: {said}; use one shared file system for all hosts "
                           f"(train.checkpoint_storage=shared) or a disk of its own on each")
    return RunDirNotSharedError(
        f"the hosts do not see one run directory {run_dir} (each host's first rank wrote a file there and looked for "
        f"the others'): {said}. train.checkpoint_storage=shared (the default) needs one folder every host sees, or "
        f"checkpoints would be left incomplete, each host holding only its own ranks' shards; {FIX}")


def _names(rows: list[tuple[str, tuple[int, ...]]], seen: list[int], me: int) -> str:
    if not seen:
        return "no host's file (not even its own: the folder is not writable there)"
    own = " (its own)" if seen == [me] else ""
    return "the files of " + ", ".join(rows[i][0] for i in seen) + own


def choose_local(resume: str | None, root: str) -> str | None:
    """:func:`pipeflow.checkpoint.find.choose` for ``train.checkpoint_storage=local``
    (collective): the newest checkpoint whose part every host holds, intact (each host's ranks
    verify their host's part); a step that some hosts lack is skipped with a warning naming them.

    Raises:
        CheckpointError: the checkpoint a path names is missing or damaged on some host (naming it).
        ConfigError: a path that holds no complete checkpoint on some host.
    """
    if not resume:
        return None
    part = host_part()
    auto = resume == "auto"
    try:
        mine: list[str] | str = candidates(root) if auto else [resolve(resume, root) or ""]
    except ConfigError as exc:
        mine = f"host {part.host}: {exc}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    said = [e for e in everyone if isinstance(e, str)]
    if said:
        raise ConfigError(said[0])
    views = {name: [os.path.basename(p) for p in everyone[ranks[0]]] for name, ranks in part.hosts}
    folder = os.path.dirname(mine[0]) if mine else root  # type: ignore[index]
    for name in _common(views, auto):
        path = os.path.join(folder, name)
        problem = verify(path, share=(part.index, len(part.ranks)), label=f"on host {part.host}: ")
        if problem is None:
            return path
        if not auto:
            raise CheckpointError(f"train.resume={resume!r}: {problem}")
        if dist.get_rank() == 0:
            log.warning("train.resume=auto: skipping damaged checkpoint %s: %s; trying the previous one", name, problem)
    if not auto:
        raise CheckpointError(f"train.resume={resume!r}: not every host holds its part of it: "
                              + "; ".join(f"host {h} has {v or 'none'}" for h, v in views.items()))
    if dist.get_rank() == 0:
        log.info("train.resume=auto: starting fresh from step 0 in %s: no checkpoint whose part every host holds", root)
    return None


def _common(views: dict[str, list[str]], warn: bool) -> list[str]:
    """The checkpoint names every host's view holds, newest first; names that only some hosts
    hold are warned about (on rank 0) where `warn`."""
    sets = [set(v) for v in views.values()]
    common = set.intersection(*sets) if sets else set()
    partial = sorted(set.union(*sets) - common) if sets else []
    if warn and partial and dist.get_rank() == 0:
        for name in partial:
            lack = ", ".join(h for h, v in views.items() if name not in v)
            log.warning("train.resume=auto: %s is not on every host (missing on %s): not a complete checkpoint, "
                        "skipped", name, lack)
    return sorted(common, reverse=True)
