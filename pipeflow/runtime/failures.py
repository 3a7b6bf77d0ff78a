"""Naming the culprit: a failure inside a stage or a transfer says where it happened.

* :func:`stage_failure`: a user's layer that raised (or ran out of memory) becomes a
  :class:`StageError` naming rank, stage, micro-batch and action; a backend failure of a
  tensor-parallel collective inside a layer a :class:`CommError` naming the tp group.
* :func:`with_progress` / :func:`context`: a failed transfer also says what this rank had
  already done and during which training step.
* :func:`collective_failure` / :func:`collective`: a collective that the backend failed (a peer
  died, or stopped answering) is a :class:`CommError` naming the collective, not the backend's
  raw ``RuntimeError``; :func:`context` names one it meets by the code that called it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import CommError, PipeflowError, StageError, StageOutOfMemoryError
from pipeflow.runtime.world import hosts
from pipeflow.runtime.parallel.expert_parallel import expert_parallel_ranks
from pipeflow.runtime.parallel.tensor_parallel import tensor_parallel_ranks

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


def stage_failure(exc: BaseException, where: str, stages: Mapping[int, Any], device: torch.device) -> PipeflowError:
    """The error to raise for `exc`, raised by a user's layer at `where` (rank, stage, micro-batch, action).

    Out-of-memory becomes a :class:`StageOutOfMemoryError` with :func:`memory_report` and
    :data:`OOM_HINTS`; a backend's failure with layers split over a tp group, or experts over an ep
    group, a :class:`CommError` (:func:`tensor_parallel_failure`, :func:`expert_parallel_failure`);
    anything else a :class:`StageError`.  Raise it ``from exc``.
    """
    lost = tensor_parallel_failure(exc, where, stages)
    if lost is None:
        lost = expert_parallel_failure(exc, where, stages)
    if lost is not None:
        return lost
    first_line = (str(exc).splitlines() or [""])[0]
    if is_out_of_memory(exc):
        return StageOutOfMemoryError(
            f"out of memory at {where}: {type(exc).__name__}: {first_line}\n"
            f"  memory: {memory_report(stages, device)}\n  {OOM_HINTS}"
        )
    return StageError(f"{where}: {type(exc).__name__}: {exc}")


def tensor_parallel_failure(exc: BaseException, where: str, stages: Mapping[int, Any]) -> CommError | None:
    """For a backend's failure (:func:`is_backend_failure`) met inside the layers of `stages` when
    they are split over a tp group: a :class:`CommError` naming the tensor-parallel collective, the
    group's global ranks and whether a peer left or stopped answering.  None for anything else.

    `where` says where it was met: tp collectives are waited for lazily, so the one that failed may
    belong to an earlier layer of this rank than the action named.
    """
    return _split_group_failure(exc, lambda: tensor_parallel_ranks(stages.values()),
                                f"the tensor-parallel collective at {where} (this rank's layers are split over its "
                                f"tp group)")


def expert_parallel_failure(exc: BaseException, where: str, stages: Mapping[int, Any]) -> CommError | None:
    """For a backend's failure met inside the layers of `stages` when their MoE experts are split
    over an ep group (``parallel.ep``): a :class:`CommError` naming the expert-parallel exchange,
    the group's global ranks and whether a peer left or stopped answering.  None otherwise."""
    return _split_group_failure(exc, lambda: expert_parallel_ranks(stages.values()),
                                f"the expert-parallel all_to_all at {where} (this rank's MoE experts are split "
                                f"over its ep group)")


def _split_group_failure(exc: BaseException, ranks_of: Callable[[], list[int] | None], what: str) -> CommError | None:
    """`exc` as a :class:`CommError` of `what` over the group ``ranks_of()`` names, when it is a
    backend's failure and the layers are split over such a group; else None."""
    if not is_backend_failure(exc):
        return None
    ranks = ranks_of()
    return None if ranks is None else collective_failure(exc, what, ranks)


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
    """Append ``during <where>`` to any pipeflow error raised inside the block; a backend's raw
    failure of a collective (:func:`is_backend_failure`) becomes a named :class:`CommError` first."""
    try:
        yield
    except PipeflowError as exc:
        _append(exc, f"during {where}")
        raise
    except Exception as exc:
        if not is_backend_failure(exc):
            raise
        error = collective_failure(exc, called_collective(exc.__traceback__))
        _append(error, f"during {where}")
        raise error from exc


# ------------------------------------------------------------------------------ collectives
# how gloo, NCCL and sockets say that a peer's connection went away (one list for every reader:
# the checkpoint's collectives, the first-failure note, the backend failures below)
CONNECTION_LOST_SIGNS = ("Connection closed", "Connection reset", "Broken pipe", "pair closure", "Read error",
                         "Socket closed")
