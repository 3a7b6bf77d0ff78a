"""Counting the tensor bytes a rank holds, by category, from its live tensors.

The tracked quantity is :class:`~pipeflow.schedules.memory.TensorBytes` (the definition and the
order in which categories claim a storage are there); the planner predicts the same quantity
(:func:`~pipeflow.schedules.memory.tensor_memory`).  Every storage is counted once (its
``untyped_storage`` data pointer and size), only on this rank's device; a DTensor counts its
local shard.  Nothing here knows how parameters are sharded: the parameters are the stages'
(``module.parameters()``, which FSDP2 swaps for unsharded tensors during a step) together with
the optimizer's (its ``param_groups``: the shards), their ``.grad``, and ``optimizer.state`` of
whatever optimizer runs (and of the one it wraps, as ZeroRedundancyOptimizer's ``optim``).

Tensors saved for backward are seen through ``torch.autograd.graph.saved_tensors_hooks``
(:meth:`MemoryAccountant.tracking`, on only for measured steps): each saved tensor is wrapped in
a small object that a weak set tracks, so it counts exactly as long as autograd keeps it.  The
wrapper holds a detached alias, as autograd itself saves an op's output without its grad_fn
(so double backward through a measured step is not supported; pipeflow never runs one).
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from pipeflow.runtime.parallel.fsdp import local
from pipeflow.runtime.stage import Stage
from pipeflow.schedules.memory import RankMemory, TensorBytes



class _Saved:
    """What the pack hook hands autograd: the saved tensor, alive as long as autograd keeps it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor




def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts (optimizer state, kept tensors)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def optimizer_state(optimizer: Any) -> Iterator[torch.Tensor]:
    """The state tensors of `optimizer` and of the optimizer it wraps, if any (``.optim``)."""
    while optimizer is not None:
        yield from tensors_in(list(getattr(optimizer, "state", {}).values()))
        inner = getattr(optimizer, "optim", None)
        optimizer = inner if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer else None


class _Ledger:
    """The storages on one device claimed so far (each is counted once, by the first claim)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.seen: set[int] = set()

    def claim(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the storages among `tensors` not claimed before (this device only)."""
        total = 0
        for t in tensors:
            t = local(t)
            if not self.holds(t):
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += nbytes
        return total

    def holds(self, t: torch.Tensor) -> bool:
        """True if `t` lives on this device (``cuda`` without an index matches any ``cuda:N``)."""
        if t.device.type != self.device.type:
            return False
        return t.device.index is None or self.device.index is None or t.device.index == self.device.index


class MemoryAccountant:
    """Measures one rank's :class:`TensorBytes` on chosen steps: the in-step peak, sampled after
    every compute action, and what stays resident at the step's end.

    Args:
        stages: this rank's stages.
        optimizer: the optimizer over their parameters (any; None: no parameters' state).
        device: this rank's device (tensors elsewhere are not counted).
    """

    def __init__(self, stages: Mapping[int, Stage], optimizer: Any, device: torch.device) -> None:
        self.stages, self.optimizer, self.device = stages, optimizer, torch.device(device)
        self._saved: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.peak: TensorBytes | None = None
        self.resident: TensorBytes | None = None
        self.samples = 0

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Within it, every tensor autograd saves for backward is tracked (a measured step)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        # a detached alias (same storage): holding the tensor itself would hold its grad_fn, and
        # an op that saves its own output (log_softmax) would then form a cycle that outlives the
        # step where a backward keeps its graph (a split B) and W never frees that part
        saved = _Saved(tensor.detach())
        self._saved.add(saved)
        return saved

    def parameters(self) -> list[torch.Tensor]:
        """The stages' parameters and the optimizer's (sharded ones: both the shard and, during a
        step, the unsharded tensor the module computes with)."""
        params = [p for stage in self.stages.values() for p in stage.parameters()]
        if self.optimizer is not None:
            params += [p for group in self.optimizer.param_groups for p in group["params"]]
        return params

    def kept(self) -> Iterator[torch.Tensor]:
        """What is kept for backward: saved tensors, the stages' kept inputs, outputs, per-layer
        boundaries and split-backward gradients."""
        yield from (s.tensor for s in list(self._saved))
        for stage in self.stages.values():
            yield from tensors_in([stage._inputs, stage._outputs, stage._boundaries, stage._pending_weight])

    def count(self, comm: Iterable[torch.Tensor] = (), data: Any = (), held: Iterable[torch.Tensor] = ()
              ) -> TensorBytes:
        """This rank's tensor bytes now, by category (`comm`: the transport's buffers now;
        `data`: the step's inputs and targets, which count with the activations; `held`: saved
        tensors kept elsewhere than autograd's own records, on the device now: the offloader's)."""
        ledger = _Ledger(self.device)
        params = self.parameters()
        return TensorBytes(
            params=ledger.claim(params),
            grads=ledger.claim(p.grad for p in params if p.grad is not None),
            optimizer=ledger.claim(optimizer_state(self.optimizer)),
            comm=ledger.claim(comm),
            activations=ledger.claim(self.kept()) + ledger.claim(tensors_in(data)) + ledger.claim(held),
        )

    def begin(self) -> None:
        """Start a measured step (its peak starts from nothing)."""
        self.peak, self.samples = None, 0

    def sample(self, comm: Iterable[torch.Tensor] = (), data: Any = (), held: Iterable[torch.Tensor] = ()) -> None:
        """Count now (after a compute action); keep it if it is the step's largest total."""
        now = self.count(comm, data, held)
        self.samples += 1
        if self.peak is None or now.total > self.peak.total:
            self.peak = now

    def end(self, comm: Iterable[torch.Tensor] = ()) -> RankMemory:
        """Count what stays at the step's end (after the optimizer step, before the gradients are
        released) and return it with the step's peak."""
        self.resident = self.count(comm)
        return RankMemory(self.resident, self.peak if self.peak is not None else self.resident)


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


def device_memory_limit(device: torch.device) -> float | None:
    """The tensor bytes a rank's predicted peak should fit (``pipeline.offload=auto`` offloads
    more where it would not): on CUDA :data:`DEVICE_MEMORY_SHARE` of the device's memory (the
    rest for the allocator's caching, workspaces and the CUDA context), no limit elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    return DEVICE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory


DEVICE_MEMORY_SHARE = 0.85
