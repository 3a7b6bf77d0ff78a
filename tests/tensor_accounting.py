"""Tensor accounting: every byte a block of code allocates on a real device, counted as it happens.

Not a test file. `AllocatedBytes` is a TorchDispatchMode: each op's outputs whose storage is new
(not the storage of one of its inputs: in-place ops and views allocate nothing) add their bytes;
frees are never subtracted, so the total is an upper bound of the peak the code ever held.
Meta tensors cost nothing and are not counted.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(values: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(values)
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


class AllocatedBytes(TorchDispatchMode):
    """Inside ``with AllocatedBytes() as acc:``, ``acc.total`` counts the bytes newly allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        seen: set[int] = set()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in seen:
                    seen.add(ptr)
                    self.total += t.untyped_storage().nbytes()
        return out


def held_bytes(modules: Any) -> int:
    """Parameter and buffer bytes of `modules` (each tensor once)."""
    tensors = {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
