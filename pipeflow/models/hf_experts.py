"""Hugging Face mixture-of-experts layers under expert parallelism (``parallel.ep`` with ``model=hf``).

A family's config names its experts modules in ``base_model_ep_plan`` (``"layers.*.mlp.experts":
"ep_dispatch_experts"``): each holds every expert's weights fused along a leading expert
dimension (``gate_up_proj`` (E, ...), ``down_proj``, biases) and is called as
``experts(hidden (N, C), top_k_index (N, k), top_k_weights (N, k))``, returning the sum over each
token's k experts of weight x expert(token).  :func:`split_hf_experts` keeps this rank's E / ep
experts (a slice of every fused tensor) and sends each (token, expert) pair to the rank holding
the expert through pipeflow's own exchange (the ``all_to_all`` that DualPipeV's pairs overlap);
there the family's own experts forward runs on the local slice (expert j of its tokens, weight 1),
and the outputs come back to be weighted by the router and summed per token here, where the
router's weights live.

A split tensor is recorded (:func:`expert_shard`) so that checkpoints describe it as the slice
it is of the whole (a DTensor sharded on the expert dimension over the ep group): a checkpoint
holds each expert once and resumes under another ep.
"""
from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from pipeflow.errors import ConfigError
from pipeflow.models.moe import combine_experts

EP_DISPATCH = "ep_dispatch_experts"  # the ep plan's style of a module whose experts a rank splits
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # split parameter -> (group, its whole shape)
_READING: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("experts_read", default=None)
NARROWED = "_pipeflow_expert_slice"  # an experts module built with only its slice: (rank, ranks, experts)


def hf_experts_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of `layer` (a piece keeping the model's paths, ``model.layers.3``) its
    config's ``base_model_ep_plan`` marks ``ep_dispatch_experts``."""
    found = []
    for path, module in layer.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None) or {}
        if any(style == EP_DISPATCH and fnmatch.fnmatchcase(path, f"model.{key}") for key, style in plan.items()):
            found.append((path, module))
    return found


def unsplittable_experts(layer: nn.Module, splittable: Callable[[nn.Module], bool]) -> list[str]:
    """The parameters of `layer` named as routed experts' (``.experts.``) that no module expert
    parallelism splits holds: neither one `splittable` says it splits (pipeflow's MoE) nor an
    experts module of the config's ``base_model_ep_plan``; their gradients would be taken for
    split ones."""
    covered = {path for path, _ in hf_experts_modules(layer)}
    covered |= {path for path, module in layer.named_modules() if splittable(module)}
    return [name for name, _ in layer.named_parameters()
            if ".experts." in f".{name}" and not any(name.startswith(f"{path}.") for path in covered if path)]


def expert_shard(param: Tensor) -> tuple[Any, torch.Size] | None:
    """(the ep process group, the whole tensor's shape) of a parameter split along its experts, or
    None for any other."""
    return _SHARDS.get(param)


@contextlib.contextmanager
def reading_experts_of(rank: int, ranks: int) -> Iterator[None]:
    """While it lasts, layers built from a model folder hold and read only ep rank `rank`'s experts
    of `ranks` (:func:`narrow_experts`): a rank never holds, nor reads, the others'."""
    token = _READING.set((rank, ranks))
    try:
        yield
    finally:
        _READING.reset(token)


def _slice_of(path: str, experts: int, rank: int, ranks: int) -> tuple[int, int]:
    """Experts ``lo .. hi`` of ep rank `rank`.

    Raises:
        ConfigError: `ranks` does not divide the experts.
    """
    if experts % ranks:
        raise ConfigError(f"parallel.ep={ranks} does not divide the {experts} experts of {path}: each ep rank holds "
                          f"experts/ep of them; choose an ep that divides {experts}")
    per = experts // ranks
    return rank * per, (rank + 1) * per


