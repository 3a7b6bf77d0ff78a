"""Timing what the runtime adds to the layers' profiles, on this machine, at start: an action's
overhead through the stage's own code path, and the tail after the pipeline (the grad-norm
all-reduce, the data-parallel reduction, one optimizer step on scratch parameters).  The whole
step's model that uses them is :mod:`pipeflow.planning.step_model`.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipeflow.planning.profile import release_cached_memory
from pipeflow.runtime.clip import grad_norms, scale_grads
from pipeflow.runtime.parallel.fsdp import local

_REPEATS = 20


def measure_action_overhead_s(device: torch.device, repeats: int = _REPEATS) -> float:
    """Seconds an action costs beyond its layers' work: a one-parameter layer's forward and backward
    through the stage's code path (:class:`~pipeflow.runtime.stage.Stage`) minus the same layer
    called directly, as the profile times it; per action, half of the pair's difference."""
    from pipeflow.runtime.stage import Stage

    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        layer = nn.Linear(1, 1).to(device)
    stage = Stage(0, 2, [layer])
    x = torch.ones(1, 1, device=device, requires_grad=True)
    grad = torch.ones(1, 1, device=device)

    def through_stage() -> None:
        out = stage.forward(0, (x,))
        stage.backward(0, (grad,))
        _ = out

    def direct() -> None:
        torch.autograd.backward(layer(x), grad)

    extra = _median_s(through_stage, device, repeats) - _median_s(direct, device, repeats)
    layer.zero_grad(set_to_none=True)
    return max(0.0, extra / 2)


def fused_adamw(setting: bool | None, device: torch.device | str) -> bool:
    """Whether AdamW runs fused (``torch.optim.AdamW(..., fused=True)``: one kernel updates every
    tensor), as ``optim.fused`` says: the setting, or where it is None (auto), on CUDA only."""
    return bool(setting) if setting is not None else torch.device(device).type == "cuda"


def measure_tail_s(params: Sequence[torch.Tensor], device: torch.device, dp_group: Any = None, dp: int = 1,
                   repeats: int = 5, fused: bool | None = None) -> float:
    """:func:`measure_tail_parts`' total (collective over the world)."""
    return sum(measure_tail_parts(params, device, dp_group, dp, repeats, fused))


def measure_tail_parts(params: Sequence[torch.Tensor], device: torch.device, dp_group: Any = None, dp: int = 1,
                       repeats: int = 5, fused: bool | None = None) -> tuple[float, float]:
    """Seconds of what follows the pipeline on this rank: the grad-norm all-reduce over the world,
    the data-parallel all-reduce of its gradients (dp > 1), one AdamW step (fused as `fused`, see
    :func:`fused_adamw`) and zeroing the grads on a scratch copy of its parameters (the run's are
    untouched; freed, and on CUDA handed back to the device, before it returns).  Collective over
    the world.  Returns (the data-parallel all-reduce's seconds, the rest's)."""
    # a sharded parameter (DTensor) stays one: AdamW steps it through DTensor's dispatch, as the
    # run's optimizer does (about twice its local shard's time on a CPU); its bytes are the shard's
    scratch = [_scratch_copy(p) for p in params]
    sizes = [local(p).numel() for p in scratch]
    tail = measure_optimizer_s(scratch, device, repeats, fused)
    del scratch  # its copy, grads and AdamW state: a run's worth of memory, not to stay reserved
    one = torch.zeros(1, dtype=torch.float64, device=device)
    tail += _median_s(lambda: dist.all_reduce(one), device, repeats)
    reduce_s = 0.0
    if dp > 1 and sizes:
        flat = torch.zeros(sum(sizes), device=device)
        reduce_s = _median_s(lambda: dist.all_reduce(flat, group=dp_group), device, repeats)
        del flat
    release_cached_memory(device)
    return reduce_s, tail


def _scratch_copy(param: torch.Tensor) -> nn.Parameter:
    """A parameter like `param` to step in its place: a DTensor of the same mesh and placements
    over a copy of its local shard, or a plain copy."""
    if isinstance(param, DTensor):
        shard = param.to_local().detach().clone()
        return nn.Parameter(DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride()))
    return nn.Parameter(param.detach().clone())


def measure_optimizer_s(params: Sequence[nn.Parameter], device: torch.device, repeats: int = 5,
                        fused: bool | None = None) -> float:
    """Seconds of the trainer's work on `params` (scratch ones: they are stepped) after the
    pipeline: the per-tensor gradient norms and the clip's multiply, one AdamW step (fused as `fused`, see
    :func:`fused_adamw`), zeroing the gradients; 0 for none (a rank whose stages hold only frozen
    weights, LoRA's, has no optimizer step)."""
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    # not fused: None, torch's default (for-each on CUDA), which fused=False would turn off
    optimizer = torch.optim.AdamW(params, lr=0.0, fused=fused_adamw(fused, device) or None)

    coef = torch.ones((), dtype=torch.float64, device=device)

    def step() -> None:  # what the Trainer runs (pipeflow.runtime.clip), the all-reduce timed apart
        if params:
            torch.stack(grad_norms([local(p.grad) for p in params])).double().pow(2).sum()
            scale_grads([local(p.grad) for p in params], coef)
        optimizer.step()
        for p in params:
            p.grad = torch.zeros_like(p)

    seconds = _median_s(step, device, repeats)
    for p in params:
        p.grad = None
    return seconds


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
