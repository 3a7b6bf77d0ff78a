"""The pieces the builder's phases assemble (:mod:`pipeflow.run.builder`), each from the config
and what the phases before it returned: the mesh order, the cp ring's transport, the host link
offloading plans for, FSDP2's shard, the straggler watch, the run's meta for ``costs.json``, the
rehearsal's length, how shapes are learned, ``schedule=auto``'s file, CUDA's deadline watchdog."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import platform
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pipeflow.config.data import typed_data
from pipeflow.config.schema import tensor_degree
from pipeflow.data import varies
from pipeflow.errors import ConfigError
from pipeflow.models.spec import ModelSpec
from pipeflow.observability.stragglers import StragglerWatch
from pipeflow.planning.layout import Layout
from pipeflow.planning.links import host_name
from pipeflow.planning.measured_cluster import rank_hosts, start_links
from pipeflow.planning.mesh_choice import choose_order
from pipeflow.planning.profile import action_costs
from pipeflow.run import guard
from pipeflow.runtime.host_link import HostLinkMeasure, measured_once
from pipeflow.runtime.parallel import ring_attention
from pipeflow.runtime.parallel.fsdp import FullShard
from pipeflow.runtime.parallel.mesh import Mesh
from pipeflow.runtime.parallel.mesh_order import DEFAULT_ORDER, parse_order
from pipeflow.runtime.stage import layers_by_index
from pipeflow.runtime.tied import tie_in_place
from pipeflow.runtime.transport import Deadlines, DeadlineWatchdog, P2PComm
from pipeflow.schedules import PipelineSchedule, Synthesis
from pipeflow.schedules.auto import write_schedule
from pipeflow.schedules.offload import HostLink

log = logging.getLogger("pipeflow")


def straggler_watch(cfg: DictConfig, schedule: PipelineSchedule, layout: Layout, grid: Any) -> StragglerWatch | None:
    """``metrics.straggler_factor``'s watch: each pipeline rank's predicted compute (its program's
    profiled actions) and each link's predicted transfer (the links measured at start on several
    hosts, else the start's transfer model); None where the factor is null."""
    factor = cfg.metrics.straggler_factor
    if factor is None:
        return None
    model = layout.step_costs
    compute = None
    if layout.profiles is not None:
        cost = action_costs(layout.ranges, layout.profiles, schedule, model.action_overhead_s if model else 0.0)
        compute = [math.fsum(cost(a) for a in actions) for actions in schedule.actions]
    links = model.links if model is not None else None
    link_s = None
    if links is not None:
        by_pair = {link.ranks: link for link in links.links}
        link_s = lambda a, b, n: by_pair[(a, b)].seconds(n) if (a, b) in by_pair else math.inf  # noqa: E731
    elif model is not None and (model.latency_s > 0 or model.per_byte_s > 0):
        latency = model.busy_latency_s if model.busy_latency_s is not None else model.latency_s
        per_byte = model.busy_per_byte_s if model.busy_per_byte_s is not None else model.per_byte_s
        link_s = lambda a, b, n: latency + per_byte * n  # noqa: E731
    pipelines = grid.pipelines()

    def link_name(a: int, b: int, replica: int) -> str:
        ga, gb = pipelines[replica][a], pipelines[replica][b]
        ha, hb = host_name(ga), host_name(gb)
        where = f" crosses hosts {ha} -> {hb}" if ha != hb else (f" within host {ha}" if ha else "")
        return f"pipeline ranks {a}-{b} (global ranks {ga} and {gb}){where}"

    return StragglerWatch(float(factor), compute, link_s, link_name, host_name)


def mesh_order(cfg: DictConfig, dp: int, pp: int, tp: int, schedule: PipelineSchedule, layout: Layout,
               device: torch.device, dtype: torch.dtype) -> tuple[tuple[str, ...], str, Any]:
    """``parallel.order``: the order given, or for ``auto`` the one predicted fastest on the
    links measured here (collective; :mod:`pipeflow.planning.mesh_choice`), with the reason and
    what was weighed (None where nothing was)."""
    given = parse_order(cfg.parallel.order)
    if given is not None:
        return given, "", None
    if int(cfg.parallel.cp) > 1:  # the order search does not weigh the cp ring yet
        return DEFAULT_ORDER, " (parallel.order=auto with parallel.cp: the default order, cp just outside tp)", None
    return choose_order(dp, pp, tp, schedule, layout.ranges, layout.profiles, device,
                        torch.empty((), dtype=dtype).element_size())


