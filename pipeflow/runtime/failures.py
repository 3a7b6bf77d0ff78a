"""Naming the culprit: a failure inside a stage or a transfer says where it happened.

* :func:`stage_failure`: a user's layer that raised (or ran out of memory) becomes a
  :class:`StageError` naming rank, stage, micro-batch and action.
* :func:`with_progress` / :func:`context`: a failed transfer also says what this rank had
  already done and during which training step.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pipeflow.errors import PipeflowError, StageError, StageOutOfMemoryError

OOM_HINTS = (
    "To fit: use smaller micro-batches (more pipeline.num_microbatches for the same data.batch_size), "
    "turn on activation checkpointing, pick a schedule that keeps fewer micro-batches in flight "
    "(1f1b or zb_h1 rather than gpipe), or move layers off this stage (pipeline.balance=memory, "
    "pipeline.split_points). If much more is reserved than allocated, try "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and allocator RuntimeErrors that say 'out of memory'."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def memory_report(stages: Mapping[int, Any], device: torch.device) -> str:
    """Activations held per stage, parameter and gradient bytes, and the device's allocator figures."""
    held = ", ".join(f"stage {s}: {stage.activations_held()}" for s, stage in sorted(stages.items()))
    params = [p for stage in stages.values() for p in stage.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    parts = [
        f"micro-batches whose activations are held for backward: {held}",
        f"parameters {_gib(param_bytes)}, gradients {_gib(grad_bytes)}",
    ]
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        allocated = torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        parts.append(
            f"{device}: {_gib(allocated)} allocated, of which {_gib(max(0, allocated - param_bytes - grad_bytes))} "
            f"beyond parameters and gradients (activations, optimizer state, workspaces); "
            f"{_gib(torch.cuda.memory_reserved(device))} reserved, peak {_gib(torch.cuda.max_memory_allocated(device))}, "
            f"{_gib(free)} free of {_gib(total)}"
        )
    else:
        parts.append(f"{device}: no allocator figures on this device")
    return "; ".join(parts)


def stage_failure(exc: BaseException, where: str, stages: Mapping[int, Any], device: torch.device) -> StageError:
    """The error to raise for `exc`, raised by a user's layer at `where` (rank, stage, micro-batch, action).

    Out-of-memory becomes a :class:`StageOutOfMemoryError` with :func:`memory_report` and
    :data:`OOM_HINTS`; anything else a :class:`StageError`.  Raise it ``from exc``.
    """
    first_line = (str(exc).splitlines() or [""])[0]
    if is_out_of_memory(exc):
        return StageOutOfMemoryError(
            f"out of memory at {where}: {type(exc).__name__}: {first_line}\n"
            f"  memory: {memory_report(stages, device)}\n  {OOM_HINTS}"
        )
    return StageError(f"{where}: {type(exc).__name__}: {exc}")


def progress_note(program: Sequence[Any], position: int, last: int = 4) -> str:
    """What a rank had done when step `position` of its `program` failed: compute actions before it."""
    done = [str(step.action) for step in program[:position] if step.action is not None]
    if not done:
        return "this rank had not run any action of this pass yet"
    recent = ", ".join(done[-last:])
    return f"this rank had completed {position} of {len(program)} program steps of this pass; last actions: {recent}"


def with_progress(exc: PipeflowError, program: Sequence[Any], position: int) -> PipeflowError:
    """`exc` with :func:`progress_note` appended to its message (returned for ``raise``)."""
    _append(exc, progress_note(program, position))
    return exc


def _append(exc: BaseException, text: str) -> None:
    head = exc.args[0] if exc.args else ""
    exc.args = (f"{head}\n  {text}", *exc.args[1:])


@contextmanager
def context(where: str) -> Iterator[None]:
    """Append ``during <where>`` to any pipeflow error raised inside the block."""
    try:
        yield
    except PipeflowError as exc:
        _append(exc, f"during {where}")
        raise
