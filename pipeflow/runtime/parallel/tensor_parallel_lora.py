"""``parallel.tp`` with ``model.lora``: a peft ``lora.Linear`` split over the tp ranks as its base
Linear is, Megatron's way.

The plan names the Linear peft wrapped (``self_attn.q_proj``); its style is applied to the whole
wrapper, so the base weight and the adapter beside it split together:

- a column split (``colwise``, ``colwise_whole``, ``colwise_qkv``): the base weight's rows and
  ``lora_B``'s rows (the output features) split alike; ``lora_A`` (rank x input) whole on every
  tp rank.  ``y_t = W_t x + s B_t (A x)``: the output features of rank t, no extra collective.
- a row split (``rowwise``): the base weight's columns and ``lora_A``'s columns (the input
  features) split alike; ``lora_B`` whole.  ``y = sum_t (W_t x_t + s B (A_t x_t))``: the adapter's
  partial sums ride in the base's own all-reduce (or reduce-scatter, with sequence parallelism).

The whole factor (``A`` of a column split, ``B`` of a row split) is a plain tensor, as a norm's
weight is: its forward is the same on every tp rank, but each rank's gradient is only its share
(the output features, or the input features, it holds), so its use sums its gradient over the tp
ranks (Megatron's "copy to the tensor-parallel region": identity forward, all-reduce backward).
That keeps every parameter's gradient complete where autograd accumulates it, for a full
backward, the weight half (W) of a split one and FSDP2 alike.  The base weights are frozen.
Dropout on the adapters' input (``model.lora.dropout``) draws its mask on each rank: with a
column split each rank's output features see their own mask, an equally valid dropout.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from pipeflow.errors import LoraError

COLUMN_STYLES = ("colwise", "colwise_whole", "colwise_qkv")
ROW_STYLES = ("rowwise",)


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is a peft LoRA layer wrapping a Linear (``base_layer``, ``lora_A``, ``lora_B``)."""
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "lora_B", "scaling"))


def lora_split(style: str, between: Any, where: str) -> Any:
    """The parallel style that splits a peft ``lora.Linear`` as `style` splits its base Linear.

    Args:
        style: the plan's style for the wrapped Linear (pipeflow's names).
        between: the activations' layout between modules (``Shard(1)`` with sequence parallelism,
            else ``Replicate()``).
        where: ``layer 'name', module 'path'``, for the error.

    Raises:
        LoraError: a style a LoRA layer cannot be split by (the output head's ``colwise_out``:
            LoRA on the head is out of scope).
    """
    if style in COLUMN_STYLES:
        rows = _StridedShard(0, split_factor=3) if style == "colwise_qkv" else Shard(0)
        return _LoraColumn(Replicate() if style == "colwise_whole" else between, rows)
    if style in ROW_STYLES:
        return _LoraRow(between)
    raise LoraError(f"{where}: model.lora adapts a Linear that parallel.tp splits as {style!r}, which LoRA cannot "
                    f"be split by (column and row splits can); leave that module out of model.lora.targets")


def _parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Module, float]:
    """(base Linear, lora_A, lora_B, dropout, scaling) of the one adapter pipeflow injects."""
    from pipeflow.models.lora import ADAPTER

    if set(module.lora_A) != {ADAPTER} or getattr(module, "lora_variant", {}):
        raise LoraError(f"a {type(module).__name__} with adapters {sorted(module.lora_A)} (or a LoRA variant such "
                        f"as DoRA): parallel.tp splits only the one plain adapter model.lora injects")
    if module.lora_A[ADAPTER].bias is not None or module.lora_B[ADAPTER].bias is not None:
        raise LoraError("LoRA adapters with biases (peft's lora_bias): parallel.tp splits bias-free adapters only")
    return (module.base_layer, module.lora_A[ADAPTER], module.lora_B[ADAPTER], module.lora_dropout[ADAPTER],
            float(module.scaling[ADAPTER]))


def _distribute(module: nn.Module, name: str, mesh: Any, placement: Any) -> None:
    """Replace `module`'s parameter `name` by a DTensor of it over `mesh` (this rank's part kept)."""
    param = getattr(module, name)
    if param is not None:
        split = distribute_tensor(param.detach(), mesh, [placement])
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))


def _summed_grad(weight: torch.Tensor, mesh: Any) -> torch.Tensor:
    """`weight` as it is, its gradient summed over the tp ranks of `mesh` in the backward."""
    return DTensor.from_local(weight, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _LoraColumn(ParallelStyle):
    """A LoRA layer whose base Linear splits its output features (see the module's docstring)."""

    def __init__(self, input_layout: Any, rows: Any) -> None:
        super().__init__()
        self.input_layout, self.rows = input_layout, rows

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        base, lora_a, lora_b, dropout, scaling = _parts(module)
        for part, name in ((base, "weight"), (base, "bias"), (lora_b, "weight")):
            _distribute(part, name, device_mesh, self.rows)
        layout = self.input_layout

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # the input whole on every tp rank, its gradient the sum of the ranks' (Megatron's f)
            whole = DTensor.from_local(x, device_mesh, [layout], run_check=False).redistribute(
                device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            out = F.linear(whole, base.weight.to_local(), _local(base.bias))
            low = F.linear(dropout(whole.to(lora_a.weight.dtype)), _summed_grad(lora_a.weight, device_mesh))
            return out + (F.linear(low, lora_b.weight.to_local()) * scaling).to(out.dtype)

        module.forward = forward
        return module


class _LoraRow(ParallelStyle):
    """A LoRA layer whose base Linear splits its input features (see the module's docstring)."""

    def __init__(self, output_layout: Any) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        base, lora_a, lora_b, dropout, scaling = _parts(module)
        _distribute(base, "weight", device_mesh, Shard(1))
        _distribute(lora_a, "weight", device_mesh, Shard(1))
        layout = self.output_layout

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            partial = F.linear(x, base.weight.to_local())  # x: this rank's input features
            low = F.linear(dropout(x.to(lora_a.weight.dtype)), lora_a.weight.to_local())
            lora_weight = _summed_grad(lora_b.weight, device_mesh)
            partial = partial + (F.linear(low, lora_weight) * scaling).to(partial.dtype)
            out = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False).redistribute(
                device_mesh, [layout]).to_local()
            return out if base.bias is None else out + base.bias  # whole (frozen): added once, after the sum

        module.forward = forward
        return module
