"""The one place a run is built: every object constructed from the config with its settings.

:func:`build_run` turns the resolved config into this rank's part of the pipeline (mesh,
schedule, layout, stages, transport with its deadlines, the pipeline with its posting policy,
recorder and gradient hook, tied weights, data-parallel reducer, precision, optimizer, metrics)
and hands them to the :class:`~pipeflow.run.trainer.Trainer`, which only runs the loop.
Nothing is configured by assigning attributes from outside after construction.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import platform
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from pipeflow.data import (TOKEN_DATA, build_batches, microbatch_inputs, microbatch_targets, sequence_lengths, shard,
                           split_microbatches, varies)
from pipeflow.errors import ConfigError, PipeflowError
from pipeflow.models.spec import ModelSpec
from pipeflow.observability.metrics import RunMetrics
from pipeflow.planning.auto import auto_for_layout
from pipeflow.planning.calibration import calibrator, stage_boundary_bytes
from pipeflow.planning.comm_cost import measure_transfer_s
from pipeflow.planning.layout import Layout, choose_layout, with_offload, with_step_costs
from pipeflow.planning.ep_links import expert_exchange
from pipeflow.planning.expert_cost import expert_layers
from pipeflow.planning.measured_cluster import rank_hosts, start_links
from pipeflow.planning.rehearsal import with_rehearsal
from pipeflow.planning.step_model import fused_adamw, measure_step_costs
from pipeflow.planning.tensor_cost import largest_collective_bytes
from pipeflow.run import guard
from pipeflow.run.compile_phase import compile_and_warm_up, compile_options
from pipeflow.run.config import check_config, tensor_degree
from pipeflow.run.faults import install_from_env
from pipeflow.run.trainer import Trainer, unique_parameters
from pipeflow.run.workspace import prepare as prepare_workspace
from pipeflow.runtime.events import EventRecorder, clock_for
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.runtime.fsdp import FullShard
from pipeflow.runtime.memory import MemoryAccountant
from pipeflow.runtime.mesh import GradReducer, Mesh, build_mesh
from pipeflow.runtime.mesh_order import parse_order
from pipeflow.planning.mesh_choice import choose_order
from pipeflow.runtime.host_link import HostLinkMeasure, measure_link
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import AheadTuner, Posting
from pipeflow.runtime.precision import LossScaler, checkpoint_every, compute_dtype
from pipeflow.runtime.expert_parallel import expert_groups, expert_parameters, split_experts
from pipeflow.runtime.routing import routing_sync
from pipeflow.runtime.stage import build_stages, layers_by_index
from pipeflow.runtime.tensor_parallel import parallelize_stages
from pipeflow.runtime.tied import TiedWeights, tie_in_place
from pipeflow.runtime.transport import DeadlineWatchdog, Deadlines, P2PComm
from pipeflow.runtime.zero import build_optimizer
from pipeflow.schedules import PipelineSchedule, Synthesis, build_schedule, relabel_ranks
from pipeflow.schedules.auto import AUTO, write_schedule
from pipeflow.schedules.offload import HostLink

log = logging.getLogger("pipeflow")
T = TypeVar("T")


def build_run(cfg: DictConfig, device: torch.device) -> Trainer:
    """Build this rank's part of the run the config describes (collective: every rank calls it).

    Args:
        cfg: the resolved Hydra config (see ``configs/`` and :mod:`pipeflow.run.config`).
        device: this rank's device.

    Returns:
        The training loop over everything built here.

    Raises:
        ConfigMismatchError: the ranks resolved different configs.
        ConfigError, ScheduleError, PartitionError: a config the run cannot use.
    """
    rank = dist.get_rank()
    config_hash = guard.check_same_config(cfg)  # before anything a rank could disagree on
    dp, pp = check_config(cfg, dist.get_world_size())
    # every group the run uses times out a margin after pipeflow's own deadline (runtime/timeouts.py)
    deadlines = Deadlines(cfg.comm.first_step_timeout_s, cfg.comm.timeout_s, collectives=True)
    dtype = getattr(torch, cfg.train.dtype)
    spec = build_spec(cfg.model)
    tp = tensor_degree(cfg.parallel)
    m = cfg.pipeline.num_microbatches
    schedule = build_schedule(cfg.schedule.name, pp, m, cfg.pipeline.stages_per_rank, cfg.pipeline.placement,
                              cfg.schedule.path, cfg.pipeline.stage_to_rank)
    batches = build_batches(cfg.data, cfg.model, chunks=dp * m)
    first = shard(batches.train.get(0), 0, dp)
    sample, sample_target = split_microbatches(first[0], m)[0], split_microbatches(first[1], m)[0]
    # auto's choice is made by the whole world (every replica alike, so no replica waits on a
    # slower setting) and within about a quarter of the run, so short runs and sweeps measure
    # the chosen setting for most of their steps
    posting = Posting(cfg.comm.recvs_ahead, tuner=AheadTuner(trials=max(1, min(10, (cfg.train.max_steps - 2) // 8))),
                      agree_over_world=True)
    options = compile_options(cfg, dp * m)  # train.compile (None: eager): the profile and the stages alike
    ep = int(OmegaConf.select(cfg, "parallel.ep", default=1) or 1)  # experts split over each stage's dp ranks
    layout = choose_layout(spec, schedule, cfg.pipeline, sample, device, dtype, dp=dp,
                           shard=OmegaConf.select(cfg, "parallel.shard", default="none"),
                           lowering=posting.options(not P2PComm(None, device).independent_ops)[0],
                           evaluates=cfg.train.eval_batches > 0, sample_target=sample_target,
                           autocast_dtype=compute_dtype(cfg.train.precision), compiled=options,
                           tp=tp, sequence_parallel=bool(cfg.parallel.sequence_parallel), ep=ep)
    # the mesh after the profile: parallel.order=auto weighs the profiled bytes on the measured links
    order, why = mesh_order(cfg, dp, pp, tp, schedule, layout, device, dtype)
    mesh = build_mesh(dp, pp, device, tp, order)
    mesh.order_reason = why
    deadlines.own(mesh.pp_group)
    deadlines.own(mesh.dp_group)
    comm = P2PComm(mesh.pp_group, device, deadlines=deadlines, watchdog=_watchdog(device, rank))
    comm.warmup()  # ranks may still be starting: the first-step deadline
    offload = OmegaConf.select(cfg, "pipeline.offload", default="none")
    link = host_link(device) if offload != "none" else None  # collective
    synthesis = None
    if schedule.name == AUTO:  # synthesised for the layout's profiled costs (the same on every rank)
        transfer_s = measure_transfer_s(comm, _boundary_bytes(layout))
        schedule, layout, synthesis = auto_for_layout(schedule, layout, cfg.pipeline.max_activations,
                                                      cfg.pipeline.placement, transfer_s,
                                                      None if link is None else (offload, link))
        if cfg.pipeline.stage_to_rank is not None:
            schedule = relabel_ranks(schedule, cfg.pipeline.stage_to_rank)
    guard.check_same_program(schedule, layout.ranges)
    stages = built_on_every_rank(functools.partial(
        build_stages, spec, layout.ranges, schedule.stages_of(mesh.pp_rank), device, dtype,
        compute_dtype(cfg.train.precision), checkpoint_every(cfg.pipeline.checkpoint_activations)))
    if mesh.tp > 1:  # each layer split over the stage's tp ranks, before FSDP2 shards over dp
        parallelize_stages(spec, stages, layout.ranges, mesh.tp_mesh, bool(cfg.parallel.sequence_parallel),
                           OmegaConf.select(cfg, "parallel.shard", default="none"))
    # its own groups, even at ep = dp: the dp group's gradient all-reduce may run beside an exchange
    ep_group, same_experts = expert_groups(mesh.grid.dp_groups(), ep) if ep > 1 else (None, None)
    recorder = EventRecorder(clock_for(device))  # CUDA events on a GPU, perf_counter on the CPU
    if ep > 1:  # each stage's experts split over ep of its dp ranks, tokens exchanged by all_to_all (timed)
        split_experts([layer for stage in stages.values() for layer in stage.module], ep_group, ep, recorder)
    sharding = full_shard(cfg, spec, stages, layout.ranges, mesh)  # before anything holds the parameters
    tied = TiedWeights(spec, layout.ranges, schedule.stage_to_rank, layers_by_index(stages, layout.ranges),
                       [comm.global_rank(r) for r in range(comm.size)], comm.rank, mesh.replicas)
    for group in tied.groups():
        deadlines.own(group)
    tied.sync_initial_values()
    reducer = (GradReducer(stages, mesh.dp_group, dp, unreduced=expert_parameters(stages) if ep > 1 else (),
                           unreduced_group=same_experts) if dp > 1 and sharding is None else None)
    compiled = None
    if options is not None:  # before anything times the stages: they run compiled
        units = {s: [(spec.layers[i].name, spec.unit_to_compile(i, layer))
                     for i, layer in zip(layout.ranges[s], stage.module)] for s, stage in stages.items()}
        compiled = compile_and_warm_up(options, comm, schedule, stages, units, first, m, dtype, shape_mode(cfg, dp * m),
                                       posting.options(not comm.independent_ops)[0], sharding,
                                       evaluates=cfg.train.eval_batches > 0)
    # what is trained: a LoRA run's frozen base weights get no gradient, no AdamW state, no reduction
    params = [p for p in unique_parameters(stage.parameters() for stage in stages.values()) if p.requires_grad]
    if layout.profiles is not None:  # the whole step: the runtime's own costs, measured here (collective)
        boundary = stage_boundary_bytes(layout.ranges, layout.profiles)
        rehearsal = rehearsal_steps_for(cfg, device)
        options = posting.options(not comm.independent_ops)
        costs = measure_step_costs(comm, options[0], params, boundary, pp, mesh.dp_group, dp, busy=rehearsal == 0,
                                   fused=cfg.optim.fused, schedule=schedule, grid=mesh.grid, tp_group=mesh.tp_group,
                                   tp_payload=largest_collective_bytes(layout.profiles),
                                   sequence_parallel=bool(cfg.parallel.sequence_parallel), ep_group=ep_group,
                                   experts=expert_exchange(expert_layers(spec), ep, layout.profiles) if ep > 1 else None)
        if rehearsal != 0:  # shared cores: the program rehearsed on the first batch, not modelled
            inputs = microbatch_inputs(first[0], m, device, dtype) if 0 in stages else None
            targets = microbatch_targets(first[1], m, device) if schedule.num_stages - 1 in stages else None
            costs = with_rehearsal(costs, comm, schedule, layout.ranges, layout.profiles, stages, inputs, targets,
                                   boundary, options, rehearsal, shape_mode(cfg, dp * m))
        layout = with_step_costs(layout, schedule, costs)
    if link is not None:  # planned on the prediction's own simulation, for the host link measured at start
        layout = with_offload(layout, schedule, offload, link, device_memory_limit(device))
    pipeline = Pipeline(stages, schedule, comm, shape_mode(cfg, dp * m), posting, recorder,
                        reducer.stage_ready if reducer is not None else None, sharding, layout.offload)
    optimizer = build_optimizer(params, cfg.parallel.shard, mesh.dp_group, dp, announce=rank == 0, lr=cfg.optim.lr,
                                betas=(cfg.optim.beta1, cfg.optim.beta2), weight_decay=cfg.optim.weight_decay,
                                fused=fused_adamw(cfg.optim.fused, device) or None)  # None: torch's default
    faults = install_from_env(stages, rank, dist.get_world_size())  # PIPEFLOW_FAULT_INJECT (tests, drills)
    # after the injector: its forward hook must see what the injected fault did
    finite = FiniteCheck(stages, schedule.num_stages, device) if cfg.train.check_finite else None
    # after everything a config can fail on (a sweep's invalid job leaves no directory behind)
    workspace = prepare_workspace(cfg)  # the run directory, locked for this job, its config.yaml
    run_dir = workspace.run_dir
    if synthesis is not None and rank == 0:
        write_auto_schedule(schedule, synthesis, run_dir)
    lengths = sequence_lengths(cfg.data)  # variable lengths: tokens/s counts the lengths' expected mean
    per_sample = None if cfg.data.name not in TOKEN_DATA else cfg.data.seq_len if lengths is None else sum(lengths) / 2
    metrics = RunMetrics(cfg, recorder, comm.rank, pp, device, run_dir, layout.prediction,
                         (cfg.data.batch_size, None if per_sample is None else cfg.data.batch_size * per_sample),
                         calibrator(schedule, stage_boundary_bytes(layout.ranges, layout.profiles),
                                    run_meta(cfg, schedule, layout, device, dp, mesh.grid)), first_pipeline=mesh.first_pipeline,
                         grid=mesh.grid)
    return Trainer(
        cfg=cfg, device=device, config_hash=config_hash, mesh=mesh, spec=spec, schedule=schedule, layout=layout,
        batches=batches, stages=stages, pipeline=pipeline, posting=posting, deadlines=deadlines, tied=tied,
        reducer=reducer, scaler=LossScaler(cfg.train.precision == "fp16"),
        finite=finite, faults=faults, params=params, optimizer=optimizer, metrics=metrics, run_dir=run_dir,
        workspace=workspace, memory=MemoryAccountant(stages, optimizer, device), compiled=compiled,
        routing=routing_sync(layers_by_index(stages, layout.ranges), len(spec.layers),
                             int(OmegaConf.select(cfg, "model.moe.experts", default=0) or 0), ep),
    )


def mesh_order(cfg: DictConfig, dp: int, pp: int, tp: int, schedule: PipelineSchedule, layout: Layout,
               device: torch.device, dtype: torch.dtype) -> tuple[tuple[str, ...], str]:
    """``parallel.order``: the order given, or for ``auto`` the one predicted fastest on the
    links measured here (collective; :mod:`pipeflow.planning.mesh_choice`), with the reason."""
    given = parse_order(OmegaConf.select(cfg, "parallel.order", default="auto"))
    if given is not None:
        return given, ""
    return choose_order(dp, pp, tp, schedule, layout.ranges, layout.profiles, device,
                        torch.empty((), dtype=dtype).element_size())


def host_link(device: torch.device) -> HostLink:
    """The host link ``pipeline.offload`` plans for: this rank's copies measured
    (:func:`~pipeflow.runtime.host_link.measure_link`), the slowest rank's bandwidths taken by every
    rank (collective), so every rank plans and predicts with the same link."""
    measured = measure_link(device)
    both = torch.tensor([measured.d2h_bytes_per_s, measured.h2d_bytes_per_s], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    slowest = HostLinkMeasure(*both.tolist(), overlapped=measured.overlapped)
    return slowest.link(COPY_LATENCY_S if measured.overlapped else 0.0)


def device_memory_limit(device: torch.device) -> float | None:
    """The tensor bytes a rank's predicted peak should fit (``pipeline.offload=auto`` offloads
    more where it would not): on CUDA :data:`DEVICE_MEMORY_SHARE` of the device's memory (the
    rest for the allocator's caching, workspaces and the CUDA context), no limit elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    return DEVICE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory


