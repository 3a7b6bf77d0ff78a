"""Receive buffers from a pool keyed by shape and dtype: in steady state a pass allocates none.

A buffer a recv fills stays lent while anything of its micro-batch may still read it: an
activation is a stage's input (kept by autograd until the micro-batch's last backward, W for a
split one), a gradient starts that backward (and a split B keeps it for W).  The pipeline gives a
stage's buffers of micro-batch i back after that last backward in training, and at the end of an
evaluation pass.  A buffer whose storage something else still shares is not reused but left to
the allocator: a stage that passes its input on (an identity, a skip connection) sends a view of
the buffer, and its backward returns the received gradient itself as its input gradient, both
still on their way to a peer.  Keys not taken during a pass are dropped at its end, so
micro-batches of ever new shapes do not accumulate memory.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from pipeflow.runtime.transport import TensorMeta

_Key = tuple[tuple[int, ...], torch.dtype]


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors hold `t`'s storage (views included), as torch counts them."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


try:
    _ALONE = _storage_uses(torch.empty(1))  # the count of a tensor nothing else shares
except (AttributeError, RuntimeError):  # a torch without the counter: never reuse a buffer
    _ALONE = -1


def _shared(t: torch.Tensor) -> bool:
    """True unless `t` is the only tensor on its storage (or that cannot be told)."""
    return _ALONE < 0 or _storage_uses(t) > _ALONE


class BufferPool:
    """Free receive buffers by (shape, dtype) on one device.

    Args:
        device: where the buffers live (the transport's device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._taken: set[_Key] = set()
        self.allocated = 0  # buffers made so far (a steady state adds none)

    def take(self, meta: TensorMeta) -> torch.Tensor:
        """A buffer of `meta`'s shape and dtype: a free one, else a new one."""
        key = (meta.shape, meta.dtype)
        self._taken.add(key)
        free = self._free[key]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def give(self, buffers: Iterable[torch.Tensor]) -> None:
        """Take back the buffers of a micro-batch done with them; each is reused (its autograd
        state cleared) unless another tensor still shares its storage."""
        for t in buffers:
            if _shared(t):
                continue
            t.grad = None
            t.requires_grad_(False)
            self._free[(tuple(t.shape), t.dtype)].append(t)

    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers waiting in the pool (memory held between passes)."""
        return [t for ts in self._free.values() for t in ts]

    def end_pass(self) -> None:
        """Drop the free buffers of keys this pass did not take."""
        for key in [k for k in self._free if k not in self._taken]:
            del self._free[key]
        self._taken.clear()
