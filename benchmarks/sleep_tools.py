"""Benchmark helpers for sleep-stages (`pipeflow.models.sleep`): inputs that make every stage pay
B, one sleep layer's measured profile, and the simulator's costs fed from it.

They belong to the benchmarks, not to the product: the sleep model itself (``model=sleep``) is a
model and imports nothing of planning; these helpers join it to `pipeflow.planning.profile`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from pipeflow.models.sleep import build_sleep
from pipeflow.planning.profile import LayerProfile, action_costs, profile_layers

if TYPE_CHECKING:
    from pipeflow.schedules.ir import Action, PipelineSchedule


def sleep_batch(num_microbatches: int, rows: int = 2, width: int = 8, seed: int = 0) -> tuple[list[tuple[torch.Tensor]], list[torch.Tensor]]:
    """Micro-batch inputs and targets for sleep-stages, the inputs requiring grad.

    A stage computes the gradient of its input only where that input requires grad, so with
    plain data stage 0's B would cost nothing; with these inputs every stage costs F, B and W
    as the simulator charges them (the input gradient is computed and dropped).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_microbatches * rows, width, generator=gen)
    y = torch.randn(num_microbatches * rows, width, generator=gen)
    return [(mb.requires_grad_(),) for mb in x.chunk(num_microbatches)], list(y.chunk(num_microbatches))


def profile_sleep_layer(forward_ms: float, backward_ms: float, weight_ms: float, repeats: int = 21) -> LayerProfile:
    """What one sleep layer really costs here: F, B, W and the full backward, measured alone by
    `pipeflow.planning.profile` (medians of `repeats`), for a layer whose input requires grad.

    ``time.sleep`` wakes late (on a small VM by a few hundred µs), so these exceed the nominal
    times; the simulator fed them (`sleep_costs`) predicts what the runtime can at best achieve.
    """
    spec = build_sleep(2, forward_ms, backward_ms, weight_ms)
    # the second layer's profile: its input requires grad, as with `sleep_batch` on stage 0
    return profile_layers(spec, torch.randn(2, 8), repeats=repeats, split_backward=True)[1]


def shared_sleep_profile(forward_ms: float, backward_ms: float, weight_ms: float, repeats: int = 21) -> Any:
    """One sleep layer's `LayerProfile` (`profile_sleep_layer`), measured on rank 0 while the
    other ranks wait, for every rank (collective)."""
    import torch.distributed as dist

    box = [profile_sleep_layer(forward_ms, backward_ms, weight_ms, repeats) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sleep_costs(schedule: "PipelineSchedule", profile: LayerProfile) -> Callable[["Action"], float]:
    """The simulator's action costs of sleep-stages (one layer per stage) from one layer's profile."""
    S = schedule.num_stages
    return action_costs([range(s, s + 1) for s in range(S)], [profile] * S, schedule)
