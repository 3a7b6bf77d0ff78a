"""Reading DCP's ``.metadata`` without letting it run code.

``.metadata`` is a pickle (torch's ``FileSystemReader.read_metadata`` loads it with plain
``pickle.load``, which runs whatever the file names).  :func:`read_dcp_metadata` unpickles it
with an allowlist of the classes DCP metadata holds (:data:`METADATA_CLASSES`, found by listing
what pipeflow's checkpoints of every ``parallel.shard`` mode reference) and refuses anything
else before it runs; :class:`SafeReader` hands that to torch, so torch never unpickles it.
Used by every path that reads a DCP checkpoint: resume and export (``pipeflow.run``) and
``model.init_from`` (:mod:`pipeflow.models.materialise`).
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from pipeflow.errors import CheckpointError, UnsafeCheckpointError

DCP_METADATA = ".metadata"
META = "meta.json"  # pipeflow's own record beside a checkpoint's files (its digests)
# Every global a DCP .metadata of a pipeflow checkpoint references (shard none, optimizer and
# full alike; torch dtypes are allowed by type, see _allowed), by module.
METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}

def _allowed(module: str, name: str) -> bool:
    """Whether a DCP .metadata may reference global `module`.`name` (the allowlist, or a torch dtype)."""
    if name in METADATA_CLASSES.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals :func:`_allowed` lets through."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """Resolve `module`.`name` if allowed, else refuse (nothing of the pickle has run).

        Raises:
            UnsafeCheckpointError: naming the file and the refused global.
        """
        if not _allowed(module, name):
            raise UnsafeCheckpointError(
                f"{self.path}: refused to load: it names {module}.{name}, which DCP checkpoint metadata never "
                f"holds (allowed: torch.distributed.checkpoint metadata classes, torch.Size, torch dtypes and "
                f"layouts, paths); nothing in it was run. The checkpoint was not written by torch.distributed."
                f"checkpoint, or was tampered with (its digest in {META} too): do not use it; resume from another "
                f"one (train.resume=<its step_<n> directory>)"
            )
        return super().find_class(module, name)


def read_dcp_metadata(file: str) -> Metadata:
    """The DCP metadata in `file` (a checkpoint's ``.metadata``), unpickled with the allowlist.

    Raises:
        UnsafeCheckpointError: it references anything but checkpoint-metadata classes.
        CheckpointError: it is missing, truncated or not DCP metadata (naming the file).
    """
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure: the file is damaged
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged: "
                              f"resume from an earlier one (train.resume=<its step_<n> directory>)") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
                              f"Metadata; the checkpoint is damaged")
    return metadata


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` is read by :func:`read_dcp_metadata`
    (the allowlist), so that torch never unpickles it itself."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (``__<rank>.metadata`` when torch asks for a rank's own)."""
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        metadata = read_dcp_metadata(os.path.join(str(self.path), name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