# words of the backends' own failures (gloo's pair.cc / unbound_buffer.cc, NCCL, the store)
BACKEND_SIGNS = ("gloo", "NCCL", "Connection refused", "Timed out waiting", "timed out", "Socket Timeout",
                 *CONNECTION_LOST_SIGNS)
# what pipeflow's collectives are, by the function that calls them
KNOWN_COLLECTIVES = {
    "clip_on_device": "the all-reduce of the global gradient norm (with the loss and the step's flags)",
    "clip_grad_norm_global": "the all-reduce of the global gradient norm (with the loss and the step's flags)",
    "TiedWeights.reduce_grads": "the all-reduce of the tied weights' gradients",
    "TiedWeights.sync_initial_values": "the broadcast of the tied weights' initial values",
    "Trainer.evaluate": "the all-reduce of the held-out loss",
    "FiniteCheck.check": "the all-reduce of train.check_finite's flags",
    "Trainer.save_checkpoint": "the all-reduce of the weights' non-finite flags before a save",
}


def is_backend_failure(exc: BaseException) -> bool:
    """True for a backend's own failure of a communication (torch's ``DistError``, or a
    ``RuntimeError`` in the words of gloo, NCCL or a socket), not for pipeflow's named errors."""
    if isinstance(exc, PipeflowError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(sign in str(exc) for sign in BACKEND_SIGNS)


def is_peer_failure(exc: BaseException) -> bool:
    """True for a failure that a lost or unreachable peer can cause: a named ``CommError`` (a
    transfer, a collective, a save's peer) or a backend's raw failure of a communication."""
    return isinstance(exc, CommError) or is_backend_failure(exc)


def collective_failure(exc: BaseException, what: str, ranks: Sequence[int] | None = None) -> CommError:
    """The error for collective `what` (over global `ranks`, when known) that the backend failed
    with `exc`: which collective, on which rank, whether a peer left or stopped answering.
    Raise it ``from exc``; :func:`context` adds the training step."""
    text = first_line(exc)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if "timed out" in text.lower() or "timeout" in text.lower():
        why = ("no answer within the group's timeout: a peer in it stopped (SIGSTOP), hangs, or is far behind "
               "(comm.timeout_s bounds each collective after the first step)")
    else:
        why = "a peer in it died or left (its connection closed)"
    over = f" over global ranks {list(ranks)}" if ranks else ""
    return CommError(
        f"rank {rank}: {what}{over} failed: {why}. Look for the rank that failed first: the job's first "
        f"failure (logged after this, when a rank recorded one), or the launcher's exitcode lines for a rank "
        f"killed outright. The backend said: {text}{hosts.of_addresses(text)}"
    )


@contextmanager
def collective(what: str, group: Any = None) -> Iterator[None]:
    """Turn a backend failure raised inside the block into :func:`collective_failure` for
    collective `what` over `group` (its global ranks named)."""
    try:
        yield
    except Exception as exc:
        if not is_backend_failure(exc):
            raise
        raise collective_failure(exc, what, _group_ranks(group)) from exc


def _group_ranks(group: Any) -> list[int] | None:
    if group is None or not dist.is_initialized():
        return None
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return None


def called_collective(tb: TracebackType | None) -> str:
    """What collective a traceback failed in: the innermost pipeflow function on it (a known
    one by name) and the ``torch.distributed`` call it made, e.g. ``dist.all_reduce in
    clip_on_device (pipeflow/runtime/clip.py:80)``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    caller, torch_call, frames = None, None, []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for k, entry in enumerate(frames):
        code = entry.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        if path.startswith(package + os.sep) and path != os.path.abspath(__file__):
            caller, torch_call = entry, _torch_call(frames[k + 1:])
    if caller is None:
        return f"a collective ({torch_call or 'torch.distributed'})"
    code = caller.tb_frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    where = f"{name} ({os.path.relpath(code.co_filename, os.path.dirname(package))}:{caller.tb_lineno})"
    known = KNOWN_COLLECTIVES.get(name)
    call = f"dist.{torch_call}" if torch_call else "a collective"
    return f"{known}, {call} in {where}" if known else f"{call} in {where}"


def _torch_call(frames: Sequence[TracebackType]) -> str | None:
    """The first ``torch.distributed`` function (not a decorator's wrapper) among `frames`."""
    for entry in frames:
        code = entry.tb_frame.f_code
        if "torch/distributed" in code.co_filename.replace(os.sep, "/") and code.co_name not in ("wrapper", "<lambda>"):
            return code.co_name
    return None


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
