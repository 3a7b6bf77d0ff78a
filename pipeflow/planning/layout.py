"""Where the layers go for a run: the partition (``pipeline.balance`` / ``split_points``), the
layer profiles behind it, what the simulator predicts for it, and the table printed at start.

The prediction is made once, when the layout is chosen (:class:`Prediction`); the start-of-run
report, the run's metrics and the sweep table all read that one.

Timings differ between processes, so the profile is measured once, on rank 0, and broadcast:
every rank then derives the same partition from the same numbers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import PartitionError, PipeflowError
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.partition import BALANCE_METHODS, format_partition, plan_partition
from pipeflow.planning.costs.expert import expert_layers, expert_profiles
from pipeflow.planning.costs.tensor import split_profiles
from pipeflow.planning.profile import LayerProfile, action_costs, count_layer_params, profile_layers
from pipeflow.schedules import PipelineSchedule, forward_only, lower, simulate
from pipeflow.planning.links import describe_dp_groups
from pipeflow.planning.step_model import StepCosts, describe_costs, predict_step
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT
from pipeflow.schedules.memory import RankMemory, StageBytes, stage_inflight, tensor_memory
from pipeflow.schedules.offload import HostLink, OffloadCosts, OffloadPlan, check_mode, group_bytes_of, plan_offload
from pipeflow.schedules.simulator import simulated_plan

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
        memory_bytes: peak tensor bytes per pipeline rank (``memory[r].peak.total``; empty
            without profiles).
        memory: per pipeline rank, the predicted tensor bytes by category resident between
            steps and at the in-step peak (`pipeflow.schedules.memory.tensor_memory`: the same
            quantity ``pipeflow.runtime.memory`` measures; empty without profiles).
        offloaded_bytes: per pipeline rank, the activation bytes ``pipeline.offload`` copies to
            the host in a step (empty without offloading).
    """

    basis: str
    bubble: float
    step_s: float
    memory_bytes: tuple[float, ...]
    memory: tuple[RankMemory, ...] = ()
    offloaded_bytes: tuple[float, ...] = ()


def trainable_bytes(profiles: list[LayerProfile], layers: range) -> float | None:
    """Bytes of the parameters that train in `layers` (their gradients and optimizer state), or
    None when all of them do (no frozen parameters: the common case)."""
    chosen = [profiles[i] for i in layers]
    if all(p.trainable_bytes is None for p in chosen):
        return None
    return math.fsum(p.param_bytes if p.trainable_bytes is None else p.trainable_bytes for p in chosen)


def stage_bytes(
    ranges: list[range], profiles: list[LayerProfile], schedule: PipelineSchedule, input_bytes: float = 0.0,
    target_bytes: float = 0.0,
) -> list[StageBytes]:
    """What each stage costs in tensor bytes, from its layers' profiles, as the runtime holds it.

    A stage keeps per micro-batch what its layers keep (``activation_bytes``: saved tensors and
    outputs, their inputs excluded), less its last outputs when they go to another rank (freed
    once sent; the sent copy is a comm buffer).  The last stage's loss keeps the last layer's
    ``loss_bytes`` (when not profiled, estimated as one more copy of the outputs: cross-entropy's
    log-probabilities); its last outputs only when the loss saves them or the stage splits its
    backward (a stage keeps each layer's outputs for W only then).  A split backward's B keeps
    each layer's output gradients until W (the last layer's is a receive buffer when the
    outputs went to another rank).
    Stage 0 holds every micro-batch's input (`input_bytes` each) for the whole step, the last
    stage every micro-batch's targets (`target_bytes` each).  The boundary is the last layer's
    output bytes.  What offloading moves (``offloadable``) is the rest of the kept bytes and the
    loss's: a split stage keeps its layers' outputs on the device for W, and an output handed to
    a stage on the same rank is that stage's input.
    """
    result, m = [], schedule.num_microbatches
    split = {s for s, _ in schedule.split_backwards()}
    for s, r in enumerate(ranges):
        layers = [profiles[i] for i in r]
        out = layers[-1].output_bytes if layers else 0
        act = math.fsum(p.activation_bytes for p in layers)
        last = s == len(ranges) - 1
        if not last and schedule.stage_to_rank[s + 1] != schedule.stage_to_rank[s]:
            act -= out
        loss = 0.0
        if last and layers:
            loss = float(out if layers[-1].loss_bytes is None else layers[-1].loss_bytes)
            if s not in split and not layers[-1].loss_saves_output:
                act -= out
        data = m * ((input_bytes if s == 0 else 0.0) + (target_bytes if last else 0.0))
        sent = not last and schedule.stage_to_rank[s + 1] != schedule.stage_to_rank[s]
        stays = math.fsum(p.output_bytes for p in layers[:-1]) if s in split else 0.0
        if not sent and (s in split or not last):
            stays += out
        # a split B keeps the gradient at each layer's outputs for W; the last one's is the received
        # gradient itself when the outputs went to another rank (a receive buffer, counted as comm)
        split_held = math.fsum(p.output_bytes for p in layers) - (out if sent else 0.0)
        result.append(StageBytes(params=math.fsum(p.param_bytes for p in layers), activations=max(act, 0.0),
                                 split_held=split_held, boundary=out, loss=loss,
                                 data=data, offloadable=max(act - stays, 0.0) + loss,
                                 trainable=trainable_bytes(profiles, r)))
    return result


