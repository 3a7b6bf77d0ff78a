"""Where the layers go for a run: the partition (``pipeline.balance`` / ``split_points``), the
layer profiles behind it, what the simulator predicts for it, and the table printed at start.

The prediction is made once, when the layout is chosen (:class:`Prediction`); the start-of-run
report, the run's metrics and the sweep table all read that one.

Timings differ between processes, so the profile is measured once, on rank 0, and broadcast:
every rank then derives the same partition from the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import PartitionError
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.partition import BALANCE_METHODS, format_partition, plan_partition
from pipeflow.planning.profile import LayerProfile, action_costs, count_layer_params, profile_layers
from pipeflow.schedules import PipelineSchedule, simulate
from pipeflow.planning.search import rank_memory
from pipeflow.planning.step_model import StepCosts, describe_costs, predict_step
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT
from pipeflow.schedules.memory import stage_inflight

PROFILED, UNIT_COSTS = "profiled layer costs", "F = B = W"
WHOLE_STEP = "profiled layers and the measured runtime"


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for a layout under its schedule.

    Attributes:
        basis: the costs simulated: ``"profiled layer costs"``, with the runtime's measured costs
            ``"profiled layers and the measured runtime"`` (:func:`with_step_costs`) or, without
            profiles, ``"F = B = W"``.
        bubble: the simulated bubble (``SimResult.bubble``).
        step_s: the simulated step in seconds: the whole step with the runtime's costs, else the
            compute of the pipeline (NaN without profiles: unit costs have no seconds).
        memory_bytes: peak bytes per pipeline rank, parameters with grads and optimizer state plus
            activations held (``pipeflow.planning.search.rank_memory``; empty without profiles).
    """

    basis: str
    bubble: float
    step_s: float
    memory_bytes: tuple[float, ...]


def predict(schedule: PipelineSchedule, ranges: list[range], profiles: list[LayerProfile] | None) -> Prediction:
    """Simulate `schedule` with the stages' profiled costs (``action_costs``), or with F = B = W
    when there are no profiles, and estimate each rank's memory from the profiles."""
    if profiles is None:
        sim = simulate(schedule, costs={FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0})
        return Prediction(UNIT_COSTS, sim.bubble, math.nan, ())
    sim = simulate(schedule, costs=action_costs(ranges, profiles, schedule))
    param = [sum(profiles[i].param_bytes for i in r) for r in ranges]
    act = [sum(profiles[i].activation_bytes for i in r) for r in ranges]
    return Prediction(PROFILED, sim.bubble, sim.makespan, tuple(rank_memory(schedule, param, act)))


@dataclass(frozen=True)
class Layout:
    """The partition of a run, what it was derived from and what it is predicted to cost.

    Attributes:
        ranges: ``ranges[s]``, the layers of stage s.
        profiles: per-layer profiles of one micro-batch (None when not profiled).
        inflight: micro-batches each stage holds at most under the schedule.
        prediction: the simulator's prediction for this partition under the run's schedule.
        note: lines added to the start-of-run report (``schedule=auto``: its synthesis).
        step_costs: the runtime's costs measured at start, when the prediction includes them.
    """

    ranges: list[range]
    profiles: list[LayerProfile] | None
    inflight: list[int]
    prediction: Prediction
    note: str = ""
    step_costs: StepCosts | None = None


def with_step_costs(layout: Layout, schedule: PipelineSchedule, costs: StepCosts) -> Layout:
    """The layout with its prediction of the whole step: the profiled layers plus the runtime's
    measured costs (`pipeflow.planning.step_model`); unchanged without profiles."""
    if layout.profiles is None:
        return layout
    sim = predict_step(schedule, layout.ranges, layout.profiles, costs)
    prediction = replace(layout.prediction, basis=WHOLE_STEP, bubble=sim.bubble, step_s=sim.makespan + costs.tail_s)
    return replace(layout, prediction=prediction, step_costs=costs)


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
    return Layout(ranges, profiles, inflight, predict(schedule, ranges, profiles))


def describe_layout(layout: Layout, spec: ModelSpec, schedule: PipelineSchedule) -> str:
    """The start-of-run report: schedule, predicted bubble and the partition table (stage, rank,
    layers, parameters, and with profiles the time per micro-batch and estimated memory)."""
    names = spec.layer_names()
    prediction = layout.prediction
    if layout.profiles is not None:
        table = format_partition(layout.ranges, names, schedule.stage_to_rank, profiles=layout.profiles,
                                 inflight=layout.inflight)
        step = f", predicted step {1e3 * prediction.step_s:.1f} ms of compute"
        if layout.step_costs is not None:
            step = f", predicted step {1e3 * prediction.step_s:.1f} ms ({describe_costs(layout.step_costs)})"
    else:
        table = format_partition(layout.ranges, names, schedule.stage_to_rank, layer_params=count_layer_params(spec))
        step = ""
    note = f"\n{layout.note}" if layout.note else ""
    return (
        f"pipeline: {schedule.num_ranks} ranks, {schedule.num_stages} stages, schedule={schedule.name}, "
        f"{schedule.num_microbatches} micro-batches, predicted bubble {prediction.bubble:.1%} "
        f"({prediction.basis}){step}{note}\n{table}"
    )
