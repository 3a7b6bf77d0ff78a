"""Where the layers go for a run: the partition (``pipeline.balance`` / ``split_points``), the
layer profiles behind it, and the table printed at start.

Timings differ between processes, so the profile is measured once, on rank 0, and broadcast:
every rank then derives the same partition from the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipeflow.errors import PartitionError
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.partition import BALANCE_METHODS, format_partition, plan_partition
from pipeflow.planning.profile import LayerProfile, action_costs, count_layer_params, profile_layers
from pipeflow.schedules import PipelineSchedule, simulate
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action
from pipeflow.schedules.memory import stage_inflight


@dataclass
class Layout:
    """The partition of a run and what it was derived from.

    Attributes:
        ranges: ``ranges[s]``, the layers of stage s.
        profiles: per-layer profiles of one micro-batch (None when not profiled).
        inflight: micro-batches each stage holds at most under the schedule.
    """

    ranges: list[range]
    profiles: list[LayerProfile] | None
    inflight: list[int]


def choose_layout(
    spec: ModelSpec,
    schedule: PipelineSchedule,
    pipeline_cfg: Any,
    sample_input: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> Layout:
    """Partition `spec` into the schedule's stages as the ``pipeline`` config says.

    With ``pipeline.profile`` (or a ``time``/``memory`` balance) rank 0 profiles every layer on
    `sample_input` (one micro-batch for the first layer), one layer alive at a time, and
    broadcasts the profiles.  Collective: every rank of the default group must call it.

    Raises:
        PartitionError: unknown balance method, bad split points, more stages than layers.
    """
    method = pipeline_cfg.balance
    if method not in BALANCE_METHODS:
        raise PartitionError(f"pipeline.balance={method!r} is not a balance method; use one of {BALANCE_METHODS}")
    inflight = stage_inflight(schedule)
    needs_profile = method in ("time", "memory") and pipeline_cfg.split_points is None
    profiles = None
    if needs_profile or pipeline_cfg.profile:
        # the B and W halves too where the schedule splits backwards, as the planner profiles them
        splits = bool(schedule.split_backwards())
        box = [profile_layers(spec, sample_input, device, dtype, split_backward=splits) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        profiles = box[0]
    source = profiles if needs_profile or (method == "params" and profiles is not None) else spec
    ranges = plan_partition(source, schedule.num_stages, method, pipeline_cfg.split_points, inflight=inflight)
    return Layout(ranges, profiles, inflight)


def predicted_costs(layout: Layout, schedule: PipelineSchedule) -> Callable[[Action], float]:
    """Per-action seconds for the simulator from the layout's profiles (`action_costs`)."""
    assert layout.profiles is not None
    return action_costs(layout.ranges, layout.profiles, schedule)


def describe_layout(layout: Layout, spec: ModelSpec, schedule: PipelineSchedule) -> str:
    """The start-of-run report: schedule, predicted bubble and the partition table (stage, rank,
    layers, parameters, and with profiles the time per micro-batch and estimated memory)."""
    names = spec.layer_names()
    if layout.profiles is not None:
        sim = simulate(schedule, costs=predicted_costs(layout, schedule))
        basis = "profiled layer costs"
        table = format_partition(layout.ranges, names, schedule.stage_to_rank, profiles=layout.profiles,
                                 inflight=layout.inflight)
        step = f", predicted step {1e3 * sim.makespan:.1f} ms of compute"
    else:
        sim = simulate(schedule, costs={FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0})
        basis = "F = B = W"
        table = format_partition(layout.ranges, names, schedule.stage_to_rank, layer_params=count_layer_params(spec))
        step = ""
    return (
        f"pipeline: {schedule.num_ranks} ranks, {schedule.num_stages} stages, schedule={schedule.name}, "
        f"{schedule.num_microbatches} micro-batches, predicted bubble {sim.bubble:.1%} ({basis}){step}\n{table}"
    )
