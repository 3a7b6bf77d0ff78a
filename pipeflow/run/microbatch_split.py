"""A training or held-out batch split into this rank's micro-batches, with each micro-batch's loss weight."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from pipeflow.data import loss_counts, microbatch_counts, microbatch_inputs, microbatch_targets, shard
from pipeflow.errors import AllTargetsMaskedError
from pipeflow.runtime.parallel.ring_attention import split_batch
from pipeflow.runtime.stage import Tensors


class MicroBatches(NamedTuple):
    """One batch as this rank feeds it to its pipeline: the inputs on stage 0's rank, the targets
    and each micro-batch's loss weight on the last stage's (None elsewhere), and the targets the
    loss counts in the global batch (0 on ranks that hold neither end)."""

    inputs: list[Tensors] | None
    targets: list[torch.Tensor] | None
    weights: list[float] | None
    total: int


@dataclass(frozen=True)
class MicroBatchSplit:
    """How this rank splits a batch: which ends of the pipeline it holds, its dp shard, and the
    micro-batch count, device, input dtype and loss count (``ModelSpec.loss_count``).

    A micro-batch's weight is dp x cp x the targets its loss counts (tokens or rows, less masked
    ones; under ``parallel.cp`` those of this rank's chunks of the sequence) over the global
    batch's, so that summed over micro-batches and averaged over the dp x cp ranks, loss and
    gradients are the global batch's mean over its counted targets however the micro-batches
    differ in size or masking.  Every rank holds the global batch, so the global count needs no
    collective; counts are taken on the host batch.  An all-masked micro-batch weighs 0 (its
    stage skips its loss).
    """

    holds_first: bool
    holds_last: bool
    weighs: bool  # the last stage, or any rank with an MoE layer (its aux loss weighs as the micro-batch's loss)
    dp_rank: int
    dp: int
    microbatches: int
    device: torch.device
    dtype: torch.dtype
    loss_count: Callable[[Any], int] | None
    cp_rank: int = 0
    cp: int = 1  # parallel.cp: each row's sequence split over the cp ranks, head-tail (runtime.ring_attention)

    def split(self, source: Any, step: int, training: bool) -> MicroBatches:
        """Batch `step` of `source`, split (see :class:`MicroBatches`).

        Raises:
            AllTargetsMaskedError: a training batch whose every target is masked.
        """
        if not (self.holds_first or self.weighs):
            return MicroBatches(None, None, None, 0)
        batch = source.get(step)
        total = loss_counts(batch[1], self.loss_count)  # the global batch's, on the host
        if total == 0 and training:
            raise AllTargetsMaskedError(
                f"training batch {step}: every target is masked (the loss's ignore_index, -100), so the step has "
                f"nothing to learn from (seen on rank {dist.get_rank()}, which holds the batch); check the data's "
                f"masks (data=chat: does the chat template mark assistant turns?)")
        x, y = shard(batch, self.dp_rank, self.dp)
        if self.cp > 1:  # this rank's chunks of each row (packed documents: their ids whole)
            x, y = split_batch(x, y, self.cp_rank, self.cp)
        m = self.microbatches
        inputs = targets = weights = None
        if self.holds_first:
            inputs = microbatch_inputs(x, m, self.device, self.dtype)
        if self.weighs:
            counts = microbatch_counts(y, m, self.loss_count)  # before the batch moves to the device
            weights = [self.dp * self.cp * c / total if total else 0.0 for c in counts]
        if self.holds_last:
            targets = microbatch_targets(y, m, self.device)
        return MicroBatches(inputs, targets, weights, total)
