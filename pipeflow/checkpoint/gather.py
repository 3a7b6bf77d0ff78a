"""``python -m pipeflow.checkpoint gather <parts...> <out>``: one checkpoint from the hosts' parts.

With ``train.checkpoint_storage=local`` each host keeps its own part of a checkpoint
(:mod:`pipeflow.checkpoint.storage`): the DCP shards of its ranks (``__<global rank>_0.distcp``), their
RNG states, a ``.metadata`` describing those shards and a ``meta.json`` with their digests and
the host's ranks.  Gathering verifies every part against its digests, refuses parts of other
steps or runs and a set of parts that lacks some rank (naming the hosts and ranks missing),
copies the files into ``<out>.part``, merges the ``.metadata`` files (each tensor's chunks
united; a chunk several hosts wrote is kept once), writes ``meta.json`` with the digests of
every file and renames it to `out`: a checkpoint that any layout can resume from or export.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import shutil
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipeflow.errors import CheckpointError
from pipeflow.models.dcp_metadata import DCP_METADATA, SafeReader
from pipeflow.checkpoint import integrity
from pipeflow.checkpoint.find import META, checkpoints_of, read_meta, verify
from pipeflow.runtime.world.hosts import rank_ranges

LOCAL_KEYS = ("storage", "host", "host_ranks")  # what only a host's part records


def _part(path: str) -> tuple[str, dict[str, Any]]:
    """The step folder `path` names (itself, or the newest in a checkpoints folder or run directory)
    and its meta, verified against its digests.

    Raises:
        CheckpointError: no complete part there, or a damaged one (naming the file).
    """
    if not os.path.exists(path):
        raise CheckpointError(f"part {path} does not exist; give each host's step_<n> folder, copied from its disk")
    found = checkpoints_of(path)
    if not found:
        unfinished = path.rstrip("/").endswith(".tmp") or not os.path.isfile(os.path.join(path, META))
        why = f"no {META}: a save that never finished on that host" if unfinished else "no step_<n> folder"
        raise CheckpointError(f"{path} is not a complete part of a checkpoint ({why}); give each host's step_<n> "
                              f"folder of one step, copied from that host's disk")
    problem = verify(found[0], collective=False)
    if problem is not None:
        raise CheckpointError(f"part {found[0]} is damaged: {problem}; copy that host's part again")
    return found[0], read_meta(found[0])


def check_parts(parts: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse parts that are not one checkpoint's complete set: other steps or world sizes, a part
    given twice, or global ranks no part holds (naming the hosts that held them).

    Raises:
        CheckpointError: naming the parts and what is missing.
    """
    first_path, first = parts[0]
    for path, meta in parts[1:]:
        for key in ("step", "world_size"):
            if meta.get(key) != first.get(key):
                raise CheckpointError(f"{path} ({key} {meta.get(key)}) and {first_path} ({key} {first.get(key)}) are "
                                      f"parts of different checkpoints; give the parts of one step_<n>")
    held: dict[int, str] = {}
    for path, meta in parts:
        ranks = meta.get("host_ranks", range(int(meta.get("world_size", 0))))
        for rank in ranks:
            if rank in held:
                raise CheckpointError(f"{path} and {held[rank]} both hold global rank {rank}'s part: give each "
                                      f"host's part once")
            held[rank] = path
    missing = sorted(set(range(int(first.get("world_size", 0)))) - set(held))
    if missing:
        hosts = [f"host {name} (global ranks {rank_ranges(ranks)})" for name, ranks in first.get("hosts", [])
                 if set(ranks) & set(missing)]
        raise CheckpointError(f"the parts given hold no files of global ranks {rank_ranges(missing)} of step "
                              f"{first.get('step')}: add the part of {', '.join(hosts) or 'the hosts that ran them'} "
                              f"(its step_{int(first.get('step', 0)):08d} folder on that host's disk)")


def merge_metadata(metas: list[Metadata]) -> Metadata:
    """One DCP ``.metadata`` describing every part's shards: each tensor's chunks united (a chunk
    that several parts wrote, dp replicas on several hosts, kept once, with the first part's file)."""
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={},
                      storage_meta=metas[0].storage_meta, version=metas[0].version)
    for md in metas:
        for key, value in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.setdefault(key, copy.deepcopy(value))
            if have is not value and isinstance(have, TensorStorageMetadata):
                known = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
                have.chunks.extend(c for c in value.chunks if (tuple(c.offsets), tuple(c.sizes)) not in known)
        merged.planner_data.update(md.planner_data or {})
        for index, info in (md.storage_data or {}).items():
            merged.storage_data.setdefault(index, info)  # MetadataIndex compares (fqn, offset) only
    return merged


def _copy_files(parts: list[tuple[str, dict[str, Any]]], target: str) -> None:
    """Every data file of every part into `target` (``.metadata`` and ``meta.json`` aside).

    Raises:
        CheckpointError: two parts hold one file name with different contents.
    """
    seen: dict[str, tuple[str, str]] = {}
    for path, meta in parts:
        for rel, digest in sorted(meta.get("files", {}).items()):
            if rel == DCP_METADATA:
                continue
            if rel in seen:
                if seen[rel][1] != digest:
                    raise CheckpointError(f"{rel} differs between {seen[rel][0]} and {path}: parts of different runs")
                continue
            seen[rel] = (path, digest)
            os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
            shutil.copy2(os.path.join(path, rel), os.path.join(target, rel))


def gather(paths: list[str], out: str) -> str:
    """Merge the hosts' parts `paths` of one checkpoint into checkpoint `out` (which must not exist).

    Returns:
        `out`.

    Raises:
        CheckpointError: a missing, unfinished or damaged part, parts of different checkpoints,
            ranks no part holds, or `out` exists (each named).
    """
    if os.path.exists(out):
        raise CheckpointError(f"{out} exists: gather writes a new checkpoint folder; remove it or name another")
    parts = [_part(p) for p in paths]
    check_parts(parts)
    tmp = out.rstrip("/") + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _copy_files(parts, tmp)
        metas = [integrity.call_named(SafeReader(p).read_metadata, f"reading {p}/{DCP_METADATA}") for p, _ in parts]
        with open(os.path.join(tmp, DCP_METADATA), "wb") as f:
            pickle.dump(merge_metadata(metas), f)  # as DCP writes it; read back through the allowlist
        meta = {k: v for k, v in parts[0][1].items() if k not in LOCAL_KEYS}
        files = {rel: integrity.sha256(os.path.join(tmp, rel)) for rel in integrity.data_files(tmp)}  # one process
        meta.update(files=files, gathered_from=[p for p, _ in parts])
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_parser(sub: Any) -> None:
    """The ``gather`` subcommand, on the subparsers `sub` of ``python -m pipeflow.checkpoint``."""
    cmd = sub.add_parser(
        "gather", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="merge the hosts' parts of a train.checkpoint_storage=local checkpoint into one",
        description="Merge each host's part of one checkpoint (train.checkpoint_storage=local: every host keeps\n"
                    "its own ranks' shards) into one checkpoint that any layout resumes from or exports.\n"
                    "Every part is verified against its digests; parts of other steps, and a set that lacks\n"
                    "some rank's part, are refused, naming what is missing.",
        epilog="example:\n  python -m pipeflow.checkpoint gather host0/checkpoints/step_00000020 "
               "host1/checkpoints/step_00000020 merged/step_00000020")
    cmd.add_argument("parts", nargs="+", help="each host's step_<n> folder (or its checkpoints folder: the newest)")
    cmd.add_argument("out", help="the checkpoint folder to write (must not exist)")
