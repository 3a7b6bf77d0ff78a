"""What one pass of the interpreter (:mod:`pipeflow.runtime.pipeline`) carries from step to step,
named: the transfers in flight (:class:`Boxes`) and the pass's own inputs (:class:`PassWork`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipeflow.runtime.stage import Tensors
from pipeflow.schedules.ir import CommOp, Step

# inbox/outbox keys: (payload, micro-batch, stage) with stage = receiver (inbox) or sender (outbox)
Key = tuple[str, int, int]


class Posted(NamedTuple):
    """A posted op not waited for yet: the tensors it sends or fills, its works, and the recorder's
    mark of its posting (None when not recording)."""

    tensors: Tensors
    works: list[dist.Work]
    mark: Any = None


@dataclass(slots=True)
class Boxes:
    """A pass's transfers: arrivals waiting for their action (``inbox``), outputs waiting for their
    send to be posted (``outbox``), and ops posted and not yet waited for (``posted``)."""

    inbox: dict[Key, Tensors] = field(default_factory=dict)
    outbox: dict[Key, Tensors] = field(default_factory=dict)
    posted: dict[CommOp, Posted] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors queued for sending or posted (the transport's share of memory now)."""
        return [t for ts in self.outbox.values() for t in ts] + [t for p in self.posted.values() for t in p.tensors]

    def left(self) -> list[str]:
        """What is still in a box (at the end of a pass: a program that left transfers unused)."""
        return ([str(k) for k in sorted(self.inbox)] + [str(k) for k in sorted(self.outbox)]
                + [str(op) for op in self.posted])


@dataclass(frozen=True, slots=True)
class PassWork:
    """A pass's inputs: the micro-batches' inputs (stage 0's rank) and targets (the last stage's),
    each micro-batch's loss weight, whether it trains, and the loss scale backward starts from."""

    inputs: Sequence[Tensors] | None
    targets: Sequence[torch.Tensor] | None
    loss_weights: Sequence[float]
    train: bool
    grad_scale: float = 1.0


def describe_ops(k: int, step: Step, ops: tuple[CommOp, ...], after: bool, global_rank: Callable[[int], int]) -> str:
    """`ops` of program step `k` as an error names them: each op, the step, before or after its
    action, and each peer's global rank where it is not its pipeline rank (dp > 1)."""
    when = "after the last action" if step.action is None else f"{'after' if after else 'before'} {step.action}"
    peers = sorted({op.peer for op in ops if global_rank(op.peer) != op.peer})
    named = "".join(f"; pipeline rank {p} is global rank {global_rank(p)}" for p in peers)
    return "; ".join(op.describe() for op in ops) + f" (program step {k}, {when}{named})"
