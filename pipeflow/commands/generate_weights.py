"""The weights generation runs (:mod:`pipeflow.commands.generate`): this rank's layers loaded from a
checkpoint by index, a full run's weights or a LoRA run's adapters over the base it names, the
adapters then merged into the base weights."""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from pipeflow.errors import CheckpointError, ConfigError


def load_weights(cfg: DictConfig, spec: Any, path: str, layers: dict[int, Any]) -> None:
    """This rank's `layers` (by index) loaded from checkpoint `path`: a full run's weights, or a
    LoRA run's adapters over the base ``model.path`` holds, which must be the one the checkpoint
    names (its recorded digest; collective, as every load is).

    Raises:
        CheckpointError: a damaged checkpoint, or a LoRA one over another base.
        ConfigError: a LoRA checkpoint without ``model.lora`` in the config, or the reverse.
    """
    from pipeflow.checkpoint import lora_base
    from pipeflow.checkpoint.saving import load, read_meta, verify

    base = read_meta(path).get(lora_base.LORA_BASE)
    if base is not None and spec.lora is None:
        raise ConfigError(f"{path} holds LoRA adapters, but the config has no model.lora: give the run's config.yaml "
                          f"(train.resume=<checkpoint> reads it) or its model.lora.* overrides")
    if base is None and spec.lora is not None:
        raise ConfigError(f"{path} holds a full run's weights, not LoRA adapters: set model.lora.rank=0")
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(problem)
    load(path, layers if base is None else lora_base.trainable(layers), None)
    if base is not None:
        lora_base.check(base, cfg.model, path)


def merge_adapters(layers: dict[int, Any]) -> None:
    """Each LoRA layer's adapters merged into its base weight (peft's ``merge()``), so decoding
    runs the plain Linear: what ``--format hf --merge-lora`` writes, and no adapter matmuls."""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for layer in layers.values():
            for module in layer.modules():
                if isinstance(module, LoraLayer):
                    module.merge()
