"""The optimizer of a stage's parameters, its AdamW state optionally sharded over the dp group (ZeRO-1).

``parallel.shard=optimizer`` wraps AdamW in torch's
:class:`~torch.distributed.optim.ZeroRedundancyOptimizer` over the data-parallel group of this
rank's stages: each dp rank keeps the AdamW state of, and updates, only the parameters it owns,
then every owner broadcasts its updated parameters to the rest of the group.  Gradients are
still averaged over the whole group beforehand (:class:`~pipeflow.runtime.parallel.mesh.GradReducer`),
so the update equals the unsharded one exactly.

With tensor parallelism the parameters are DTensors, which torch's ZeroRedundancyOptimizer cannot
broadcast: it then runs over plain views of each DTensor's local shard (:class:`LocalShards`,
sharing their storage, so its in-place updates and broadcasts are the DTensors' own), each dp group
partitioning the shards its tp rank holds.

Ownership is torch's sorted greedy partition: whole tensors, largest first, each to the rank
with the fewest elements so far.  The rank that ends up with the most got its last tensor while
it had the fewest (at most the average), so no rank owns more than 1/dp of the elements plus
the largest single tensor: the optimizer state per rank is at most 1/dp of the unsharded state
plus the largest parameter's state.  Every dp rank passes the same parameters in the same order
(the same stages), so all agree on the partition without communicating.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from pipeflow.runtime.parallel.fsdp import local

log = logging.getLogger("pipeflow")


def build_optimizer(
    params: list[torch.nn.Parameter], shard: str, dp_group: Any, dp: int, announce: bool = False, **adamw: Any
) -> torch.optim.Optimizer:
    """AdamW over `params`, its state sharded over `dp_group` when ``shard == "optimizer"`` and dp > 1.

    Args:
        params: this rank's parameters, each once, in the same order on every dp rank.
        shard: ``parallel.shard``; ``optimizer`` shards (``none`` and ``full`` get plain AdamW here:
            under ``full`` the parameters themselves are already sharded).
        dp_group: the data-parallel group of this rank's stages (None at dp = 1).
        dp: its size.
        announce: log (INFO) that ``shard=optimizer`` has nothing to shard at dp = 1 (rank 0 only).
        adamw: AdamW's settings (lr, betas, weight_decay).
    """
    if not params:  # a rank whose stages train nothing (LoRA adapters only elsewhere): nor do its dp peers
        return torch.optim.AdamW([{"params": []}], **adamw)
    if shard != "optimizer":
        return torch.optim.AdamW(params, **adamw)
    if dp == 1:
        if announce:
            log.info("parallel.shard=optimizer with parallel.dp=1: one replica, nothing to shard; plain AdamW")
        return torch.optim.AdamW(params, **adamw)
    if any(isinstance(p, DTensor) for p in params):  # tp-split weights: ZeRO over their local shards
        return LocalShards(params, lambda views: ZeroRedundancyOptimizer(
            views, optimizer_class=torch.optim.AdamW, process_group=dp_group, **adamw))
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=dp_group, **adamw)


class LocalShards:
    """An optimizer over plain views of DTensor parameters' local shards (module docstring).

    The views share the shards' storage; before each step they take the DTensors' gradients'
    local shards, and ``zero_grad`` clears both.  ``param_of`` maps a view back to its parameter
    (checkpoints name the state by it and save it as a DTensor of the parameter's placement).
    """

    def __init__(self, params: list[nn.Parameter], make: Any) -> None:
        self.params = list(params)
        self.views = [nn.Parameter(local(p), requires_grad=p.requires_grad) if isinstance(p, DTensor) else p
                      for p in self.params]
        self.param_of = {id(v): p for v, p in zip(self.views, self.params)}
        self.inner = make(self.views)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (over the views): what an lr schedule sets."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state, keyed by view."""
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults."""
        return self.inner.defaults

    @property
    def optim(self) -> Any:
        """The wrapped optimizer (as ZeroRedundancyOptimizer names its own: what memory accounting walks)."""
        return self.inner

    def step(self, closure: Any = None) -> Any:
        """Hand each DTensor gradient's local shard to its view, then step."""
        for view, p in zip(self.views, self.params):
            if view is not p:
                view.grad = None if p.grad is None else local(p.grad)
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the views' and the parameters' gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)
        for view, p in zip(self.views, self.params):
            if view is not p:
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the inner optimizer's state dict."""
        self.inner.load_state_dict(state)


def parameter_of(optimizer: Any, p: torch.Tensor) -> torch.Tensor:
    """The model parameter behind optimizer parameter `p` (a :class:`LocalShards` view's DTensor; else `p`)."""
    return optimizer.param_of.get(id(p), p) if isinstance(optimizer, LocalShards) else p


def local_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO's local AdamW over the parameters this rank
    owns, or `optimizer` itself when it is not sharded.  Its ``param_groups`` list exactly the
    parameters whose state lives here and its ``state`` holds that state."""
    if isinstance(optimizer, LocalShards):
        return local_optimizer(optimizer.inner)
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def owned_parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters whose optimizer state (and update) this rank holds."""
    return [p for group in local_optimizer(optimizer).param_groups for p in group["params"]]
