"""The names a checkpoint's tensors go under, whatever the layout (see :mod:`pipeflow.checkpoint.saving`):
layer i's ``state_dict()`` entries as ``model.layers.<i>.<key>``, its AdamW state as
``optim.layers.<i>.<param>.<field>``, strided tensor-parallel shards made whole for DCP.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from pipeflow.errors import ConfigError
from pipeflow.models.hf_experts import expert_shard
from pipeflow.runtime.parallel.fsdp import local, strided
from pipeflow.runtime.parallel.tensor_parallel import gathered
from pipeflow.runtime.parallel.zero import local_optimizer, parameter_of

ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq")


def param_names(layers: dict[int, nn.Module]) -> dict[int, list[str]]:
    """Every global name (``layers.<i>.<name>``) of each parameter, keyed by the parameter's id."""
    names: dict[int, list[str]] = {}
    for i, layer in sorted(layers.items()):
        for name, p in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"layers.{i}.{name}")
    return names


def model_state(layers: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """Layer i's ``state_dict()`` under ``model.layers.<i>.<key>`` (tensors share the layers' storage;
    a Hugging Face experts tensor split by ``parallel.ep`` as the slice of the whole it is)."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in layers.items():
        params = dict(layer.named_parameters())
        for k, v in layer.state_dict().items():
            out[f"model.layers.{i}.{k}"] = _like(params[k], v) if k in params else v
    return out


def optimizer_state(optimizer: torch.optim.Optimizer, layers: dict[int, nn.Module], fill: bool) -> dict[str, torch.Tensor]:
    """AdamW state under ``optim.<param name>.<field>``, every name of a parameter when saving.

    Only the state this rank holds: with ``parallel.shard=optimizer`` (ZeRO-1) that of the
    parameters it owns, so every entry is saved from, and loaded into, its owner alone.  With
    `fill` (loading), missing state is created as zeros to be loaded into, and each parameter
    appears under its first name only.
    """
    names = param_names(layers)
    held = local_optimizer(optimizer)
    out: dict[str, torch.Tensor] = {}
    for group in held.param_groups:
        for p in group["params"]:
            state = held.state[p]
            if fill and not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            if not state:
                continue
            if sorted(state) != sorted(ADAM_FIELDS):
                raise ConfigError(f"checkpoints support AdamW state {ADAM_FIELDS}; found {sorted(state)}")
            param = parameter_of(optimizer, p)  # ZeRO over tp shards: the view's DTensor parameter
            fields = {field: _like(param, state[field]) for field in ADAM_FIELDS}
            for name in names[id(param)][:1] if fill else names[id(param)]:
                out.update({f"optim.{name}.{field}": fields[field] for field in ADAM_FIELDS})
    return out


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A tensor (a parameter's value, its AdamW state) as its parameter holds it: a local shard of
    a DTensor parameter becomes a DTensor of the same placement, and so does a slice of a Hugging
    Face experts tensor split by ``parallel.ep`` (sharded on the expert dimension over the ep
    group); each shares its storage, so a load writes into it."""
    if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.dim() > 0:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    shard = expert_shard(param)
    if shard is not None and value.dim() > 0:
        group, shape = shard
        return DTensor.from_local(value, _mesh(group, value.device.type), [Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
    return value


_MESHES: dict[tuple[int, str], DeviceMesh] = {}


def _mesh(group: Any, device_type: str) -> DeviceMesh:
    """The device mesh of process group `group` (made once)."""
    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def whole_strided(state: dict[str, torch.Tensor], gather: bool) -> tuple[dict[str, Any], list[tuple[Any, Any]]]:
    """`state` with every strided-shard DTensor (a fused [q; k; v] weight split over tp: rank t
    holds rows t of each third) as a whole tensor, since DCP describes a shard as one block of
    rows and would see the ranks' blocks overlap.  Saving (`gather`): the whole values, gathered
    over the tp group (collective; tp peers and dp replicas hold the same, DCP writes it once).
    Loading: empty whole buffers, with the (DTensor, buffer) pairs to copy back after the load."""
    out: dict[str, Any] = {}
    pairs: list[tuple[Any, Any]] = []
    for key, value in state.items():
        if isinstance(value, DTensor) and any(strided(p) is not None for p in value.placements):
            device = local(value).device
            whole = gathered(value) if gather else torch.empty(value.shape, dtype=value.dtype, device=device)
            out[key] = whole
            pairs.append((value, whole))
        else:
            out[key] = value
    return out, pairs
