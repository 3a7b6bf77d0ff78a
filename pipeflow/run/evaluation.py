"""The held-out loss: forward-only passes over ``train.eval_batches`` batches, weighed by the targets each counts."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from pipeflow.errors import AllTargetsMaskedError
from pipeflow.run.microbatch_split import MicroBatches
from pipeflow.runtime import failures
from pipeflow.runtime.pipeline import Pipeline


def held_out_loss(pipeline: Pipeline, microbatches_of: Callable[[int], MicroBatches], batches: int,
                  device: torch.device, stop: Callable[[], bool] | None = None) -> float | None:
    """Mean loss over `batches` held-out batches (forward only), each target the loss counts
    weighing alike (a batch weighs by its count; an all-masked one by nothing).

    Args:
        pipeline: this rank's interpreter (its ``eval``).
        microbatches_of: batch k split into this rank's micro-batches.
        stop: asked after each batch, on every rank alike (a collective): True leaves at once.

    Returns:
        The loss, or None when `stop` said so (every rank leaves at the same batch).

    Raises:
        AllTargetsMaskedError: every target of every batch is masked.
    """
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (loss x count, count)
    for k in range(batches):
        inputs, targets, weights, count = microbatches_of(k)
        with failures.context("evaluation"):
            loss = pipeline.eval(inputs, targets, loss_weights=weights)
        if loss is not None:
            total += torch.cat([loss.double().reshape(1) * count, total.new_tensor([count])])
        if stop is not None and stop():
            return None
    dist.all_reduce(total)  # the last stage of every pipeline holds its dp shard's share of the mean
    loss_sum, count = total.tolist()  # each pipeline's last stage added the count: pipelines x it
    if count == 0:
        raise AllTargetsMaskedError(f"evaluation: every target of the {batches} held-out batches "
                                    f"(train.eval_batches) is masked; check the data's masks")
    return loss_sum / count


def reached_a_rank(received: bool, device: torch.device) -> bool:
    """True on every rank when a ``train.save_on_signal`` signal was `received` by any rank (one
    all-reduce and a read-back: for phases between steps, which wait for the host anyway)."""
    flag = torch.tensor([1.0 if received else 0.0], device=device)
    with failures.context("the preemption check between evaluation batches"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