DEVICE_MEMORY_SHARE = 0.85
COPY_LATENCY_S = 10e-6  # launching one group's copy on its stream (a few small launches and an event)


def run_meta(cfg: DictConfig, schedule: PipelineSchedule, layout: Layout, device: torch.device, dp: int,
             grid: Any = None) -> dict:
    """What a run's measured costs belong to (written into its ``costs.json``): the machine, the
    model, the schedule and sizes, the partition and its layer profiles, the links timed at start
    and each rank's host (for the planners; `grid`: the mesh's ``MeshGrid``)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    names = rank_hosts(dist.get_world_size())
    return {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "local_ranks": local, "device": device.type,
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "seq_len": OmegaConf.select(cfg, "data.seq_len", default=None), "tp": tensor_degree(cfg.parallel),
        "precision": cfg.train.precision, "hosts": names,
        "links": start_links(layout.step_costs, grid.pipelines() if grid is not None else [], names),
        "model": OmegaConf.to_container(cfg.model, resolve=True), "dtype": cfg.train.dtype,
        "schedule": schedule.name, "num_ranks": schedule.num_ranks, "num_microbatches": schedule.num_microbatches,
        "stages_per_rank": schedule.num_stages // schedule.num_ranks, "dp": dp, "batch_size": cfg.data.batch_size,
        "microbatch_size": cfg.data.batch_size // (dp * schedule.num_microbatches),
        "ranges": [[r.start, r.stop] for r in layout.ranges],
        "profiles": None if layout.profiles is None else [dataclasses.asdict(p) for p in layout.profiles],
    }


def full_shard(cfg: DictConfig, spec: ModelSpec, stages: dict, ranges: list[range], mesh: Mesh) -> FullShard | None:
    """``parallel.shard=full`` with dp > 1: this rank's stages sharded over their dp group (FSDP2),
    tied copies on this rank made one parameter first; None otherwise (at dp = 1 nothing to shard)."""
    if OmegaConf.select(cfg, "parallel.shard", default="none") != "full":
        return None
    if mesh.dp == 1:
        if dist.get_rank() == 0:
            log.info("parallel.shard=full with parallel.dp=1: one replica, nothing to shard; parameters stay whole")
        return None
    tie_in_place(spec, layers_by_index(stages, ranges))  # one parameter, in one FSDP2 unit
    return FullShard(stages, mesh.device_mesh["dp"])


REHEARSE_FROM_STEPS = 25  # metrics.rehearse_steps=null: runs this long rehearse (a second or two is little)


def rehearsal_steps_for(cfg: DictConfig, device: torch.device) -> int | None:
    """``metrics.rehearse_steps`` as the builder uses it: 0 (no rehearsal: on a GPU, with
    ``parallel.shard=full``, a run shorter than :data:`REHEARSE_FROM_STEPS` steps left at null,
    or 0 set), None (as many as about 1.5 s allows) or the steps set."""
    steps = OmegaConf.select(cfg, "metrics.rehearse_steps", default=None)
    if device.type != "cpu" or OmegaConf.select(cfg, "parallel.shard", default="none") == "full":
        return 0
    if steps is None:
        return None if cfg.train.max_steps >= REHEARSE_FROM_STEPS else 0
    return int(steps)


def shape_mode(cfg: DictConfig, chunks: int) -> str:
    """How the pipeline learns shapes (:mod:`pipeflow.runtime.shapes`): every micro-batch its own
    when they can differ (``comm.variable_shapes``, variable lengths, a batch that does not split
    into `chunks` equal micro-batches), else ``dynamic`` or ``static`` (``comm.dynamic_shapes``)."""
    if cfg.comm.variable_shapes or varies(cfg.data, chunks):
        return "per_microbatch"
    return "dynamic" if cfg.comm.dynamic_shapes else "static"


def _boundary_bytes(layout: Layout) -> int:
    """The largest activation crossing a stage boundary (profiled), or 4 KiB without profiles."""
    if layout.profiles is None:
        return 4096
    return max((layout.profiles[r.stop - 1].output_bytes for r in layout.ranges[:-1]), default=4096)


def write_auto_schedule(schedule: PipelineSchedule, synthesis: Synthesis, run_dir: str) -> str:
    """Write ``schedule=auto``'s result to ``<run_dir>/schedule_auto.txt`` (loadable with
    ``schedule=custom schedule.path=<that file>``), its predictions as comments; returns the path."""
    path = os.path.join(run_dir, "schedule_auto.txt")
    header = [f"schedule=auto: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
              f"{schedule.num_microbatches} micro-batches ({synthesis.chosen.label})",
              *synthesis.report().splitlines(),
              f"run it again with: schedule=custom schedule.path={path}"]
    write_schedule(schedule, path, header)
    return path


def _watchdog(device: torch.device, rank: int) -> DeadlineWatchdog | None:
    """On CUDA, where a P2P wait only orders streams, a thread that keeps the waits' deadlines.

    It runs on this rank's GPU and holds nothing of the run but the rank (the Trainer stops it
    at the end of ``fit``, so a sweep frees every job's model, optimizer and communicators)."""
    if torch.device(device).type != "cuda":
        return None
    return DeadlineWatchdog(functools.partial(guard.fail, rank=rank), device=device)


