"""The optimizer of a stage's parameters, its AdamW state optionally sharded over the dp group (ZeRO-1).

``parallel.shard=optimizer`` wraps AdamW in torch's
:class:`~torch.distributed.optim.ZeroRedundancyOptimizer` over the data-parallel group of this
rank's stages: each dp rank keeps the AdamW state of, and updates, only the parameters it owns,
then every owner broadcasts its updated parameters to the rest of the group.  Gradients are
still averaged over the whole group beforehand (:class:`~pipeflow.runtime.mesh.GradReducer`),
so the update equals the unsharded one exactly.

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
from torch.distributed.optim import ZeroRedundancyOptimizer

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
    if shard != "optimizer":
        return torch.optim.AdamW(params, **adamw)
    if dp == 1:
        if announce:
            log.info("parallel.shard=optimizer with parallel.dp=1: one replica, nothing to shard; plain AdamW")
        return torch.optim.AdamW(params, **adamw)
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=dp_group, **adamw)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO's local AdamW over the parameters this rank
    owns, or `optimizer` itself when it is not sharded.  Its ``param_groups`` list exactly the
    parameters whose state lives here and its ``state`` holds that state."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def owned_parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters whose optimizer state (and update) this rank holds."""
    return [p for group in local_optimizer(optimizer).param_groups for p in group["params"]]
