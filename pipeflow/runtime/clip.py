"""Global grad-norm clipping on the device: the norm over every stage's gradients with one
all-reduce, the coefficient kept on the device and multiplied in (no host read: on a GPU the
host runs on).  Equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.runtime.parallel.fsdp import is_sharded, local, splits


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each gradient, on its device (``torch._foreach_norm``, one kernel per dtype;
    float16/bfloat16 reduced in float32): no float64 copy of any gradient, no host read."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, g in enumerate(grads):
        groups[(g.device, g.dtype)].append(k)
    for (_, dtype), ks in groups.items():
        half = dtype in (torch.float16, torch.bfloat16)
        got = torch._foreach_norm([grads[k].detach() for k in ks], 2, dtype=torch.float32 if half else None)
        for k, n in zip(ks, got):
            norms[k] = n
    return norms  # type: ignore[return-value]


def _sum_of_squares(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squared `norms`, in float64 (0 for none)."""
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(norms).double().pow(2).sum()


def clip_on_device(
    params: list[torch.nn.Parameter], max_norm: float, group: Any, extra: torch.Tensor, skip: set[int] = frozenset(),
    replicas: int = 1, norms: list[torch.Tensor] | None = None, split: dict[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip by the norm over every stage's gradients, all on the device (one all-reduce).

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.  `extra` (e.g. the loss,
    non-zero on the last stage only) rides along in the same all-reduce.  Parameters whose id
    is in `skip` (copies of a tied parameter held elsewhere too) are scaled but not counted.
    With data (and tensor) parallelism the group spans `replicas` (dp x tp) identical copies of
    every whole gradient (after their dp all-reduce): each counts 1/replicas, while a gradient
    sharded (a DTensor: over the dp group with ``parallel.shard=full``, over the tp group with
    ``parallel.tp``) counts its local shard once per copy of that shard, so one all-reduce over
    the world gives the norm of one model.  The coefficient
    ``min(1, max_norm / (norm + 1e-6))`` is a device tensor multiplied in (``_foreach_mul_``),
    as torch's clipping does; a non-finite norm makes the gradients non-finite, and the caller
    skips that update.

    Args:
        norms: each gradient's norm (:func:`grad_norms` of the params' gradients, in order),
            when the caller computed them already.
        split: ``{id(param): ranks}`` for parameters split over that many of the `replicas` ranks
            outside DTensor (``parallel.ep``'s experts): each counts 1/(replicas / ranks).

    Returns:
        (total norm before clipping, the all-reduced `extra`), float64 tensors on the device.
    """
    with_grad = [p for p in params if p.grad is not None]
    if norms is None:
        norms = grad_norms([local(p.grad) for p in with_grad])
    device = extra.device
    # the norms squared and summed in float64, each divided by how many ranks hold that same
    # shard (a whole gradient: every dp and tp rank; a sharded one: only the ranks of the mesh
    # dimensions it is not sharded over)
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p, n in zip(with_grad, norms):
        if id(p) not in skip:
            by_copies[max(1, copies(p.grad, replicas) // (split or {}).get(id(p), 1))].append(n)
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for count, group_norms in sorted(by_copies.items()):
        squares = _sum_of_squares(group_norms, device)
        total_sq = total_sq + (squares / count if count > 1 else squares)
    packed = torch.cat([total_sq.reshape(1).to(device, torch.float64), extra.to(torch.float64).reshape(-1)])
    dist.all_reduce(packed, group=group)
    total = packed[0].sqrt()
    if max_norm > 0 and with_grad:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        scale_grads([local(p.grad) for p in with_grad], coef)
    return total, packed[1:]


def copies(grad: torch.Tensor, replicas: int) -> int:
    """How many ranks of the world (of `replicas` holding each whole gradient) hold the same
    values as this rank's `grad`: `replicas` for a whole one, fewer by the size of every mesh
    dimension a DTensor gradient is sharded over."""
    if not is_sharded(grad):
        return replicas
    split = 1
    for dim, placement in enumerate(grad.placements):
        if splits(placement):
            split *= grad.device_mesh.size(dim)
    return max(1, replicas // split)


def scale_grads(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient by the device scalar `coef` (one foreach kernel per device and dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, dtype), gs in groups.items():
        wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        torch._foreach_mul_(gs, coef.to(device, wide))