@dataclass(frozen=True)
class MemorySetting:
    """What the tensor-bytes prediction needs beyond the profiles.

    Attributes:
        dp: data-parallel replicas of each stage.
        shard: ``parallel.shard`` (none | optimizer | full).
        lowering: the lowering the runtime interprets (``Posting.options(...)[0]``): when recvs are posted.
        input_bytes: bytes of one micro-batch's model input (stage 0 holds every micro-batch's
            for the whole step).
        target_bytes: bytes of one micro-batch's targets (the last stage holds them all).
        evaluates: whether the run evaluates (its forward-only passes hold every buffer they
            receive until the pass ends, and the receive pool keeps them).
    """

    dp: int = 1
    shard: str = "none"
    lowering: str = "ahead"
    input_bytes: float = 0.0
    target_bytes: float = 0.0
    evaluates: bool = True


def predict(
    schedule: PipelineSchedule, ranges: list[range], profiles: list[LayerProfile] | None,
    setting: MemorySetting = MemorySetting(),
) -> Prediction:
    """Simulate `schedule` with the stages' profiled costs (``action_costs``), or with F = B = W
    when there are no profiles, and predict each rank's tensor bytes from the profiles
    (`stage_bytes`, walked over the lowering the runtime interprets, parameters sharded as the
    `setting` says; AdamW's two states per parameter)."""
    if profiles is None:
        sim = simulate(schedule, costs={FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0})
        return Prediction(UNIT_COSTS, sim.bubble, math.nan, ())
    sim = simulate(schedule, costs=action_costs(ranges, profiles, schedule))
    costs = stage_bytes(ranges, profiles, schedule, setting.input_bytes, setting.target_bytes)
    memory = predicted_memory(schedule, costs, setting)
    return Prediction(PROFILED, sim.bubble, sim.makespan, tuple(m.peak.total for m in memory), memory)


def predicted_memory(schedule: PipelineSchedule, costs: list[StageBytes], setting: MemorySetting,
                     offload: OffloadPlan | None = None, timing: Any = None) -> tuple[RankMemory, ...]:
    """Each rank's tensor bytes (`tensor_memory`, AdamW's two states per parameter) walked over the
    lowering the runtime interprets (with `offload`'s marks, their copies' ends from `timing`) and,
    where the run evaluates, over its forward-only programs."""
    evaluation = None
    if setting.evaluates:
        evaluation = lower(forward_only(schedule.num_ranks, schedule.num_microbatches, schedule.stage_to_rank),
                           setting.lowering)
    return tuple(tensor_memory(schedule, costs, 2.0, setting.dp, setting.shard,
                               programs=lower(schedule, setting.lowering, offload=offload), eval_programs=evaluation,
                               timing=timing))


@dataclass(frozen=True)
class Layout:
    """The partition of a run, what it was derived from and what it is predicted to cost.

    Attributes:
        ranges: ``ranges[s]``, the layers of stage s.
        profiles: per-layer profiles of one micro-batch (None when not profiled).
        inflight: micro-batches each stage holds at most under the schedule.
        prediction: the simulator's prediction for this partition under the run's schedule.
        note: lines added to the start-of-run report (``schedule=auto``: its synthesis).
        memory_setting: what the memory prediction assumed (sharding, lowering, input).
        step_costs: the runtime's costs measured at start, when the prediction includes them.
        offload: ``pipeline.offload``'s plan (:func:`with_offload`; empty: nothing offloaded).
        host_link: the host link the plan was made for (None without offloading).
    """

    ranges: list[range]
    profiles: list[LayerProfile] | None
    inflight: list[int]
    prediction: Prediction
    note: str = ""
    memory_setting: MemorySetting = MemorySetting()
    step_costs: StepCosts | None = None
    offload: OffloadPlan = OffloadPlan()
    host_link: HostLink | None = None


