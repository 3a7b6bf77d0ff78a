"""Activations offloaded to host memory between a micro-batch's forward and its backward.

A *group* is one (stage, micro-batch): the tensors autograd saved during that forward, seen
through ``torch.autograd.graph.saved_tensors_hooks`` (:meth:`ActivationOffloader.saving`).
Saved tensors are grouped into *blocks* by their storage, so the views of one storage (the q, k
and v of one fused projection) are copied once and come back as views of one storage again.
What the step keeps anyway (parameters, buffers, the stage's inputs and outputs) never moves.
The plan of which groups move and when is :mod:`pipeflow.schedules.offload`'s; this runs it:

    offload(g)  after F: the copies to the host start, the device refs are dropped
    reload(g)   some steps before B: the copies back start
    ready(g)    just before B: the compute stream waits for them
    release(g)  after the group's last backward half (B, or W of a split backward)

On CUDA the copies run on one side stream from and to pinned host buffers (a
:class:`PinnedPool`); on CPU the same bookkeeping copies into plain second buffers.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipeflow.errors import OffloadError
from pipeflow.runtime.parallel.fsdp import local

Group = tuple[int, int]  # (stage, micro-batch)
_SAVING, _HELD, _OFFLOADED, _RELOADING, _READY = "saving", "held", "offloaded", "reloading", "ready"


class CopyEvent(Protocol):
    """What the pool needs of a copy's event (``torch.cuda.Event``): whether the copy finished."""

    def query(self) -> bool:
        """True once the copy has finished."""
        ...


class PinnedPool:
    """Host buffers for the copies, by size; a buffer is reused only once its last copy finished.

    Args:
        pin: allocate page-locked memory (CUDA copies); False on a CPU device.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.allocated_bytes = 0
        self._free: dict[int, list[tuple[torch.Tensor, CopyEvent | None]]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host buffer of `nbytes`: a free one whose copy is done, else a new one."""
        free = self._free.get(nbytes, [])
        for j, (buffer, event) in enumerate(free):
            if event is None or event.query():
                del free[j]
                return buffer
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor, event: CopyEvent | None = None) -> None:
        """Return `buffer`; `event` marks the end of its last copy (None: no copy in flight)."""
        self._free.setdefault(buffer.numel(), []).append((buffer, event))

    def trim(self) -> int:
        """Free the buffers no copy uses any more; returns the bytes freed."""
        freed = 0
        for nbytes, free in self._free.items():
            busy = [(b, e) for b, e in free if e is not None and not e.query()]
            freed += nbytes * (len(free) - len(busy))
            self._free[nbytes] = busy
        self.allocated_bytes -= freed
        return freed


@dataclass(frozen=True)
class OffloadStats:
    """One pass's offloading: bytes and groups sent to the host, host bytes the pool holds."""

    bytes: int
    groups: int
    host_pool_bytes: int


class _Block:
    """One storage of a group: on the device (`dev`, its bytes as 1-D uint8) or on the host."""

    __slots__ = ("key", "nbytes", "dev", "host", "copied", "ready", "released")

    def __init__(self, key: Group, dev: torch.Tensor) -> None:
        self.key, self.nbytes, self.dev = key, dev.numel(), dev
        self.host: torch.Tensor | None = None
        self.copied: Any = None  # the CUDA event after the copy to the host
        self.ready, self.released = True, False


class _Saved:
    """What the pack hook hands autograd: an alias on the device, or a block and how to view it."""

    __slots__ = ("tensor", "block", "view", "__weakref__")

    def __init__(self, tensor: torch.Tensor, block: _Block | None) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.block = block
        self.view = (tensor.dtype, tensor.storage_offset(), tensor.size(), tensor.stride())


class _Group:
    """A group's blocks and (weakly) the holders autograd keeps of it."""

    def __init__(self, key: Group, keep: set[int]) -> None:
        self.key, self.keep, self.phase = key, keep, _SAVING
        self.blocks: dict[int, _Block] = {}
        self.holders: list[weakref.ref[_Saved]] = []
        self.reloaded: Any = None  # the CUDA event after the copies back

    def saved(self) -> Iterator[_Saved]:
        """The holders autograd still keeps."""
        return (h for h in (ref() for ref in self.holders) if h is not None)


