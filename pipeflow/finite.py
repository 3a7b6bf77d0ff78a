"""``train.check_finite``: stop at the first non-finite value, naming the stage where it appeared.

Forward outputs (the loss on the last stage) and parameter gradients are checked on the device
without a host sync per micro-batch; one all-reduce of 2 x S flags per step tells every rank
where NaN or Inf first showed up: the lowest stage whose forward output was non-finite (forward
runs from stage 0 up), else the highest stage whose gradients were (backward runs down).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import NonFiniteError


class FiniteCheck:
    """Watches this rank's stages for non-finite forward outputs and gradients.

    Args:
        stages: this rank's stages by index (a forward hook is added to each).
        num_stages: S, stages in the whole pipeline.
        device: where the flags live (the stages' device).
    """

    def __init__(self, stages: dict[int, Any], num_stages: int, device: torch.device) -> None:
        self.stages = stages
        self.num_stages = num_stages
        self.flags = torch.zeros(2 * num_stages, device=device)  # [forward of s..., grads of s...]
        for stage in stages.values():
            stage.forward_hooks.append(self._watch_forward)

    def _watch_forward(self, stage: Any, i: int, outputs: Any) -> Any:
        """A forward hook: flag stage `stage.index` when its outputs hold a NaN or Inf."""
        floats = [t.detach() for t in outputs if t.is_floating_point()]
        if floats:
            bad = torch.stack([~torch.isfinite(t).all() for t in floats]).any()
            self.flags[stage.index] += bad.to(self.flags.dtype)
        return outputs

    def check(self, step: int, stage_to_rank: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
        """After a step's forward and backward: raise on every rank if anything was non-finite.

        Raises:
            NonFiniteError: naming the stage (and rank) where non-finite values first appeared.
        """
        S = self.num_stages
        for s, stage in self.stages.items():
            grads = [p.grad.detach() for p in stage.parameters() if p.grad is not None]
            if grads:
                norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
                self.flags[S + s] = (~torch.isfinite(norms)).any().to(self.flags.dtype)
        dist.all_reduce(self.flags, group=group)
        flags = self.flags.tolist()
        self.flags.zero_()
        forward = [s for s in range(S) if flags[s] > 0]
        backward = [s for s in range(S) if flags[S + s] > 0]
        if not forward and not backward:
            return
        if forward:
            s = forward[0]
            where = f"the forward output of stage {s} (rank {stage_to_rank[s]}){' - the loss' if s == S - 1 else ''}"
        else:
            s = backward[-1]
            where = f"the parameter gradients of stage {s} (rank {stage_to_rank[s]}), in backward"
        raise NonFiniteError(
            f"training step {step}: non-finite values (NaN or Inf) first appeared in {where}; "
            f"stages with non-finite forward outputs: {forward or 'none'}, with non-finite gradients: "
            f"{backward or 'none'}. Check that stage's layers and inputs, lower optim.lr, keep "
            f"optim.grad_clip on, or train in train.dtype=float32."
        )
