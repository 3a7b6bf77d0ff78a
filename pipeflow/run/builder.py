"""The one place a run is built: every object constructed from the config with its settings.

:func:`build_run` turns the resolved config into this rank's part of the pipeline in named
phases, each returning a small value the next takes (:mod:`pipeflow.run.phases`): the plan
(model, data, schedule, layout: :class:`RunPlan`), the topology (mesh, transport, deadlines:
:class:`Topology`), the schedule settled on the measured link, the parts (stages, tied weights,
reducer, compiled layers: :class:`ModelParts`), the layout with the runtime's measured costs,
and the loop (pipeline, the step's update with its optimizer, metrics: :class:`Loop`); the
:class:`~pipeflow.run.trainer.Trainer` holds those values and only runs them.  Nothing is
configured by assigning attributes from outside after construction.  The model's own building
(the ``model`` config's builder) is :mod:`pipeflow.run.model_build`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pipeflow.config.data import typed_data
from pipeflow.config.schema import RecvPosting, check_config, tensor_degree
from pipeflow.data import (TOKEN_DATA, build_batches, microbatch_inputs, microbatch_targets, sequence_lengths, shard,
                           split_microbatches)
from pipeflow.data.batch_ramp import BatchRamp, RampedBatches
from pipeflow.errors import ConfigError
from pipeflow.models.hf_experts import reading_experts_of
from pipeflow.models.lora import check_fused_targets
from pipeflow.observability.metrics import RunMetrics
from pipeflow.planning.auto import auto_for_count, auto_for_layout
from pipeflow.planning.calibration import calibrator, stage_boundary_bytes
from pipeflow.planning.costs.comm import measure_transfer_s
from pipeflow.planning.costs.context import largest_pass_bytes
from pipeflow.planning.costs.expert import expert_layers
from pipeflow.planning.costs.runtime_timing import fused_adamw
from pipeflow.planning.costs.tensor import largest_collective_bytes
from pipeflow.planning.ep_links import expert_exchange
from pipeflow.planning.layout import Layout, choose_layout, with_offload, with_step_costs
from pipeflow.planning.rehearsal import with_rehearsal
from pipeflow.planning.step_model import measure_step_costs, with_fsdp_shards
from pipeflow.run import guard
from pipeflow.run.assembly import (attach_context_parallel, boundary_bytes, full_shard, host_link, mesh_order,
                                   rehearsal_steps_for, run_meta, shape_mode, straggler_watch, watchdog,
                                   write_auto_schedule)
from pipeflow.run.compile_phase import compile_and_warm_up, compile_options
from pipeflow.run.faults import install_from_env
from pipeflow.run.model_build import build_spec, built_on_every_rank
from pipeflow.run.phases import Loop, ModelParts, RunPlan, Topology
from pipeflow.run.replan import replanned
from pipeflow.run.step_update import StepUpdate
from pipeflow.run.trainer import Trainer, unique_parameters
from pipeflow.run.workspace import prepare as prepare_workspace
from pipeflow.runtime.compile import forget_compiled
from pipeflow.runtime.events import EventRecorder, clock_for
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.runtime.keyed_dropout import key_dropout
from pipeflow.runtime.memory import MemoryAccountant, device_memory_limit
from pipeflow.runtime.parallel import ring_attention
from pipeflow.runtime.parallel.expert_parallel import expert_groups, expert_parameters, expert_rank, split_experts
from pipeflow.runtime.parallel.mesh import GradReducer, build_mesh
from pipeflow.runtime.parallel.routing import routing_sync
from pipeflow.runtime.parallel.tensor_parallel import parallelize_stages
from pipeflow.runtime.parallel.zero import build_optimizer
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import AheadTuner, Posting
from pipeflow.runtime.precision import LossScaler, checkpoint_every, compute_dtype
from pipeflow.runtime.stage import build_stages, layers_by_index
from pipeflow.runtime.tied import TiedWeights
from pipeflow.runtime.transport import Deadlines, P2PComm
from pipeflow.schedules import Synthesis, build_schedule, relabel_ranks
from pipeflow.schedules.auto import AUTO
from pipeflow.schedules.offload import HostLink

log = logging.getLogger("pipeflow")


def build_run(cfg: DictConfig, device: torch.device) -> Trainer:
    """Build this rank's part of the run the config describes (collective: every rank calls it),
    in named phases: :func:`plan_run` (model, data, schedule, layout), :func:`connect` (mesh and
    transport), :func:`settle_schedule` (``schedule=auto`` on the measured link), :func:`build_parts`
    (the stages and what holds their parameters), :func:`measure_layout` (the runtime's costs,
    offload) and :func:`build_loop` (pipeline, optimizer, metrics: the Trainer).

    Args:
        cfg: the resolved Hydra config (see ``configs/`` and :mod:`pipeflow.config.schema`).
        device: this rank's device.

    Returns:
        The training loop over everything built here.

    Raises:
        ConfigMismatchError: the ranks resolved different configs.
        ConfigError, ScheduleError, PartitionError: a config the run cannot use.
    """
    cfg = replanned(cfg, device)  # parallel.replan: the degrees for the world that met
    plan = plan_run(cfg, device)
    topology = connect(cfg, plan, device)
    plan, synthesis, link = settle_schedule(cfg, plan, topology, device)
    parts = build_parts(cfg, plan, topology, device)
    layout = measure_layout(cfg, plan, topology, parts, link, device)
    choice = topology.mesh.order_choice
    if choice is not None and layout.step_costs is not None:  # the order line on the pipeline line's step
        topology.mesh.order_reason = choice.restated(layout.prediction.step_s, layout.step_costs.links)
    return build_loop(cfg, plan, topology, parts, layout, synthesis, device)


def plan_run(cfg: DictConfig, device: torch.device) -> RunPlan:
    """The model, the data and the layout: the config checked alike on every rank, the schedule,
    the first batch, and the partition chosen from this rank's profile (broadcast)."""
    config_hash = guard.check_same_config(cfg)  # before anything a rank could disagree on
    dp, pp = check_config(cfg, dist.get_world_size())
    dtype = getattr(torch, cfg.train.param_dtype)
    spec = build_spec(cfg.model)
    tp = tensor_degree(cfg.parallel)
    m = cfg.pipeline.num_microbatches
    schedule = build_schedule(cfg.schedule.name, pp, m, cfg.schedule.stages_per_rank, cfg.schedule.placement,
                              cfg.schedule.path, cfg.schedule.stage_to_rank)
    batches = build_batches(typed_data(cfg.data), cfg.model, chunks=dp * m)
    first = shard(batches.train.get(0), 0, dp)
    cp = int(cfg.parallel.cp)
    if cp > 1:  # a rank holds T / cp of each row: the profile, memory and step predictions at that length
        first = ring_attention.split_batch(*first, 0, cp)
    sample, sample_target = split_microbatches(first[0], m)[0], split_microbatches(first[1], m)[0]
    # auto's choice is made by the whole world (every replica alike, so no replica waits on a
    # slower setting) and within about a quarter of the run, so short runs and sweeps measure
    # the chosen setting for most of their steps
    trials = max(1, min(10, (cfg.train.max_steps - 2) // 8))
    posting = Posting(RECVS_AHEAD[cfg.comm.post_recvs], tuner=AheadTuner(trials=trials), agree_over_world=True)
    options = compile_options(cfg, dp * m)  # train.compile (None: eager): the profile and the stages alike
    if options is not None:
        forget_compiled()  # this run's layers compile afresh (a sweep's jobs share the process)
    ep = cfg.parallel.ep  # experts split over each stage's dp ranks
    layout = choose_layout(spec, schedule, cfg.pipeline, sample, device, dtype, dp=dp, shard=cfg.parallel.shard,
                           lowering=posting.options(not P2PComm(None, device).independent_ops)[0],
                           evaluates=cfg.train.eval_batches > 0, sample_target=sample_target,
                           autocast_dtype=compute_dtype(cfg.train.precision), compiled=options,
                           tp=tp, sequence_parallel=cfg.parallel.sequence_parallel, ep=ep, cp=cp)
    ramp = batch_ramp(cfg, dp, m)
    if ramp is not None:  # the profile above took a full micro-batch; each step now draws its own size
        batches = dataclasses.replace(batches, train=RampedBatches(batches.train, ramp))
    return RunPlan(config_hash, dp, pp, tp, ep, dtype, spec, schedule, batches, first, posting, options, layout, ramp)


def batch_ramp(cfg: DictConfig, dp: int, m: int) -> BatchRamp | None:
    """``train.batch_ramp`` for this layout (None: not set).

    Raises:
        ConfigError: sizes that are no whole number of micro-batches, or what a ramp cannot run
            with yet (``schedule=auto``, ``pipeline.offload``, ``data.variable_lengths``), by name.
    """
    ramp = cfg.train.batch_ramp
    if ramp is None or ramp.start is None:
        return None
    for refused, why in ((cfg.pipeline.offload != "none", "pipeline.offload (its plan is for one micro-batch count)"),
                         (bool(getattr(cfg.data, "variable_lengths", False)), "data.variable_lengths"),
                         (OmegaConf.select(cfg, "train.spike.action") == "rollback",
                          "train.spike.action=rollback (its skipped batches would move the ramp)")):
        if refused:
            raise ConfigError(f"train.batch_ramp does not run with {why} yet: change that, or drop the ramp")
    return BatchRamp(int(ramp.start), int(ramp.increment), int(ramp.samples), int(cfg.data.batch_size), dp, m)


def connect(cfg: DictConfig, plan: RunPlan, device: torch.device) -> Topology:
    """The mesh, after the profile (``parallel.order=auto`` weighs the profiled bytes on the links
    measured here), and the pipeline's transport, warmed up under the first-step deadline."""
    # every group the run uses times out a margin after pipeflow's own deadline (runtime/world/timeouts.py)
    deadlines = Deadlines(cfg.comm.first_step_timeout_s, cfg.comm.timeout_s, collectives=True)
    order, why, choice = mesh_order(cfg, plan.dp, plan.pp, plan.tp, plan.schedule, plan.layout, device, plan.dtype)
    mesh = build_mesh(plan.dp, plan.pp, device, plan.tp, order, cp=int(cfg.parallel.cp))
    mesh.order_reason, mesh.order_choice = why, choice
    deadlines.own(mesh.pp_group)
    deadlines.own(mesh.dp_group)
    if mesh.cp > 1:
        deadlines.own(mesh.cp_group)
        deadlines.own(mesh.replica_group)
    comm = P2PComm(mesh.pp_group, device, deadlines=deadlines, watchdog=watchdog(device, dist.get_rank()))
    comm.warmup()  # ranks may still be starting: the first-step deadline
    return Topology(mesh, comm, deadlines)


def settle_schedule(cfg: DictConfig, plan: RunPlan, topology: Topology, device: torch.device
                    ) -> tuple[RunPlan, Synthesis | None, HostLink | None]:
    """``schedule=auto`` synthesised for the layout's profiled costs and the measured transfer
    (the same on every rank), the host link ``pipeline.offload`` plans for (measured, collective),
    and every rank's program checked alike."""
    offload = cfg.pipeline.offload
    link = host_link(device) if offload != "none" else None  # collective
    synthesis = None
    schedule, layout = plan.schedule, plan.layout
    reschedule = None
    if schedule.name == AUTO:
        transfer_s = measure_transfer_s(topology.comm, boundary_bytes(layout))
        schedule, layout, synthesis = auto_for_layout(schedule, layout, cfg.schedule.max_inflight_microbatches,
                                                      cfg.schedule.placement, transfer_s,
                                                      None if link is None else (offload, link))
        if plan.ramp is not None:  # each count of the ramp synthesised alike on every rank, on the same stages
            chosen, relabel, limit = schedule, cfg.schedule.stage_to_rank, cfg.schedule.max_inflight_microbatches
            synthesized = lambda count: auto_for_count(chosen, layout, count, limit, transfer_s)  # noqa: E731
            reschedule = synthesized if relabel is None else (lambda count: relabel_ranks(synthesized(count), relabel))
        if cfg.schedule.stage_to_rank is not None:
            schedule = relabel_ranks(schedule, cfg.schedule.stage_to_rank)
    guard.check_same_program(schedule, layout.ranges)
    return dataclasses.replace(plan, schedule=schedule, layout=layout, reschedule=reschedule), synthesis, link


def _key_dropout(stages: dict, ranges: list[range], sequence_parallel: bool, rank: int) -> None:
    """Every dropout of this rank's layers keyed by sample and layer (``train.dropout_rng=sample``).

    Raises:
        ConfigError: dropout under sequence parallelism (a rank holds a slice of each sample's
            positions, so its masks would follow tp), or attention dropout inside a kernel.
    """
    where = f"rank {rank}"
    keyed = sum(key_dropout(layer, index, where) for index, layer in layers_by_index(stages, ranges).items())
    if keyed and sequence_parallel:
        raise ConfigError(f"{where}: train.dropout_rng=sample keys dropout by each sample's positions, and "
                          "parallel.sequence_parallel gives a rank a slice of them: set parallel.sequence_parallel=false, "
                          "or train.dropout_rng=rank (each rank's own generator: masks then follow the layout)")


def build_parts(cfg: DictConfig, plan: RunPlan, topology: Topology, device: torch.device) -> ModelParts:
    """This rank's stages built (a layer only one rank can fail on fails every rank), split over
    tp, their experts over ep, sharded over dp (FSDP2), tied weights joined, the dp reducer, the
    layers compiled and warmed up; and the parameters that train (a LoRA base trains none)."""
    spec, schedule, layout, mesh, comm = plan.spec, plan.schedule, plan.layout, topology.mesh, topology.comm
    m = schedule.num_microbatches
    ep, dp = plan.ep, plan.dp
    check_fused_targets(spec.lora, ep, mesh.tp, cfg.parallel.shard)
    # a Hugging Face MoE folder: each ep rank holds and reads only its own experts
    reading = reading_experts_of(expert_rank(mesh.grid.dp_groups(), ep), ep) if ep > 1 else contextlib.nullcontext()
    with reading:
        stages = built_on_every_rank(functools.partial(
            build_stages, spec, layout.ranges, schedule.stages_of(mesh.pp_rank), device, plan.dtype,
            compute_dtype(cfg.train.precision), checkpoint_every(cfg.pipeline.checkpoint_activations)))
    if cfg.train.dropout_rng == "sample":  # before tp splits and compiles the layers
        _key_dropout(stages, layout.ranges, mesh.tp > 1 and bool(cfg.parallel.sequence_parallel), dist.get_rank())
    if mesh.tp > 1:  # each layer split over the stage's tp ranks, before FSDP2 shards over dp
        parallelize_stages(spec, stages, layout.ranges, mesh.tp_mesh, bool(cfg.parallel.sequence_parallel),
                           cfg.parallel.shard)
    # its own groups, even at ep = dp: the dp group's gradient all-reduce may run beside an exchange
    ep_group, same_experts = expert_groups(mesh.grid.dp_groups(), ep) if ep > 1 else (None, None)
    recorder = EventRecorder(clock_for(device))  # CUDA events on a GPU, perf_counter on the CPU
    if ep > 1:  # each stage's experts split over ep of its dp ranks, tokens exchanged by all_to_all (timed)
        experts = expert_layers(spec)  # every layer on the meta device, once
        if not any(experts.params):
            raise ConfigError(f"parallel.ep={ep}: the model has no experts to split (no MoE layer, and no experts "
                              f"module its Hugging Face config's base_model_ep_plan names); use parallel.ep=1")
        if experts.unsplit:
            raise ConfigError(f"parallel.ep={ep}: experts parameters {list(experts.unsplit[:3])} are in no module "
                              f"expert parallelism splits (pipeflow's MoE, or one the Hugging Face config's "
                              f"base_model_ep_plan names ep_dispatch_experts); use parallel.ep=1")
        split_experts([layer for stage in stages.values() for layer in stage.module], ep_group, ep, recorder)
    sharding = full_shard(cfg, spec, stages, layout.ranges, mesh)  # before anything holds the parameters
    tied = TiedWeights(spec, layout.ranges, schedule.stage_to_rank, layers_by_index(stages, layout.ranges),
                       [comm.global_rank(r) for r in range(comm.size)], comm.rank, mesh.replicas)
    for group in tied.groups():
        topology.deadlines.own(group)
    tied.sync_initial_values()
    cp_comm = None
    if mesh.cp > 1:  # each layer's attention round the cp ring, on the transport's batched P2P
        cp_comm = attach_context_parallel(stages, mesh, device, topology.deadlines)
    replicas = mesh.replicas_of_parameters  # dp x cp ranks hold each parameter
    reducer = (GradReducer(stages, mesh.replica_group, replicas, unreduced=expert_parameters(stages) if ep > 1 else (),
                           unreduced_group=same_experts) if replicas > 1 and sharding is None else None)
    compiled = None
    if plan.compile_options is not None:  # before anything times the stages: they run compiled
        units = {s: [(spec.layers[i].name, spec.unit_to_compile(i, layer))
                     for i, layer in zip(layout.ranges[s], stage.module)] for s, stage in stages.items()}
        compiled = compile_and_warm_up(plan.compile_options, comm, schedule, stages, units, plan.first, m, plan.dtype,
                                       shape_mode(cfg, dp * m), plan.posting.options(not comm.independent_ops)[0],
                                       sharding, evaluates=cfg.train.eval_batches > 0)
    # what is trained: a LoRA run's frozen base weights get no gradient, no AdamW state, no reduction
    params = [p for p in unique_parameters(stage.parameters() for stage in stages.values()) if p.requires_grad]
    return ModelParts(stages, recorder, ep_group, sharding, tied, reducer, compiled, params, cp_comm)


def measure_layout(cfg: DictConfig, plan: RunPlan, topology: Topology, parts: ModelParts, link: HostLink | None,
                   device: torch.device) -> Layout:
    """The layout with the runtime's own costs measured here (collective: transfers, links, groups,
    the tail; rehearsed on shared cores) for its prediction, and ``pipeline.offload``'s plan."""
    layout, schedule, spec, comm, mesh = plan.layout, plan.schedule, plan.spec, topology.comm, topology.mesh
    m, dp, pp, ep = schedule.num_microbatches, plan.dp, plan.pp, plan.ep
    if layout.profiles is not None:  # the whole step: the runtime's own costs, measured here (collective)
        boundary = stage_boundary_bytes(layout.ranges, layout.profiles)
        rehearsal = rehearsal_steps_for(cfg, device)
        options = plan.posting.options(not comm.independent_ops)
        costs = measure_step_costs(comm, options[0], parts.params, boundary, pp, mesh.dp_group, dp,
                                   busy=rehearsal == 0, fused=cfg.optim.fused, schedule=schedule, grid=mesh.grid,
                                   tp_group=mesh.tp_group, tp_payload=largest_collective_bytes(layout.profiles),
                                   sequence_parallel=bool(cfg.parallel.sequence_parallel), ep_group=parts.ep_group,
                                   experts=expert_exchange(expert_layers(spec), ep, layout.profiles) if ep > 1 else None,
                                   cp_comm=parts.cp_comm, ring_payload=largest_pass_bytes(layout.profiles))
        costs = dataclasses.replace(costs, overlap_pairs=bool(cfg.pipeline.overlap_pairs))
        if parts.sharding is not None:  # FSDP2's gathers and reduce-scatters at the program's shard points
            costs = with_fsdp_shards(costs, dp, len(parts.stages))
        if rehearsal != 0:  # shared cores: the program rehearsed on the first batch, not modelled
            stages, first = parts.stages, plan.first
            inputs = microbatch_inputs(first[0], m, device, plan.dtype) if 0 in stages else None
            targets = microbatch_targets(first[1], m, device) if schedule.num_stages - 1 in stages else None
            costs = with_rehearsal(costs, comm, schedule, layout.ranges, layout.profiles, stages, inputs, targets,
                                   boundary, options, rehearsal, shape_mode(cfg, dp * m), parts.sharding)
        layout = with_step_costs(layout, schedule, costs)
    if link is not None:  # planned on the prediction's own simulation, for the host link measured at start
        layout = with_offload(layout, schedule, cfg.pipeline.offload, link,
                              device_memory_limit(device))
    return layout


def build_loop(cfg: DictConfig, plan: RunPlan, topology: Topology, parts: ModelParts, layout: Layout,
               synthesis: Synthesis | None, device: torch.device) -> Trainer:
    """The pipeline over the stages, the optimizer, fault injection and the finite check, the run
    directory (after everything a config can fail on: a sweep's invalid job leaves none behind),
    the metrics, and the Trainer that runs the loop over them."""
    rank, schedule, mesh, comm, stages = dist.get_rank(), plan.schedule, topology.mesh, topology.comm, parts.stages
    dp, pp, spec = plan.dp, plan.pp, plan.spec
    m = schedule.num_microbatches
    pipeline = Pipeline(stages, schedule, comm, shape_mode(cfg, dp * m), plan.posting, parts.recorder,
                        parts.reducer.stage_ready if parts.reducer is not None else None, parts.sharding,
                        layout.offload, overlap_pairs=cfg.pipeline.overlap_pairs)
    optimizer = build_optimizer(parts.params, cfg.parallel.shard, mesh.replica_group, mesh.replicas_of_parameters,
                                announce=rank == 0,
                                lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                weight_decay=cfg.optim.weight_decay,
                                fused=fused_adamw(cfg.optim.fused, device) or None)  # None: torch's default
    faults = install_from_env(stages, rank, dist.get_world_size())  # PIPEFLOW_FAULT_INJECT (tests, drills)
    # after the injector: its forward hook must see what the injected fault did
    finite = FiniteCheck(stages, schedule.num_stages, device) if cfg.train.check_finite else None
    workspace = prepare_workspace(cfg)  # the run directory, locked for this job, its config.yaml
    run_dir = workspace.run_dir
    if synthesis is not None and rank == 0:
        write_auto_schedule(schedule, synthesis, run_dir)
    data = typed_data(cfg.data)
    lengths = sequence_lengths(data)  # variable lengths: tokens/s counts the lengths' expected mean
    per_sample = None if data.name not in TOKEN_DATA else data.seq_len if lengths is None else sum(lengths) / 2
    metrics = RunMetrics(cfg, parts.recorder, comm.rank, pp, device, run_dir, layout.prediction,
                         (cfg.data.batch_size, None if per_sample is None else cfg.data.batch_size * per_sample),
                         calibrator(schedule, stage_boundary_bytes(layout.ranges, layout.profiles),
                                    run_meta(cfg, schedule, layout, device, dp, mesh.grid),
                                    overlap=bool(cfg.pipeline.overlap_pairs),
                                    shard=parts.sharding is not None),
                         first_pipeline=mesh.first_pipeline, grid=mesh.grid,
                         watch=straggler_watch(cfg, schedule, layout, mesh.grid))
    scaler = LossScaler(cfg.train.precision == "fp16")
    memory = MemoryAccountant(stages, optimizer, device)
    routing = routing_sync(layers_by_index(stages, layout.ranges), len(spec.layers),
                           int(OmegaConf.select(cfg, "model.moe.experts", default=0) or 0) or spec.routed_experts, plan.ep)
    update = StepUpdate(device, schedule, stages, parts.params, optimizer, cfg.optim.grad_clip, parts.tied,
                        parts.reducer, scaler, finite, routing, workspace, mesh.dp * mesh.cp * mesh.tp)
    loop = Loop(pipeline, update, faults, metrics, workspace, memory)
    return Trainer(cfg, device, dataclasses.replace(plan, layout=layout), topology, parts, loop)


# comm.post_recvs in the interpreter's terms (Posting's recvs_ahead)
RECVS_AHEAD: dict[RecvPosting, bool | str] = {RecvPosting.ahead: True, RecvPosting.at_step: False,
                                              RecvPosting.auto: "auto"}