class ActivationOffloader:
    """Moves the saved activations of chosen groups to host memory and back, on one device.

    Args:
        device: this rank's device; tensors elsewhere are never moved.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.pool = PinnedPool(pin=self.cuda)
        self._groups: dict[Group, _Group] = {}
        self._bytes = self._count = 0

    @contextlib.contextmanager
    def saving(self, group: Group, keep: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Within it (one training forward), what autograd saves belongs to `group`.

        Args:
            group: (stage, micro-batch).
            keep: tensors that stay anyway (parameters, buffers, the inputs): whatever shares
                their storage is never moved.

        Raises:
            OffloadError: `group` is live already (saved and not released).
        """
        if group in self._groups:
            raise OffloadError(f"{_name(group)} is saved twice (it was not released after its backward)")
        state = self._groups[group] = _Group(group, self._storages(keep))
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(state, t), _unpack):
                yield
        except BaseException:
            self._forget(state)  # a failed forward has no backward to wait for
            raise
        state.phase = _HELD

    def _pack(self, group: _Group, tensor: torch.Tensor) -> _Saved:
        # a detached alias: holding the tensor itself would hold its grad_fn, a cycle when an op
        # saves its own output
        alias = tensor.detach()
        if not self._movable(tensor) or alias.untyped_storage().data_ptr() in group.keep:
            saved = _Saved(alias, None)
        else:
            storage = alias.untyped_storage()
            block = group.blocks.get(storage.data_ptr())
            if block is None:
                dev = torch.empty(0, dtype=torch.uint8, device=alias.device).set_(storage)
                block = group.blocks[storage.data_ptr()] = _Block(group.key, dev)
            saved = _Saved(alias, block)
        group.holders.append(weakref.ref(saved))
        return saved

    def _movable(self, t: torch.Tensor) -> bool:
        """A plain strided tensor on this device with bytes of its own (not a Parameter, a
        DTensor or another subclass, and no lazy conj/neg bit a rebuilt view would lose)."""
        return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized
                and not t.is_conj() and not t.is_neg() and self._here(t)
                and t.untyped_storage().nbytes() > 0)

    def _here(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and (t.device.index or 0) == (self.device.index or 0)

    def _storages(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The data pointers of the storages of `tensors` on this device."""
        ptrs = set()
        for t in tensors:
            t = local(t)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and self._here(t):
                ptrs.add(t.untyped_storage().data_ptr())
        return ptrs - {0}

    def offload(self, group: Group, stay: Iterable[torch.Tensor] = ()) -> int:
        """Start copying `group`'s blocks to the host and drop this offloader's device refs to
        them (the memory goes when nothing else holds it).

        Args:
            group: a group whose forward has ended.
            stay: tensors the stage keeps anyway (its outputs, layer boundaries): blocks sharing
                their storage stay on the device.

        Returns:
            The bytes sent to the host.

        Raises:
            OffloadError: `group` is not saved, still saving, or offloaded already.
        """
        state = self._live(group, "offloaded")
        if state.phase != _HELD:
            raise OffloadError(f"{_name(group)} cannot be offloaded: it is {state.phase} (offload once, after its forward)")
        staying = self._storages(stay)
        moving = [b for ptr, b in state.blocks.items() if ptr not in staying]
        moved = {id(b) for b in moving}
        for saved in state.saved():
            if id(saved.block) in moved:
                saved.tensor = None
        for ptr, block in state.blocks.items():  # a block that stays lives in its holders' aliases alone
            if ptr in staying:
                block.dev = None
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))  # the forward's kernels
        for block in moving:
            self._to_host(block)
        state.phase = _OFFLOADED
        nbytes = sum(b.nbytes for b in moving)
        self._bytes += nbytes
        self._count += 1
        return nbytes

    def _to_host(self, block: _Block) -> None:
        host = self.pool.take(block.nbytes)
        if self.cuda:
            with torch.cuda.stream(self.side):
                host.copy_(block.dev, non_blocking=True)
                block.dev.record_stream(self.side)  # the allocator keeps the block until the copy ends
                block.copied = torch.cuda.Event()
                block.copied.record(self.side)
        else:
            host.copy_(block.dev)
        block.host, block.dev, block.ready = host, None, False

    def reload(self, group: Group) -> None:
        """Start copying `group`'s blocks back to the device (after its offload, before its backward).

        Raises:
            OffloadError: `group` is not offloaded, or its reload was issued already.
        """
        state = self._live(group, "reloaded")
        if state.phase != _OFFLOADED:
            raise OffloadError(f"{_name(group)} cannot be reloaded: it is {state.phase} (reload once, after its offload)")
        moved = [b for b in state.blocks.values() if b.host is not None]
        if self.cuda:
            with torch.cuda.stream(self.side):  # after the copies out, on the same stream
                for block in moved:
                    block.dev = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
                    block.dev.copy_(block.host, non_blocking=True)
                state.reloaded = torch.cuda.Event()
                state.reloaded.record(self.side)
        else:
            for block in moved:
                block.dev = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device).copy_(block.host)
        for block in moved:
            self.pool.give(block.host, state.reloaded)
            block.host = None
        state.phase = _RELOADING

    def ready(self, group: Group) -> None:
        """Make the compute stream wait for `group`'s reload (call just before its backward).

        Raises:
            OffloadError: `group`'s reload was not issued, or ready was called already.
        """
        state = self._live(group, "waited for")
        if state.phase != _RELOADING:
            raise OffloadError(f"{_name(group)} cannot be waited for: it is {state.phase} (reload it first, ready once)")
        blocks = [b for b in state.blocks.values() if not b.ready]
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(state.reloaded)
            for block in blocks:
                block.dev.record_stream(current)  # the backward uses it and frees it there
        for block in blocks:
            block.ready = True
        # from now on the holders alone keep the reloaded storages: a storage goes as soon as
        # autograd frees the nodes that saved it (a split B frees the loss's above the layers)
        for saved in state.saved():
            if saved.tensor is None and saved.block is not None and saved.block.dev is not None:
                saved.tensor = _view(saved)
        for block in blocks:
            block.dev = None
        state.phase = _READY

    def release(self, group: Group) -> None:
        """Forget `group` (after its last backward half); what it holds goes with it.

        Raises:
            OffloadError: `group` is not live (never saved, or released already).
        """
        self._forget(self._live(group, "released"))

    def _forget(self, state: _Group) -> None:
        del self._groups[state.key]
        for saved in state.saved():
            saved.tensor = None
        for block in state.blocks.values():
            if block.host is not None:
                self.pool.give(block.host, block.copied)
            block.dev = block.host = None
            block.released = True

    def _live(self, group: Group, verb: str) -> _Group:
        state = self._groups.get(group)
        if state is None:
            raise OffloadError(f"{_name(group)} cannot be {verb}: it is not live (never saved, or released)")
        return state

    def device_tensors(self) -> list[torch.Tensor]:
        """What the live groups hold on the device now: the aliases that stay and the storages
        not offloaded or reloaded (for the memory accountant; host buffers are not included)."""
        found = []
        for state in self._groups.values():
            found += [s.tensor for s in state.saved() if s.tensor is not None and self._here(s.tensor)]
            found += [b.dev for b in state.blocks.values() if b.dev is not None]
        return found

    def host_bytes(self, group: Group) -> int:
        """The bytes of `group` on the host now (copied out, not reloaded)."""
        state = self._live(group, "measured")
        return sum(b.nbytes for b in state.blocks.values() if b.host is not None)

    def end_pass(self) -> OffloadStats:
        """The pass's stats (counters reset); call at the end of a training step.

        Raises:
            OffloadError: a group is still live (each is then forgotten, so nothing leaks).
        """
        stats = OffloadStats(self._bytes, self._count, self.pool.allocated_bytes)
        self._bytes = self._count = 0
        left = list(self._groups.values())
        for state in left:
            self._forget(state)
        if left:
            names = ", ".join(f"{_name(s.key)} ({s.phase})" for s in left)
            raise OffloadError(f"the pass ended with groups never released: {names}")
        return stats


def _unpack(saved: _Saved) -> torch.Tensor:
    if saved.tensor is not None:
        return saved.tensor
    block = saved.block
    if block is None or block.released:
        where = _name(block.key) if block is not None else "a group"
        raise OffloadError(f"{where}: a saved activation was unpacked after its group was released")
    if block.dev is None:
        raise OffloadError(f"{_name(block.key)}: a saved activation is on the host at its backward: "
                           "the reload was missing (reload and ready the group before its backward)")
    if not block.ready:
        raise OffloadError(f"{_name(block.key)}: a saved activation was unpacked before its reload was "
                           "waited for (call ready before the backward)")
    return _view(saved)


def _view(saved: _Saved) -> torch.Tensor:
    """The saved tensor rebuilt on its block's device storage, as it was viewed."""
    dtype, offset, size, stride = saved.view
    storage = saved.block.dev.untyped_storage()
    return torch.empty(0, dtype=dtype, device=saved.block.dev.device).set_(storage, offset, size, stride)


def _name(group: Group) -> str:
    return f"stage {group[0]} micro-batch {group[1]}"