def attach_context_parallel(stages: dict, mesh: Mesh, device: torch.device, deadlines: Deadlines) -> P2PComm:
    """Give every layer that takes it (``context_parallel``, :mod:`pipeflow.runtime.parallel.ring_attention`)
    the cp ring of this rank, warmed up (collective over the cp group); returns the ring's transport.

    Raises:
        ConfigError: no layer of this rank's stages takes context parallelism.
    """
    comm = P2PComm(mesh.cp_group, device, deadlines=deadlines)
    comm.warmup()  # NCCL's first batched call on a group involves every rank: the ring does
    layers = [layer for stage in stages.values() for layer in stage.module]
    if not ring_attention.attach(layers, ring_attention.ContextParallel(ring_attention.RingComm(comm))):
        raise ConfigError(f"parallel.cp={mesh.cp}: no layer of stage(s) {sorted(stages)} takes context parallelism "
                          f"(a module with a context_parallel attribute, as model=gpt's attention has); use "
                          f"parallel.cp=1, or give your attention the hook (docs/guides/long-context.md)")
    return comm


def host_link(device: torch.device) -> HostLink:
    """The host link ``pipeline.offload`` plans for: this rank's copies measured
    (:func:`~pipeflow.runtime.host_link.measured_once`), the slowest rank's bandwidths taken by every
    rank (collective), so every rank plans and predicts with the same link."""
    measured = measured_once(str(device))
    both = torch.tensor([measured.d2h_bytes_per_s, measured.h2d_bytes_per_s], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    slowest = HostLinkMeasure(*both.tolist(), overlapped=measured.overlapped)
    return slowest.link(COPY_LATENCY_S if measured.overlapped else 0.0)


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
        "seq_len": OmegaConf.select(cfg, "data.seq_len"), "tp": tensor_degree(cfg.parallel),
        "precision": cfg.train.precision, "hosts": names,
        "links": start_links(layout.step_costs, grid.pipelines() if grid is not None else [], names),
        "model": OmegaConf.to_container(cfg.model, resolve=True), "dtype": cfg.train.param_dtype,
        "schedule": schedule.name, "num_ranks": schedule.num_ranks, "num_microbatches": schedule.num_microbatches,
        "stages_per_rank": schedule.num_stages // schedule.num_ranks, "dp": dp, "batch_size": cfg.data.batch_size,
        "microbatch_size": cfg.data.batch_size // (dp * schedule.num_microbatches),
        "ranges": [[r.start, r.stop] for r in layout.ranges],
        "profiles": None if layout.profiles is None else [dataclasses.asdict(p) for p in layout.profiles],
    }


def full_shard(cfg: DictConfig, spec: ModelSpec, stages: dict, ranges: list[range], mesh: Mesh) -> FullShard | None:
    """``parallel.shard=full`` with dp x cp > 1: this rank's stages sharded over the ranks holding
    the same parameters (FSDP2; with ``parallel.cp`` over dp x cp, as torchtitan's dp_shard_cp),
    tied copies on this rank made one parameter first; None otherwise (one replica: nothing to shard)."""
    if cfg.parallel.shard != "full":
        return None
    if mesh.replicas_of_parameters == 1:
        if dist.get_rank() == 0:
            log.info("parallel.shard=full with parallel.dp=1: one replica, nothing to shard; parameters stay whole")
        return None
    tie_in_place(spec, layers_by_index(stages, ranges))  # one parameter, in one FSDP2 unit
    return FullShard(stages, mesh.replica_mesh)


REHEARSE_FROM_STEPS = 25  # metrics.rehearse_steps=null: runs this long rehearse (a second or two is little)


def rehearsal_steps_for(cfg: DictConfig, device: torch.device) -> int | None:
    """``metrics.rehearse_steps`` as the builder uses it: 0 (no rehearsal: on a GPU, a run
    shorter than :data:`REHEARSE_FROM_STEPS` steps left at null, or 0 set), None (as many as
    about 1.5 s allows) or the steps set.  With ``parallel.shard=full`` the rehearsal gathers and
    reduces at the program's shard points, as the run does."""
    steps = cfg.metrics.rehearse_steps
    if device.type != "cpu":
        return 0
    if steps is None:
        return None if cfg.train.max_steps >= REHEARSE_FROM_STEPS else 0
    return int(steps)


def shape_mode(cfg: DictConfig, chunks: int) -> str:
    """How the pipeline learns shapes (:mod:`pipeflow.runtime.shapes`): every micro-batch its own
    when they can differ (variable lengths, a batch that does not split into `chunks` equal
    micro-batches), else ``comm.shapes``."""
    return "per_microbatch" if varies(typed_data(cfg.data), chunks) else str(cfg.comm.shapes)


def boundary_bytes(layout: Layout) -> int:
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


def watchdog(device: torch.device, rank: int) -> DeadlineWatchdog | None:
    """On CUDA, where a P2P wait only orders streams, a thread that keeps the waits' deadlines.

    It runs on this rank's GPU and holds nothing of the run but the rank (the Trainer stops it
    at the end of ``fit``, so a sweep frees every job's model, optimizer and communicators)."""
    if torch.device(device).type != "cuda":
        return None
    return DeadlineWatchdog(functools.partial(guard.fail, rank=rank), device=device)
