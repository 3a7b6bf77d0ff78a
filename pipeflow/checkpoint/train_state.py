"""What a training run saves and resumes: this rank's layers (a LoRA run's adapters only), the
optimizer, the loss scale and the layout they were saved with (see :mod:`pipeflow.checkpoint.saving`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from pipeflow.errors import CheckpointPeerLostError, NonFiniteError
from pipeflow.checkpoint import saving as checkpoint, replicas as checkpoint_replicas, integrity, lora_base
from pipeflow.checkpoint.background import BackgroundSaver
from pipeflow.runtime import finite as nonfinite
from pipeflow.runtime.parallel.mesh import Mesh
from pipeflow.runtime.precision import LossScaler
from pipeflow.runtime.stage import Stage, layers_by_index

log = logging.getLogger("pipeflow")


@dataclass(frozen=True)
class TrainState:
    """This rank's share of the run's state and where it goes.

    Attributes:
        cfg: the resolved config (``model``, ``parallel.shard``, ``optim.lr`` and ``train.resume`` are read).
        mesh, stages, ranges, num_stages: the process mesh, this rank's stages, every stage's layers.
        optimizer, scaler: what is saved beside the layers.
        lora: True when only the adapters are trained (the frozen base is named, not copied).
        root, storage: ``<run_dir>/checkpoints`` and ``train.checkpoint_storage``.
        job: this job's token (the run directory's lock), or "".
    """

    cfg: DictConfig
    mesh: Mesh
    stages: dict[int, Stage]
    ranges: list[range]
    num_stages: int
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    lora: bool
    root: str
    storage: str
    job: str = ""
    batches_skipped: int = 0  # train.spike.action=rollback: training batches skipped so far (saved, restored)

    def _layers(self) -> dict[int, Any]:
        layers = layers_by_index(self.stages, self.ranges)
        return lora_base.trainable(layers) if self.lora else layers

    def save(self, step: int, device: torch.device, saver: BackgroundSaver | None = None) -> Any:
        """Write ``<root>/step_<step>`` (collective; see :func:`pipeflow.checkpoint.saving.save`); returns its folder.
        With `saver` (``train.checkpoint_mode=async*``) stage it for the background writer and
        return ``(its folder, the report of the save waited for)``
        (:meth:`~pipeflow.checkpoint.background.BackgroundSaver.save`).

        Raises:
            NonFiniteError: a weight holds NaN or Inf (nothing is written; ``latest`` stays).
        """
        flags = nonfinite.param_flags(self.stages, self.num_stages, device)
        try:
            dist.all_reduce(flags)
        except RuntimeError as exc:  # gloo/NCCL: a peer died or was stopped before the save
            raise CheckpointPeerLostError(
                f"checkpoint of step {step} not written: a peer stopped taking part while the ranks checked their "
                f"weights before it {checkpoint.PEER_GONE}: {integrity.describe(exc, dist.get_rank())[0][1]}; "
                f"nothing was written, latest is untouched") from exc
        bad = [s for s, flag in enumerate(flags.tolist()) if flag > 0]
        if bad:
            raise NonFiniteError(
                f"checkpoint of step {step} not written: the weights of stage(s) {bad} hold NaN or Inf after the "
                f"optimizer step (optim.lr={self.cfg.optim.lr} too large?); latest still names the last good checkpoint"
            )
        meta = {"dp": self.mesh.dp, "pp": self.mesh.pp, "tp": self.mesh.tp, "cp": self.mesh.cp,
                "order": list(self.mesh.grid.order),
                "shard": self.cfg.parallel.shard, "scaler": self.scaler.state_dict(),
                "batches_skipped": self.batches_skipped}
        if self.lora:  # the adapters only; the frozen base named, not copied
            meta[lora_base.LORA_BASE] = lora_base.record(self.cfg.model)
        if saver is not None:
            return saver.save(self.root, step, self._layers(), self.optimizer, meta, job=self.job,
                              keep_last=self.cfg.train.keep_last, replicas=self.cfg.train.checkpoint_replicas)
        return checkpoint.save(self.root, step, self._layers(), self.optimizer, meta, job=self.job,
                               storage=self.storage, keep_last=self.cfg.train.keep_last,
                               replicas=self.cfg.train.checkpoint_replicas)

    def resume(self, announce: bool, source: str | None = None) -> tuple[int, str, int] | None:
        """Load the checkpoint ``train.resume`` (or `source`) names, if any; returns (its step, its
        folder, the training batches skipped by then), or None.

        Every candidate is verified first (digests).  With ``auto`` a damaged checkpoint is
        skipped, with a warning naming the bad file, for the previous good one.

        Args:
            announce: log what was resumed (rank 0).

        Raises:
            CheckpointError: an explicitly named checkpoint is damaged (naming the file).
        """
        assembled = False
        if self.storage == "local":  # the hosts' own parts, or one assembled from what they hold
            path, assembled = checkpoint_replicas.choose(source or self.cfg.train.resume, self.root)
        else:
            path = checkpoint.choose(source or self.cfg.train.resume, self.root)
        if path is None:
            return None
        meta = checkpoint.load(path, self._layers(), self.optimizer, "shared" if assembled else self.storage,
                               grid=self.mesh.grid)
        if assembled:
            checkpoint_replicas.discard(path)
        if lora_base.LORA_BASE in meta:
            lora_base.check(meta[lora_base.LORA_BASE], self.cfg.model, path)
        self.scaler.load_state_dict(meta["scaler"])
        if announce:
            log.info("resumed from checkpoint %s at step %d (saved with %s)", path, meta["step"],
                     checkpoint.saved_layout(meta))
        return int(meta["step"]), path, int(meta.get("batches_skipped", 0))