def narrow_experts(layer: nn.Module) -> dict[str, tuple[int, int]]:
    """Under :func:`reading_experts_of`, make each experts module of `layer` (on the meta device,
    before its tensors are allocated) hold only this rank's slice of every fused parameter; returns
    ``{state dict key: (lo, hi)}``, the rows of the whole tensor each key is to be read from (empty:
    nothing narrowed).

    Raises:
        ConfigError: ep does not divide a module's experts, or a parameter is not fused along them.
    """
    reading = _READING.get()
    rows: dict[str, tuple[int, int]] = {}
    if reading is None:
        return rows
    rank, ranks = reading
    for path, module in hf_experts_modules(layer):
        experts = int(getattr(module, "num_experts"))
        lo, hi = _slice_of(path, experts, rank, ranks)
        for name, param in list(module.named_parameters(recurse=False)):
            _check_fused(path, name, param, experts)
            setattr(module, name, nn.Parameter(param.detach()[lo:hi], requires_grad=param.requires_grad))
            rows[f"{path}.{name}"] = (lo, hi)
        setattr(module, NARROWED, (rank, ranks, experts))
    return rows


def _check_fused(path: str, name: str, param: Tensor, experts: int) -> None:
    if param.dim() == 0 or param.shape[0] != experts:
        raise ConfigError(f"{path}.{name} has shape {list(param.shape)}, not fused along the {experts} experts: "
                          f"model=hf cannot split it for parallel.ep; use parallel.ep=1")


def split_hf_experts(path: str, module: nn.Module, rank: int, ranks: int, group: Any,
                     exchange: Callable[[Tensor, list[int], list[Callable[[Tensor], Tensor]]], Tensor]) -> None:
    """Keep experts ``rank * E / ranks ..`` of the Hugging Face experts `module` (at `path`) and
    route every token's experts through `exchange` (:class:`~pipeflow.runtime.parallel.expert_parallel.
    AllToAllExchange`: tokens sorted by global expert, the count per expert, this rank's experts).

    Raises:
        ConfigError: `ranks` does not divide the experts, or a parameter is not fused along them.
    """
    experts = int(getattr(module, "num_experts"))
    lo, hi = _slice_of(path, experts, rank, ranks)
    per = hi - lo
    narrowed = getattr(module, NARROWED, None)  # built with only this slice (read from the model folder)
    if narrowed is not None and narrowed != (rank, ranks, experts):
        raise RuntimeError(f"{path} was built with experts of ep rank {narrowed[0]} of {narrowed[1]}, but it is ep "
                           f"rank {rank} of {ranks} of its group: the ep ranks were counted differently")
    for name, param in list(module.named_parameters(recurse=False)):
        if narrowed is not None:
            local, whole = param, torch.Size([experts, *param.shape[1:]])
        else:
            _check_fused(path, name, param, experts)
            local = nn.Parameter(param.detach()[lo:hi].clone(), requires_grad=param.requires_grad)
            whole = param.shape
        _SHARDS[local] = (group, whole)
        setattr(module, name, local)
    local_experts = _LocalExperts(module, per)
    module._exchange = exchange  # where a peer's failure is named as the ep group's (expert_parallel_ranks)
    module.forward = functools.partial(  # type: ignore[method-assign]
        _dispatch, experts=experts, exchange=exchange, local=local_experts.each)


class _LocalExperts:
    """Expert j of this rank's slice, run by the family's own experts forward (its tokens routed to
    j alone, weight 1), on a shallow twin of the module whose expert count is the slice's."""

    def __init__(self, module: nn.Module, count: int) -> None:
        self.module, self.count, self.forward = module, count, type(module).forward
        self.each = [self._expert(j) for j in range(count)]

    def _expert(self, j: int) -> Callable[[Tensor], Tensor]:
        def run(tokens: Tensor) -> Tensor:
            twin = object.__new__(type(self.module))
            twin.__dict__.update(self.module.__dict__)
            twin.__dict__["num_experts"] = self.count
            index = torch.full((tokens.shape[0], 1), j, dtype=torch.long, device=tokens.device)
            weight = torch.ones((tokens.shape[0], 1), dtype=tokens.dtype, device=tokens.device)
            return self.forward(twin, tokens, index, weight)
        return run


def _dispatch(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, experts: int,
              exchange: Callable[..., Tensor], local: list[Callable[[Tensor], Tensor]]) -> Tensor:
    """sum_j top_k_weights[n, j] * expert_{top_k_index[n, j]}(hidden[n]) for every token n, the
    experts run where they live."""
    rows = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k_index.shape[-1])
    out = combine_experts(hidden, rows, top_k_index.reshape(-1), top_k_weights.reshape(-1), experts,
                          lambda tokens, sizes: exchange(tokens, sizes, local))
    return out.to(hidden.dtype)
