"""What a LoRA run's checkpoints hold: the adapters, and the base model named, not copied.

A checkpoint of a ``model.lora`` run holds the adapters and their AdamW state only (the trainer
hands :mod:`pipeflow.checkpoint.saving` each layer as :class:`Trainable`, whose state dict is its
parameters that train, so DCP saves and loads them in any layout as it does full weights); its
``meta.json`` names the base under ``lora_base``: ``model.path`` (and ``model.init_from``) with
a SHA-256 digest of the weight files the base was loaded from (every ``*.safetensors`` of the
folder and its index, or the ``init_from`` file), so resuming and ``--merge-lora`` read the
same base and refuse another. The digest is taken once per process by rank 0 (one read of the
weights) and shared with one broadcast.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeflow.errors import CheckpointError

LORA_BASE = "lora_base"  # the key of meta.json naming the base
_known: dict[tuple, str] = {}  # (files, sizes, mtimes) -> digest, in this process


class Trainable:
    """A layer as a LoRA run's checkpoint holds it: ``state_dict()`` only its parameters that train
    (the same tensors, so a load writes into them), ``named_parameters`` the layer's own."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The layer's state dict less every entry of a frozen parameter (and buffers)."""
        trains = {name for name, p in self.layer.named_parameters(remove_duplicate=False) if p.requires_grad}
        return {key: value for key, value in self.layer.state_dict().items() if key in trains}

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's own (the optimizer state is named by them)."""
        return self.layer.named_parameters(*args, **kwargs)


def trainable(layers: dict[int, nn.Module]) -> dict[int, Any]:
    """`layers` by global index as a LoRA run's checkpoint holds them (:class:`Trainable`)."""
    return {i: Trainable(layer) for i, layer in layers.items()}


def weight_files(path: str | None, init_from: str | None) -> list[str]:
    """The files the base's weights were read from: `init_from` (a file, or every file of a DCP
    folder), else the ``*.safetensors`` files and index of `path`."""
    source = init_from or path
    if not source:
        return []
    if os.path.isfile(source):
        return [source]
    if not os.path.isdir(source):
        return []
    names = sorted(os.listdir(source))
    if not init_from:
        names = [n for n in names if n.endswith(".safetensors") or n.endswith(".safetensors.index.json")]
    return [os.path.join(source, n) for n in names if os.path.isfile(os.path.join(source, n))]


def digest(files: list[str]) -> str:
    """SHA-256 over `files` (their names relative to their folder, then their bytes), cached by
    their sizes and modification times."""
    stats = tuple((f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files)
    if stats not in _known:
        total = hashlib.sha256()
        for f in files:
            total.update(os.path.basename(f).encode() + b"\0")
            with open(f, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    total.update(block)
        _known[stats] = total.hexdigest()
    return _known[stats]


def record(model_cfg: Any) -> dict[str, Any]:
    """``{"path", "init_from", "digest"}`` of the run's base (collective when a process group is up:
    rank 0 reads the weights, every rank gets its answer)."""
    path, init_from = model_cfg.get("path"), model_cfg.get("init_from")
    mine = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        files = weight_files(path, init_from)
        mine = {"path": os.path.abspath(path) if path else None,
                "init_from": os.path.abspath(init_from) if init_from else None,
                "digest": digest(files) if files else None}
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [mine]
        dist.broadcast_object_list(shared, src=0)
        mine = shared[0]
    return mine  # type: ignore[return-value]


def check(saved: dict[str, Any], model_cfg: Any, checkpoint: str) -> None:
    """Refuse to resume LoRA adapters over another base than the one they were trained on
    (collective, as :func:`record`).

    Raises:
        CheckpointError: the weights' digest differs (naming both paths and what to do).
    """
    now = record(model_cfg)
    if saved.get("digest") and now.get("digest") and saved["digest"] != now["digest"]:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds LoRA adapters trained on the base {saved.get('path')} (weights digest "
            f"{saved['digest'][:12]}), but model.path={now.get('path')} has other weights (digest "
            f"{now['digest'][:12]}); resume with model.path set to the base the adapters were trained on")
