"""Cases run inside every rank of a gloo group (see mp_harness): agreement checks, stage faults.

The stage-fault cases run a two-stage pipeline inside each rank's own one-rank group, so the
faults stay local and the shared group stays usable for the cases after them.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from pipeflow.run import guard
from pipeflow.runtime.transport import P2PComm
from pipeflow.run.config import Config, MLPModelConfig
from pipeflow.run.faults import FaultInjector, FaultSpec
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.planning.partition import partition_layers
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.schedules import build_schedule
from pipeflow.runtime.stage import build_stages
from toy_models import build_toy, random_batch

BATCH = 8


def _error(call: Any) -> str:
    """``Type: message`` of what `call()` raised (``no error`` if nothing)."""
    try:
        call()
    except Exception as exc:  # the tests assert on the text
        cause = f" | cause: {type(exc.__cause__).__name__}" if exc.__cause__ is not None else ""
        return f"{type(exc).__name__}: {exc}{cause}"
    return "no error"


def config_agreement(differ: bool) -> str:
    """check_same_config on a structured config; with `differ`, rank 1 has other overrides."""
    cfg = OmegaConf.structured(Config(model=MLPModelConfig()))
    cfg.train.run_dir = f"outputs/rank{dist.get_rank()}"  # may differ: rank 0's is broadcast
    if differ and dist.get_rank() == 1:
        cfg.pipeline.num_microbatches = 4
        cfg.comm.timeout_s = 60.0
    return _error(lambda: guard.check_same_config(cfg)) if differ else guard.check_same_config(cfg)


def program_agreement() -> str:
    """check_same_program when rank 1 built its schedule for another micro-batch count."""
    p = dist.get_world_size()
    schedule = build_schedule("1f1b", p, 4 if dist.get_rank() == 0 else 8)
    return _error(lambda: guard.check_same_program(schedule, partition_layers(2 * p, p)))


@functools.lru_cache(maxsize=1)
def _own_group() -> Any:
    """A one-rank group per rank (every rank creates every group, as new_group requires)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def stage_fault(kind: str, microbatch: int = 1, check_finite: bool = False, nan_grad_stage: int | None = None) -> str:
    """A two-stage pipeline on this rank alone (interleaved 1F1B, p = 1); `kind` injected into
    stage 0's forward of `microbatch` at step 1 (step 0 runs clean and negotiates shapes).
    With `check_finite`, a FiniteCheck runs after each step; `nan_grad_stage` turns that
    stage's first parameter gradient into NaN from step 1 on (a backward-only fault)."""
    group = _own_group()
    spec = build_toy("mlp")
    schedule = build_schedule("interleaved_1f1b", 1, 2, stages_per_rank=2)
    ranges = partition_layers(len(spec.layers), 2)
    stages = build_stages(spec, ranges, [0, 1], dtype=torch.float64)
    pipe = Pipeline(stages, schedule, P2PComm(group, torch.device("cpu"), timeout_s=10.0))
    injector = FaultInjector(FaultSpec(kind, rank=dist.get_rank(), step=1, microbatch=microbatch, stage=0), dist.get_rank())
    injector.install(stages)
    finite = FiniteCheck(stages, 2, torch.device("cpu")) if check_finite else None
    if nan_grad_stage is not None:
        weight = stages[nan_grad_stage].parameters()[0]
        weight.register_hook(lambda g: g * float("nan") if injector.step == 1 else g)

    def run() -> None:
        for step in range(2):
            injector.step = step
            x, y = random_batch("mlp", BATCH, seed=step)
            pipe.run([(mb,) for mb in x.chunk(2)], list(y.chunk(2)))
            if finite is not None:
                finite.check(step, schedule.stage_to_rank, group)

    return _error(run)


def first_failure_is_shared() -> list[str | None]:
    """Rank 1 records a failure first, then rank 0: rank 0 reads rank 1's back from the store."""
    rank = dist.get_rank()
    seen: list[str | None] = []
    for turn in (1, 0):
        if rank == turn:
            seen.append(guard.record_failure(RuntimeError(f"boom on rank {rank}"), rank))
        dist.barrier()
    return seen
