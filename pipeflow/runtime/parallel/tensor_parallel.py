"""``parallel.tp``: each stage's layers split over the tp ranks of the stage with DTensor parallel styles.

A model says how its layers split (``ModelSpec.tp_plan``: submodule path -> a style of
:data:`pipeflow.models.spec.TP_STYLES`); this module turns the styles into torch's
``torch.distributed.tensor.parallel`` styles over the stage's tp mesh and applies them to the
built layers.  Linear weights become DTensors sharded over the tp ranks; what a style leaves
whole (norms without sequence parallelism, position embeddings) stays a plain, replicated
tensor whose gradient is the same on every tp rank.  Between layers (and stages) activations
are plain local tensors: whole on every tp rank, or with ``parallel.sequence_parallel`` this
rank's slice of the sequence (dimension 1), which is also what crosses a stage boundary.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models.spec import ModelSpec
from pipeflow.runtime.parallel.fsdp import strided
from pipeflow.runtime.parallel.tensor_parallel_lora import is_lora_linear, lora_split

SEQUENCE_DIM = 1  # activations are (batch, sequence, ...)


def _styles(sequence_parallel: bool) -> dict[str, Any]:
    """pipeflow's style names -> torch's parallel styles (None: nothing to do without sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    between = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()  # the activations between modules
    return {
        "colwise": ColwiseParallel(input_layouts=between),
        "colwise_qkv": _fused_qkv_colwise(between),
        "rowwise": RowwiseParallel(output_layouts=between),
        "colwise_out": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "norm": SequenceParallel(use_local_output=True) if sequence_parallel else None,
        "norm_gathered": _norm_gathered() if sequence_parallel else None,
        "colwise_whole": ColwiseParallel(input_layouts=Replicate()),
        "sequence_out": "sequence_out" if sequence_parallel else None,  # a hook: see _cut_sequence
    }


def _norm_gathered() -> Any:
    """SequenceParallel on a norm, its output then gathered whole over the tp ranks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput, SequenceParallel

    class NormGathered(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            SequenceParallel(use_local_output=False)._apply(module, device_mesh)
            return PrepareModuleOutput(output_layouts=Shard(SEQUENCE_DIM), desired_output_layouts=Replicate(),
                                       use_local_output=True)._apply(module, device_mesh)

    return NormGathered()


def _cut_sequence(tp_mesh: Any) -> Any:
    """A forward hook giving the layer's first output (whole on every tp rank) as this rank's slice
    of the sequence, through DTensor (Replicate -> Shard), so its backward gathers the slices'
    gradients into the whole one again; other outputs (document ids) pass whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        first, rest = (output[0], tuple(output[1:])) if isinstance(output, tuple) else (output, None)
        cut = DTensor.from_local(first, tp_mesh, [Replicate()], run_check=False).redistribute(
            tp_mesh, [Shard(SEQUENCE_DIM)]).to_local()
        return cut if rest is None else (cut, *rest)

    return hook


def _fused_qkv_colwise(input_layout: Any) -> Any:
    """ColwiseParallel for a Linear whose output rows are [q; k; v]: each third split alike, so tp
    rank t holds rows t of q, of k and of v (the same heads of each).

    The weight (and bias) is a DTensor ``_StridedShard(0, split_factor=3)``, whole in checkpoints;
    the forward multiplies by the local rows directly (DTensor's own matmul would relabel the
    output as a contiguous split of [q; k; v]), the input made whole first (all-gathered from
    sequence slices), its gradient summed over the tp ranks (Megatron's f).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedQKVColwise(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            for pname, param in list(module.named_parameters(recurse=False)):
                sharded = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=3)])
                module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))

            def forward(x: torch.Tensor) -> torch.Tensor:
                whole = DTensor.from_local(x, device_mesh, [input_layout], run_check=False).redistribute(
                    device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
                bias = module.bias.to_local() if module.bias is not None else None
                return nn.functional.linear(whole, module.weight.to_local(), bias)

            module.forward = forward
            return module

    return FusedQKVColwise()


def _check_divisible(layer_name: str, path: str, style: str, module: nn.Module, tp: int) -> None:
    """Raise ConfigError when `style` would split a dimension of `module` that tp does not divide."""
    weight = getattr(module, "weight", None)
    if weight is None or style in ("norm", "norm_gathered", "sequence_out"):
        return
    dims = {"colwise": (0, 1), "colwise_whole": (0, 1), "colwise_out": (0, 1), "embedding": (0, 1), "rowwise": (1, 1),
            "colwise_qkv": (0, 3)}
    dim, parts = dims[style]
    size = weight.shape[dim] // parts
    if size % tp:
        what = "rows" if dim == 0 else "columns"
        raise ConfigError(f"layer {layer_name!r}, module {path or '(the layer)'!r} ({style}): its {size} weight {what}"
                          f"{' per third' if parts == 3 else ''} are not divisible by parallel.tp={tp}; choose a tp "
                          f"that divides {size}")


def parallelize_layer(spec: ModelSpec, index: int, layer: nn.Module, tp_mesh: Any, sequence_parallel: bool) -> int:
    """Split built layer `index` over `tp_mesh` by the model's plan; returns how many modules were split.

    Raises:
        ConfigError: the model has no plan, a style names no module of the layer, or a size the
            degree does not divide.
        LoraError: a ``model.lora`` adapter on a module split by a style LoRA cannot follow.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    name = spec.layers[index].name
    plan = spec.tensor_plan(index, layer, tp)
    styles = _styles(sequence_parallel)
    between = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()
    chosen = {}
    for path, style in plan.items():
        try:
            module = layer.get_submodule(path)  # "": the layer itself
        except AttributeError:
            raise ConfigError(f"layer {name!r}: the tensor-parallel plan names {path!r}, which is not a submodule "
                              f"of {type(layer).__name__}") from None
        _check_divisible(name, path, style, module, tp)
        if is_lora_linear(module) and styles[style] is not None:  # model.lora: the adapter splits with its base
            chosen[path] = lora_split(style, between, f"layer {name!r}, module {path!r}")
        elif styles[style] is not None:
            chosen[path] = styles[style]
    if sequence_parallel and not any(style in ("norm", "norm_gathered", "sequence_out") for style in plan.values()):
        raise ConfigError(f"layer {name!r}: the model's tensor-parallel plan has no 'norm' or 'sequence_out' entry, so "
                          f"it does not run on a slice of the sequence; set parallel.sequence_parallel=false")
    own = {path: style for path, style in chosen.items() if not isinstance(style, str)}
    if own:
        frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
        parallelize_module(layer, tp_mesh, own)
        for n, p in layer.named_parameters():  # torch's styles make new Parameters, trainable (model.lora freezes)
            p.requires_grad_(n not in frozen)
    for path, style in chosen.items():
        if style == "sequence_out":
            layer.get_submodule(path).register_forward_hook(_cut_sequence(tp_mesh))
    return len(chosen)


def parallelize_stages(spec: ModelSpec, stages: dict, ranges: list[range], tp_mesh: Any, sequence_parallel: bool,
                       shard: str = "none") -> int:
    """Split every layer of this rank's `stages` over its tp mesh (before FSDP2 and ties); returns
    the number of modules split.  Every split parameter's gradient is kept in the parameter's own
    placement (:func:`like_param`) as autograd accumulates it.

    Raises:
        ConfigError: as :func:`parallelize_layer`.
    """
    split = sum(parallelize_layer(spec, i, layer, tp_mesh, sequence_parallel)
                for s, stage in stages.items() for i, layer in zip(ranges[s], stage.module))
    from torch.distributed.tensor import DTensor

    for stage in stages.values():
        for p in stage.parameters():
            if isinstance(p, DTensor) and p.requires_grad:
                p.register_post_accumulate_grad_hook(_align_grad)
    return split


def tensor_parallel_ranks(stages: Iterable[Any]) -> list[int] | None:
    """The global ranks of the tp group that `stages`' parameters are split over (None: no
    parameter is split over a mesh dimension named ``tp``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for stage in stages:
        for param in stage.parameters():
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
                return list(dist.get_process_group_ranks(mesh.get_group("tp")))
    return None


def _align_grad(param: torch.Tensor) -> None:
    param.grad = like_param(param, param.grad)


def like_param(param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """`grad` in `param`'s DTensor placement.  DTensor's backward may return another one (an
    embedding's row-split weight gets a whole, Replicate gradient); the reductions that follow
    (data parallel, ties, the norm) work on local shards, which must be the parameter's."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(grad, DTensor) and isinstance(param, DTensor)):
        return grad
    if grad.device_mesh is not param.device_mesh:  # a compiled graph's gradient: an equal mesh, another object
        grad = DTensor.from_local(grad.to_local(), param.device_mesh, grad.placements, run_check=False,
                                  shape=grad.shape, stride=grad.stride())
    if tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _qkv_dim(tensor: Any) -> int | None:
    """The mesh dimension over which DTensor `tensor` is split as a fused [q; k; v] (``colwise_qkv``:
    a strided shard of factor 3), None for any other tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    return next((i for i, p in enumerate(tensor.placements) if strided(p) == 3), None)


def is_fused_qkv(tensor: Any) -> bool:
    """True for a DTensor split as a fused [q; k; v] over the tp ranks (``colwise_qkv``)."""
    return _qkv_dim(tensor) is not None


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole on every rank of its mesh (collective), a plain tensor as it is.

    A fused [q; k; v] split (also under FSDP2, which cuts each tp rank's rows into dp chunks) is
    gathered by hand: DTensor's own redistribution of the nested strided placements returned
    rows in the wrong order (torch 2.14)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    if not is_fused_qkv(tensor):
        return tensor.full_tensor()
    import torch.distributed as dist

    mesh, block, tp_dim = tensor.device_mesh, tensor.to_local().detach(), _qkv_dim(tensor)
    for i in range(mesh.ndim):  # the dp chunks of this tp rank's rows, in order
        if i != tp_dim and hasattr(tensor.placements[i], "dim"):
            parts = [torch.empty_like(block) for _ in range(mesh.size(i))]
            dist.all_gather(parts, block.contiguous(), group=mesh.get_group(i))
            block = torch.cat(parts)
    blocks = [torch.empty_like(block) for _ in range(mesh.size(tp_dim))]
    dist.all_gather(blocks, block.contiguous(), group=mesh.get_group(tp_dim))
    return torch.cat([torch.cat([b.chunk(3)[j] for b in blocks]) for j in range(3)])  # [q; k; v]


def rows_of(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's local part of `whole` as DTensor `like` holds it (the inverse of :func:`gathered`
    for a fused [q; k; v] split, with FSDP2's dp chunks; no communication)."""
    from torch.distributed.tensor import distribute_tensor

    if not is_fused_qkv(like):
        return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
    mesh, tp_dim = like.device_mesh, _qkv_dim(like)
    t = mesh.get_local_rank(tp_dim)
    block = torch.cat([third.chunk(mesh.size(tp_dim))[t] for third in whole.chunk(3)])
    for i in range(mesh.ndim):
        if i != tp_dim and hasattr(like.placements[i], "dim"):
            block = block.chunk(mesh.size(i))[mesh.get_local_rank(i)]
    return block