def built_on_every_rank(build: Callable[[], T]) -> T:
    """`build()` (this rank's stages), agreed over the world by one small all-gather: a pipeflow
    error that only the rank building a layer can see (NaN in the weights it loads, a key missing
    from ``model.init_from``) is raised by every rank, one named line each, rather than by that
    rank alone while its peers meet a closed connection later.

    Raises:
        PipeflowError: this rank's own, else the lowest failing rank's.
    """
    try:
        built, error = build(), None
    except PipeflowError as exc:
        built, error = None, exc
    errors = [error]
    if dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = error or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return built  # type: ignore[return-value]


def build_spec(model_cfg: DictConfig) -> ModelSpec:
    """The model the ``model`` config's builder (``_target_``) returns.

    A pipeflow error the builder raises (a ConfigError naming ``model.path``, a CheckpointError
    naming a damaged weights file) reaches the caller as itself, one line, not wrapped in Hydra's
    ``InstantiationException`` (which stays its ``__context__``).

    Raises:
        ConfigError: a key the builder takes no argument for, the builder's own, or the builder
            returned something else than a ModelSpec.
    """
    try:
        spec = instantiate(builder_config(model_cfg))
    except InstantiationException as exc:
        named = _named_cause(exc)
        if named is None:
            raise
        raise named  # noqa: B904 - the builder's own error, its cause kept; Hydra's wrapper its context
    if not isinstance(spec, ModelSpec):
        target = OmegaConf.select(model_cfg, "_target_")
        raise ConfigError(
            f"model._target_={target!r} returned a {type(spec).__name__}, not a pipeflow ModelSpec; a model "
            f"builder must return ModelSpec(layers=[LayerSpec(...), ...], loss_fn=...): see docs/models.md"
        )
    return spec


