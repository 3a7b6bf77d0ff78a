"""Exports of a LoRA run's checkpoint (adapters only, the base named in its meta): a PEFT adapter
folder, or the base with the adapters merged in.

- ``--format peft``: ``adapter_config.json`` (peft's ``LoraConfig`` of ``model.lora``: the targets
  as a list of module names, or globs as one regular expression over the module paths;
  ``base_model_name_or_path`` the
  base's ``model.path``) and ``adapter_model.safetensors`` under peft's names
  (``base_model.model.<module path>.lora_A.weight``), so
  ``peft.PeftModel.from_pretrained(base, <folder>)`` adapts the whole model as it was trained.
- ``--format hf --merge-lora``: the base read from where the checkpoint's meta says (checked
  against its recorded digest), each layer built with its adapters loaded and merged by peft's
  own ``merge()``, written under the base model's names as ``--format hf`` writes a full run:
  ``AutoModelForCausalLM.from_pretrained(<folder>)`` loads the fine-tuned model.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from pipeflow.errors import CheckpointError, ConfigError
from pipeflow.models.lora import ADAPTER, base_key
from pipeflow.models.spec import ModelSpec
from pipeflow.checkpoint import lora_base
from pipeflow.checkpoint.find import read_meta

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def base_of(path: str) -> dict[str, Any] | None:
    """The base a LoRA checkpoint names (``{"path", "init_from", "digest"}``); None for a full one."""
    return read_meta(path).get(lora_base.LORA_BASE)


def peft_name(key: str) -> str | None:
    """A layer's state-dict `key` as peft saves an adapter (``...q_proj.lora_A.default.weight`` ->
    ``base_model.model....q_proj.lora_A.weight``); None for what is not an adapter's."""
    if ".lora_" not in f".{key}":
        return None
    return "base_model.model." + key.replace(f".{ADAPTER}.", ".")


def _lora_spec(path: str, spec: ModelSpec | None, why: str) -> ModelSpec:
    if spec is None:
        raise CheckpointError(f"exporting LoRA adapters needs the model they were trained with, and {why}")
    if spec.lora is None:
        raise ConfigError(f"checkpoint {path} holds LoRA adapters but its run's config.yaml has no model.lora: the "
                          f"config.yaml beside it is not the one it was trained with")
    return spec


def adapter_folder(path: str, layers: dict[int, dict[str, torch.Tensor]], spec: ModelSpec | None,
                   why: str) -> tuple[Callable[[str], None], int]:
    """What the adapter folder of checkpoint `path` (its `layers`) holds: ``write(folder)`` and the
    number of tensors it writes.

    Raises:
        CheckpointError: no run config to learn the LoRA settings from; a checkpoint holding no adapters.
    """
    from safetensors.torch import save_file

    spec = _lora_spec(path, spec, why)
    if spec.export_name is None:
        raise ConfigError(f"--format peft writes adapters under the base model's own module names, and model "
                          f"{spec.name!r} (checkpoint {path}) has none (model=hf has): export with --merge-lora")
    tensors = {name: value.contiguous() for i in sorted(layers) for key, value in layers[i].items()
               if (name := peft_name(spec.export_name(i, key))) is not None}
    if not tensors:
        raise CheckpointError(f"checkpoint {path} holds no LoRA adapter tensors (lora_A/lora_B): it is not a "
                              f"model.lora run's; export it with --format hf or pt")
    config = spec.lora.peft_config(task_type="CAUSAL_LM", base_model_name_or_path=(base_of(path) or {}).get("path"))

    def write(folder: str) -> None:
        config.save_pretrained(folder)
        save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})

    return write, len(tensors)


def _real_spec(path: str, base: dict[str, Any], run_config: str) -> ModelSpec:
    """The run's model built for real (not on meta) over the base the checkpoint names, whose
    weight files are checked against the recorded digest first.

    Raises:
        CheckpointError: the base is gone or its weights differ from the recorded digest.
    """
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    files = lora_base.weight_files(base.get("path"), base.get("init_from"))
    if base.get("digest") and not files:  # (no digest: a base initialised from its config and seed)
        raise CheckpointError(f"--merge-lora reads the base the checkpoint {path} names, {base.get('path')}, which "
                              f"holds no weight files (*.safetensors) now; put the base model back there")
    if base.get("digest") and lora_base.digest(files) != base["digest"]:
        raise CheckpointError(f"the base {base.get('path')} has other weights than the adapters of {path} were "
                              f"trained on (digest {base['digest'][:12]} recorded); put that base back there")
    model_cfg = OmegaConf.load(run_config).model
    if "path" in model_cfg:
        model_cfg.path = base.get("path")
    if "init_from" in model_cfg:
        model_cfg.init_from = base.get("init_from")
    return instantiate(model_cfg)


def merged_layers(path: str, layers: dict[int, dict[str, torch.Tensor]], spec: ModelSpec | None,
                  why: str, run_config: str) -> tuple[dict[int, dict[str, torch.Tensor]], ModelSpec]:
    """Every layer of the base with checkpoint `path`'s adapters merged in (peft's ``merge()``),
    under the base's state-dict keys, one layer built at a time; and the model (built from the
    run's `run_config`, its ``config.yaml``, over the base the checkpoint names).

    Raises:
        CheckpointError: not a LoRA checkpoint; no run config; the base missing or changed; a
            layer's adapter missing from the checkpoint.
    """
    from peft.tuners.lora import LoraLayer

    _lora_spec(path, spec, why)
    base = base_of(path)
    if base is None:
        raise ConfigError(f"--merge-lora: checkpoint {path} is not a model.lora run's (its meta names no base); "
                          f"export it with --format hf")
    real = _real_spec(path, base, run_config)
    dtype = next((v.dtype for layer in layers.values() for v in layer.values()), torch.float32)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(len(real)):
        layer = real.build_layers([i], dtype=dtype)[0]
        wanted = {k for k, p in layer.named_parameters() if p.requires_grad}
        missing = sorted(wanted - set(layers.get(i, {})))
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks layer {i}'s adapter(s) {missing[:3]}: it was saved from "
                                  f"another model.lora; export with the config it was trained with")
        with torch.no_grad():
            for key in wanted:
                layer.get_parameter(key).copy_(layers[i][key])
            for module in layer.modules():
                if isinstance(module, LoraLayer):
                    module.merge()
        out[i] = {name: value.detach() for key, value in layer.state_dict().items()
                  if (name := base_key(key)) is not None}
    return out, real

