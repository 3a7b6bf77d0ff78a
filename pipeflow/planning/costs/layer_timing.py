"""Timing one layer and counting what it saves, as a stage runs it: its forward (under autocast in
the compute dtype), its backward whole or split into the input-grad and weight-grad halves, the
bytes autograd saves for backward (each storage once), and what a loss keeps on its outputs.
Used by :mod:`~pipeflow.planning.profile`, one layer alive at a time."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipeflow.runtime.compiled_backward import deferring_weight_grads


class LayerForward:
    """A layer's forward as a stage runs it: under autocast in the compute dtype, if any (called
    with the layer's inputs; returns its outputs as a tuple)."""

    def __init__(self, module: nn.Module, device: torch.device, autocast_dtype: torch.dtype | None) -> None:
        self.module = module
        self.device = device
        self.autocast_dtype = autocast_dtype

    def parameters(self) -> Iterator[nn.Parameter]:
        """The layer's parameters."""
        return self.module.parameters()

    def __call__(self, *inputs: Any) -> tuple:
        if self.autocast_dtype is None:
            return as_tuple(self.module(*inputs))
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return as_tuple(self.module(*inputs))


def time_forward_backward(module: LayerForward, inputs: tuple, device: torch.device) -> tuple[float, float]:
    """One forward and one backward of `module`; return their (forward, backward) seconds."""
    sync(device)
    start = time.perf_counter()
    outputs = module(*inputs)
    sync(device)
    forward = time.perf_counter() - start
    roots = [t for t in outputs if isinstance(t, Tensor) and t.requires_grad]
    if not roots:
        return forward, 0.0
    grads = [torch.ones_like(t) for t in roots]
    sync(device)
    start = time.perf_counter()
    torch.autograd.backward(roots, grads)
    sync(device)
    return forward, time.perf_counter() - start


def time_split_backward(module: LayerForward, inputs: tuple, device: torch.device) -> tuple[float, float]:
    """One forward, then the backward in two halves; return the (input-grad, weight-grad) seconds.

    B takes the gradients of the inputs (keeping the graph), W those of the parameters, as a
    stage does for the zero-bubble schedules (`pipeflow.runtime.stage.Stage.backward_weight`).
    """
    outputs = module(*inputs)
    roots = [t for t in outputs if isinstance(t, Tensor) and t.requires_grad]
    wanted = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    if not roots:
        return 0.0, 0.0
    grads = [torch.ones_like(t) for t in roots]
    halves = []
    for targets, keep in ((wanted, bool(params)), (params, False)):
        if not targets:
            halves.append(0.0)
            continue
        sync(device)
        start = time.perf_counter()
        with deferring_weight_grads() if keep else contextlib.nullcontext():  # a compiled layer: its B half only
            torch.autograd.grad(roots, targets, grads, retain_graph=keep, allow_unused=True)
        sync(device)
        halves.append(time.perf_counter() - start)
    return halves[0], halves[1]


def activation_bytes(
    module: LayerForward, inputs: tuple, params: Sequence[Tensor]
) -> tuple[int, tuple]:
    """Bytes of the storages one forward saves for backward, or outputs (params, inputs excluded).

    Returns:
        (the byte count, the outputs of that forward, detached: its graph is freed on return).
    """
    skip = {storage_key(t) for t in (*params, *inputs) if isinstance(t, Tensor)}
    seen: dict[tuple[str, int], int] = {}
    with counting_saved(seen):
        outputs = module(*inputs)
    for t in outputs:
        if isinstance(t, Tensor):
            seen.setdefault(storage_key(t), storage_bytes(t))
    return sum(n for key, n in seen.items() if key not in skip), detached(outputs)


def counting_saved(seen: dict[tuple[str, int], int]) -> contextlib.AbstractContextManager:
    """Saved-tensor hooks that record each saved storage's bytes in `seen` (by `_storage_key`).

    The pack hook keeps a detached alias, never the tensor itself: an op that saves its own
    output (softmax, log_softmax) would otherwise hold the output's grad_fn from inside it, a
    cycle in C++ that no garbage collection frees, and the whole graph would outlive the
    profile.  The alias keeps the storage alive while the graph lives, so no storage counted is
    freed and reused (a reused address would be taken for one already seen).
    """

    def pack(t: Tensor) -> Tensor:
        seen.setdefault(storage_key(t), storage_bytes(t))
        return t.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def detached(values: tuple) -> tuple:
    """`values` with every tensor detached (their graph no longer reachable from them)."""
    return tuple(t.detach() if isinstance(t, Tensor) else t for t in values)


def storage_key(t: Tensor) -> tuple[str, int]:
    """Identify the memory a tensor lives in, so views of one storage are counted once."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no plain storage (e.g. some tensor subclasses)
        return (str(t.device), id(t))


def storage_bytes(t: Tensor) -> int:
    """Bytes of the tensor's whole storage (a view keeps all of it alive)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def as_tuple(value: Any) -> tuple:
    """The layer calling convention: a tuple is several arguments, anything else is one."""
    return value if isinstance(value, tuple) else (value,)


def to_device(
    value: Any, device: torch.device, dtype: torch.dtype | None, requires_grad: bool
) -> tuple:
    """Move (and detach) tensors; cast floating ones to `dtype`; mark them requiring grad."""
    moved = []
    for t in as_tuple(value):
        if isinstance(t, Tensor):
            t = t.detach().to(device)
            if t.is_floating_point():
                t = t.to(dtype) if dtype is not None else t
                t.requires_grad_(requires_grad)
        moved.append(t)
    return tuple(moved)


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock time measures the work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loss_bytes(loss_fn: Callable[[Any, Any], Tensor], outputs: tuple, target: Any) -> tuple[int, bool]:
    """Bytes the loss saves for backward, the outputs' and the target's storages excluded, and
    whether it saves an output's storage."""
    own = {storage_key(t) for t in outputs if isinstance(t, Tensor)}
    skip = own | {storage_key(t) for t in (target,) if isinstance(t, Tensor)}
    seen: dict[tuple[str, int], int] = {}
    with torch.enable_grad(), counting_saved(seen):
        loss_fn(outputs[0] if len(outputs) == 1 else outputs, target)  # its graph dies here
    return sum(n for key, n in seen.items() if key not in skip), bool(own & set(seen))