def _named_cause(exc: BaseException) -> PipeflowError | None:
    """The pipeflow error under Hydra's (possibly nested) instantiation wrappers, if any."""
    seen: set[int] = set()
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc if isinstance(exc, PipeflowError) else None


def builder_config(model_cfg: DictConfig) -> DictConfig:
    """The ``model`` config with only keys its builder (``_target_``) takes: a key left at null or
    at its schema's default that the builder has no argument for is dropped (a user's builder on a
    built-in schema, such as ``base_mlp``, which gained ``init_from``, or ``gpt``, which gained
    ``moe``); any other such key is one line naming it and the
    builder's arguments, not a TypeError inside Hydra's instantiation traceback. A builder that
    cannot be imported or takes ``**kwargs`` is left to Hydra.

    Raises:
        ConfigError: naming the key (``+model.foo=1``), the builder and the keys it takes.
    """
    target = OmegaConf.select(model_cfg, "_target_")
    try:
        params = inspect.signature(get_method(target)).parameters
    except Exception:  # noqa: BLE001 - no importable target: Hydra's own error says so
        return model_cfg
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return model_cfg
    unknown = [key for key in model_cfg if not str(key).startswith("_") and key not in params]
    defaults = _schema_defaults(model_cfg)
    given = [key for key in unknown if OmegaConf.select(model_cfg, str(key)) is not None
             and _plain(OmegaConf.select(model_cfg, str(key))) != defaults.get(str(key), _NO_DEFAULT)]
    if given:
        taken = ", ".join(name for name, p in params.items() if p.kind != p.VAR_POSITIONAL)
        raise ConfigError(f"model.{given[0]} is not an argument of {target}, which takes: {taken}; remove "
                          f"model.{given[0]} (a key added with +model.{given[0]}=... reaches the builder as is)")
    if not unknown:
        return model_cfg
    kept = OmegaConf.to_container(model_cfg, resolve=True)
    return OmegaConf.create({key: value for key, value in kept.items() if key not in unknown})


_NO_DEFAULT = object()


def _plain(value: Any) -> Any:
    """A config value as plain Python (containers resolved)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _schema_defaults(model_cfg: DictConfig) -> dict[str, Any]:
    """The defaults of the structured schema `model_cfg` was made from, as plain Python (none
    for a plain config)."""
    schema = OmegaConf.get_type(model_cfg)
    if not dataclasses.is_dataclass(schema):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        out[f.name] = _plain(OmegaConf.structured(value)) if dataclasses.is_dataclass(value) else value
    return out