def with_offload(layout: Layout, schedule: PipelineSchedule, mode: str, link: HostLink,
                 memory_limit: float | None = None) -> Layout:
    """The layout with ``pipeline.offload=mode``'s plan made for this run (`link`: the host link
    measured at start; `memory_limit`: the bytes a rank's predicted peak should fit, which
    ``auto`` offloads more for where the hidden groups do not suffice) and its prediction re-made
    with it: the step with the copies timed, each rank's tensor bytes with the offloaded groups
    released and the bytes offloaded.

    The plan is made on the same simulation as the prediction (the whole step with the runtime's
    costs when measured, else the profiled layers); without profiles no group's bytes are known:
    ``all`` offloads every group, reloaded right before its B, ``auto`` none.
    """
    check_mode(mode)
    if mode == "none":
        return replace(layout, offload=OffloadPlan(mode), host_link=link)
    setting = layout.memory_setting
    if layout.profiles is None:
        copies = OffloadCosts(lambda g: 0.0, replace(link, overlapped=False))
        plan = simulated_plan(schedule, mode, copies, posting=setting.lowering)
        return replace(layout, offload=plan, host_link=link)
    costs = stage_bytes(layout.ranges, layout.profiles, schedule, setting.input_bytes, setting.target_bytes)
    copies = OffloadCosts(group_bytes_of([c.offloadable for c in costs]), link)

    @functools.lru_cache(maxsize=None)  # a plan is simulated once, whether timed, checked or predicted
    def simulated(plan: OffloadPlan):
        if layout.step_costs is not None:
            return predict_step(schedule, layout.ranges, layout.profiles, layout.step_costs, (plan, copies))
        programs = lower(schedule, setting.lowering, offload=plan)
        return simulate(schedule, programs, action_costs(layout.ranges, layout.profiles, schedule), offload=copies)

    def timed(plan: OffloadPlan):
        sim = simulated(plan)
        return sim.makespan, sim.step_times, sim.reload_waits

    def fits(plan: OffloadPlan) -> bool:
        return max(m.peak.total for m in predicted_memory(schedule, costs, setting, plan, simulated(plan))) <= memory_limit

    plan = plan_offload(schedule, mode, copies, timed, fits if memory_limit is not None else None)
    sim = simulated(plan)
    memory = predicted_memory(schedule, costs, setting, plan, sim)
    tail = layout.step_costs.tail_s if layout.step_costs is not None else 0.0
    prediction = replace(layout.prediction, bubble=sim.bubble, step_s=sim.makespan + tail,
                         memory_bytes=tuple(m.peak.total for m in memory), memory=memory,
                         offloaded_bytes=tuple(sim.offloaded_bytes))
    return replace(layout, prediction=prediction, offload=plan, host_link=link)


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
    dp: int = 1,
    shard: str = "none",
    lowering: str = "ahead",
    evaluates: bool = True,
    sample_target: Any = None,
    autocast_dtype: torch.dtype | None = None,
    compiled: Any = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    ep: int = 1,
    cp: int = 1,
) -> Layout:
    """Partition `spec` into the schedule's stages as the ``pipeline`` config says.

    With ``pipeline.profile`` (or a ``time``/``memory`` balance) rank 0 profiles every layer on
    `sample_input` (one micro-batch for the first layer), one layer alive at a time, and
    broadcasts the profiles.  Collective: every rank of the default group must call it.
    `dp`, `shard`, `lowering` and `evaluates` are what the memory prediction assumes
    (`MemorySetting`), with the sizes of `sample_input` and `sample_target` (one micro-batch's
    targets; the loss is profiled on them).  `autocast_dtype` is the run's compute dtype
    (``train.precision``), which the profile runs the layers in; `compiled` (``train.compile``'s
    :class:`~pipeflow.runtime.compile.CompileOptions`, or None) how it compiles them.  With `tp`
    > 1 the unsplit profiles become one tp rank's (`pipeflow.planning.costs.tensor`: compute and
    memory of the split share, the plan's collectives over an assumed NVLink-class link); with
    `ep` > 1 one ep rank's (1/ep of the experts' parameters, and the MoE layers' all_to_alls
    over an assumed link: `pipeflow.planning.costs.expert`).

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
        profile = functools.partial(profile_layers, spec, sample_input, device, dtype, split_backward=splits,
                                    sample_target=sample_target, autocast_dtype=autocast_dtype, compiled=compiled,
                                    context_parallel=cp)
        box = [_profiled_or_error(profile) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], PipeflowError):  # every rank names what rank 0 found (a damaged weights file)
            raise box[0]
        profiles = box[0]
        if tp > 1:
            profiles = split_profiles(profiles, tp, sequence_parallel=sequence_parallel)
        if ep > 1:  # parallel.ep: a rank holds 1/ep of each MoE layer's experts and exchanges its tokens
            profiles = expert_profiles(profiles, expert_layers(spec), ep)
    source = profiles if needs_profile or (method == "params" and profiles is not None) else spec
    ranges = plan_partition(source, schedule.num_stages, method, pipeline_cfg.split_points, inflight=inflight)
    setting = MemorySetting(dp, shard, lowering, float(_input_bytes(sample_input)),
                            float(_input_bytes(sample_target)), evaluates)
    return Layout(ranges, profiles, inflight, predict(schedule, ranges, profiles, setting), memory_setting=setting)


def _profiled_or_error(profile: Any) -> list[LayerProfile] | PipeflowError:
    """`profile()`'s layer profiles, or the pipeflow error it raised (building a layer: a tensor
    missing from ``model.init_from``, NaN in a loaded weight), for rank 0 to broadcast in their
    place, so that every rank raises it rather than rank 0 alone."""
    try:
        return profile()
    except PipeflowError as exc:
        return exc


def _input_bytes(sample: Any) -> int:
    """Bytes of the tensors in one micro-batch's input."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if isinstance(sample, (tuple, list)):
        return sum(_input_bytes(t) for t in sample)
    return 0


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
    links = getattr(layout.step_costs, "links", None)
    if links is not None:  # several hosts: every link of the program, the slow ones named
        boundary = max((layout.profiles[r.stop - 1].output_bytes for r in layout.ranges[:-1]), default=0)
        note += f"\n{links.describe(float(boundary))}"
    groups = getattr(layout.step_costs, "dp_groups", ())
    if groups:
        note += f"\n{describe_dp_groups(groups)}"
    tp_links = getattr(layout.step_costs, "tp_links", None)
    if tp_links is not None and tp_links.several_hosts:  # several hosts: every tp group's link, a slow one named
        note += f"\n{tp_links.describe()}"
    ep_links = getattr(layout.step_costs, "ep_links", None)
    if ep_links is not None:  # parallel.ep: the MoE layers' exchanges per step on the ep link measured at start
        note += f"\n{ep_links.describe(layout.profiles, layout.ranges, schedule)}"
    if layout.offload.mode != "none":
        note += f"\n{describe_offload(layout, schedule)}"
    memory = f"\n{format_memory(prediction.memory, layout.memory_setting)}" if prediction.memory else ""
    if getattr(spec, "lora", None) is not None:  # what trains: the memory above counts its state only
        from pipeflow.models.lora import report

        note += f"\n{report(spec)}"
    return (
        f"pipeline: {schedule.num_ranks} ranks, {schedule.num_stages} stages, schedule={schedule.name}, "
        f"{schedule.num_microbatches} micro-batches, predicted bubble {prediction.bubble:.1%} "
        f"({prediction.basis}){step}{note}\n{table}{memory}"
    )


