"""Loading a checkpoint into whatever layout this run has (collective; see :mod:`pipeflow.checkpoint.saving`):
each rank reads the layers it holds now, their optimizer state, and its RNG states.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models.dcp_metadata import SafeReader
from pipeflow.checkpoint import integrity
from pipeflow.checkpoint.find import read_meta
from pipeflow.checkpoint.names import model_state, optimizer_state, whole_strided
from pipeflow.checkpoint.lora_base import LORA_BASE
from pipeflow.checkpoint.storage import host_part
from pipeflow.runtime.world import hosts
from pipeflow.runtime.parallel.fsdp import local
from pipeflow.runtime.parallel.mesh_order import DEFAULT_ORDER, MeshGrid
from pipeflow.runtime.parallel.tensor_parallel import rows_of
from pipeflow.runtime.parallel.zero import local_optimizer

log = logging.getLogger("pipeflow")


def load(path: str, layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer | None,
         storage: str = "shared", grid: MeshGrid | None = None) -> dict[str, Any]:
    """Load this rank's layers and their optimizer state from checkpoint `path` (collective);
    restores this rank's RNG states when the checkpoint had the same world size: those of the
    rank that sat at this rank's mesh coordinates (`grid`) where the checkpoint's dp, pp and tp
    are this run's, whatever its ``parallel.order``, else those of the same global rank.  Verify
    it first (:func:`~pipeflow.checkpoint.find.verify`).  With `storage` ``local`` each
    host's ranks read their host's part.  With no `optimizer` (generation:
    :mod:`pipeflow.commands.generate`) only the layers are loaded.

    Returns:
        The checkpoint's meta (``step``, layout, loss scale).

    Raises:
        CheckpointError: unreadable files (naming the path).
    """
    meta = read_meta(path)
    reader = SafeReader(path)
    saved = integrity.call_named(reader.read_metadata, f"reading checkpoint {path}").state_dict_metadata
    model = model_state(layers)
    _check_model(path, model, saved, per_host=storage == "local")
    optim = optimizer_state(optimizer, layers, fill=True) if optimizer is not None else {}
    if optimizer is not None and any(key not in saved for key in optim):  # saved before any optimizer step (e.g. all fp16 steps skipped)
        local_optimizer(optimizer).state.clear()
        optim = {}
    state, strided = whole_strided({**model, **optim}, gather=False)
    group = host_part().group if storage == "local" else None
    integrity.call_named(lambda: dcp.load(state, storage_reader=reader, process_group=group),
                         f"loading checkpoint {path}")
    for target, whole in strided:  # this rank's rows of each whole strided tensor, into its shard
        with torch.no_grad():
            local(target).copy_(rows_of(whole, target))
    if meta.get("world_size") == dist.get_world_size():
        _load_rng(os.path.join(path, "rng", f"rank{saved_rank(meta, dist.get_rank(), grid)}.pt"))
    return meta


def saved_rank(meta: dict[str, Any], rank: int, grid: MeshGrid | None) -> int:
    """The global rank that held this rank's mesh coordinates in the run that saved `meta`: the
    same coordinates under the saved ``parallel.order`` where the saved degrees are `grid`'s
    (checkpoints written before the order was recorded were in the default order), else `rank`."""
    if grid is None or (meta.get("dp"), meta.get("pp"), meta.get("tp", 1)) != (grid.dp, grid.pp, grid.tp):
        return rank
    saved = MeshGrid(grid.dp, grid.pp, grid.tp, tuple(meta.get("order", DEFAULT_ORDER)))
    return saved.rank(*grid.coordinates(rank))


def saved_layout(meta: dict[str, Any]) -> str:
    """The process layout a checkpoint's meta records, for the resume line:
    ``dp=1, pp=2, tp=2, shard=none (4 processes)``.  tp is the meta's own, else the saved world
    size over dp x pp (checkpoints written before it was recorded)."""
    dp, pp, world = meta.get("dp"), meta.get("pp"), meta.get("world_size")
    tp = meta.get("tp")
    if tp is None and isinstance(world, int) and isinstance(dp, int) and isinstance(pp, int) and dp * pp > 0:
        tp = world // (dp * pp)
    parts = [f"dp={dp}", f"pp={pp}", f"tp={tp if tp is not None else 'unknown'}", f"shard={meta.get('shard', 'none')}"]
    return ", ".join(parts) + (f" ({world} processes)" if world is not None else "")


def _load_rng(file: str) -> None:
    """Restore the RNG states saved in `file` (tensors only: ``weights_only=True``)."""
    if not os.path.isfile(file):
        log.warning("%s is missing: this rank's random state is not restored (dropout and other "
                    "random layers will draw other numbers than an uninterrupted run)", file)
        return
    saved = integrity.call_named(lambda: torch.load(file, weights_only=True), f"reading RNG state {file}")
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])


def _check_model(path: str, model: dict[str, torch.Tensor], saved: dict[str, Any], per_host: bool = False) -> None:
    """Raise on every rank (agreed by one all-gather) if any rank's model entries are missing
    from the checkpoint (`per_host`, local storage: from its host's part) or have another shape,
    naming the first such rank and entries."""
    bad = sorted(k for k, v in model.items() if k not in saved or tuple(saved[k].size) != tuple(v.shape))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad)
    culprit = next((r for r, keys in enumerate(everyone) if keys), None)
    if culprit is not None:
        keys = everyone[culprit]
        if per_host:
            raise ConfigError(
                f"rank {culprit}{hosts.of_ranks([culprit])}: its host's part of checkpoint {path} has no "
                f"{', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} (train.checkpoint_storage=local: each host holds "
                f"only what its own ranks saved, and this host's ranks now hold other layers); resume with the hosts "
                f"in the order that saved it, or gather the parts (python -m pipeflow.checkpoint gather) and resume "
                f"from the merged checkpoint")
        if LORA_BASE in read_meta(path):  # saved by a LoRA run: its adapters only, the base named
            raise ConfigError(
                f"checkpoint {path} holds LoRA adapters only (the base they were trained on is named in its "
                f"meta.json, not saved), and this run has no model.lora: resume it with the model.lora it was trained "
                f"with, or merge it (python -m pipeflow.checkpoint export --format hf --merge-lora {path} <folder>) and "
                f"start from that folder (model.path=<folder>)")
        raise ConfigError(
            f"rank {culprit}: checkpoint {path} has no {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} "
            f"of this shape ({len(keys)} of that rank's model entries missing or reshaped): it was saved from "
            f"another model; resume with the model config it was trained with"
        )