def describe_offload(layout: Layout, schedule: PipelineSchedule) -> str:
    """The start-of-run line of ``pipeline.offload``: the groups offloaded, the link planned for
    and the predicted bytes copied per step."""
    link, groups = layout.host_link, len(layout.offload.reloads)
    total = schedule.num_stages * schedule.num_microbatches
    where = ("" if link is None else f"; host link {link.d2h_bytes_per_s / 1e9:.1f} GB/s out, "
             f"{link.h2d_bytes_per_s / 1e9:.1f} GB/s back{'' if link.overlapped else ', on the compute thread (no copy engine)'}")
    moved = layout.prediction.offloaded_bytes
    per_rank = f"; predicted {', '.join(f'{b / 1e6:.2f}' for b in moved)} MB to the host per step per rank" if moved else ""
    return f"pipeline.offload={layout.offload.mode}: {groups} of {total} (stage, micro-batch) activation groups{where}{per_rank}"


def format_memory(memory: tuple[RankMemory, ...], setting: MemorySetting) -> str:
    """The predicted tensor memory per pipeline rank (MB): parameters, gradients and optimizer
    state resident between steps, then the in-step peak by category (parameters there include
    the unsharded copy that ``parallel.shard=full`` all-gathers), and both totals."""
    heads = ["rank", "params", "grads", "optimizer", "peak: params", "grads", "optimizer", "activations", "comm",
             "tensor MB resident", "tensor MB peak"]
    rows = [[str(r), *(f"{v / 1e6:.2f}" for v in m.resident.as_tuple()[:3]),
             *(f"{v / 1e6:.2f}" for v in m.peak.as_tuple()), f"{m.resident.total / 1e6:.2f}", f"{m.peak.total / 1e6:.2f}"]
            for r, m in enumerate(memory)]
    widths = [max(len(h), *(len(row[k]) for row in rows)) for k, h in enumerate(heads)]
    lines = [f"predicted tensor memory per pipeline rank (MB; parallel.shard={setting.shard}, dp={setting.dp}): "
             "resident between steps, then at the in-step peak"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [heads, *rows]]
    return "\n".join(lines)
