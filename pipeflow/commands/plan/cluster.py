"""``python -m pipeflow.plan plan.hardware=h100_sxm plan.gpus=256 ...``: lay out a model on a
cluster you do not have yet (docs/guides/cluster-planning.md).

The model is built on the meta device and its layers costed by the roofline
(`pipeflow.planning.costs.roofline`) on the described GPUs; tp x pp x dp, the mesh order, schedule,
micro-batch size, activation checkpointing and optimizer sharding are searched
(`pipeflow.planning.cluster_space`) and the fastest layouts that fit the GPUs' memory printed with
their predicted step, tokens/s, model TFLOP/s per GPU, MFU, memory per GPU and the GPU-hours (and
cost) of ``plan.train_tokens``, as ready-to-paste overrides.  With ``plan.calibration=<run dir>`` the
links that run timed at start and its per-layer profile replace the preset's figures where they
apply (`pipeflow.planning.measured_cluster`); the header says which figures came from where.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from pipeflow.errors import ConfigError
from pipeflow.planning.cluster_search import Prediction, Workload
from pipeflow.planning.cluster_space import CLUSTER_SCHEDULES, ClusterSpace, pinned, search_cluster
from pipeflow.planning.hardware import Cluster, load_hardware, override
from pipeflow.planning.measured_cluster import measured_layers, with_measured_links
from pipeflow.planning.costs.layer_trace import trace_layers
from pipeflow.config.schema import tensor_degree
from pipeflow.config.data import TokenDataConfig, typed_data
from pipeflow.runtime.parallel.expert_parallel import check_expert_parallel

HEADROOM = 0.9  # of a GPU's memory for tensors; the rest: allocator, NCCL buffers, kernels' workspace


@dataclass
class ClusterPlan:
    """The layouts that fit, fastest first (``candidates``, as `PlanResult` has them)."""

    candidates: list[Prediction] = field(default_factory=list)


def run_cluster_plan(cfg: DictConfig, overrides: Sequence[str] = ()) -> tuple[ClusterPlan, str]:
    """Search the layouts of ``cfg.model`` on ``plan.gpus`` GPUs of ``plan.hardware``; the result
    and the report.

    Raises:
        ConfigError: ``plan.gpus`` missing or not positive, an unknown hardware, a bad degree,
            context parallelism (``parallel.cp``, ``plan.cp_sizes``).
    """
    plan = cfg.plan
    if int(cfg.parallel.cp) > 1 or plan.cp_sizes:
        raise ConfigError("plan.hardware's roofline does not cost context parallelism yet: plan parallel.cp on "
                          "profiled layers (python -m pipeflow.plan without plan.hardware, on one GPU of the kind), "
                          "which profiles a cp rank's share and prices its ring")
    if plan.gpus is None or plan.gpus < 1:
        raise ConfigError("plan.hardware needs the GPUs to plan for: add plan.gpus=<count>, e.g. plan.gpus=256")
    cluster = load_hardware(str(plan.hardware))
    meta, figures = None, [f"GPU peak, memory and its bandwidth from {cluster.name}"]
    if plan.calibration is not None:  # what a run measured, over the preset's figures
        meta = calibration_meta(str(plan.calibration))
        cluster, lines = with_measured_links(cluster, meta.get("links") or [], str(plan.calibration))
        figures += lines
    measured = {key: value for key, value in (("intra.bandwidth_gbps", plan.get("tp_bandwidth_gbps")),
                                              ("intra.latency_us", plan.get("tp_latency_us"))) if value is not None}
    if measured:  # the tp link's figures, where given, override the description's link within a host
        cluster = override(cluster, measured)
        figures.append(f"within a host: {', '.join(f'{k}={v:g}' for k, v in measured.items())} as plan.tp_* give")
    if cluster.hosts is not None and plan.gpus > cluster.hosts * cluster.gpus_per_host:
        raise ConfigError(f"plan.gpus={plan.gpus} but {plan.hardware} has {cluster.hosts} hosts of "
                          f"{cluster.gpus_per_host} GPUs: plan for at most {cluster.hosts * cluster.gpus_per_host}")
    start = time.perf_counter()
    dtype = "fp16" if cfg.train.precision == "fp16" else "bf16"
    figures.append(matmul_figure(cluster, dtype))
    data = typed_data(cfg.data)
    if not isinstance(data, TokenDataConfig):
        raise ConfigError(f"plan.hardware costs a token model by the roofline: data={data.name} has no sequences; "
                          "choose token data (data=markov, text, tokens or chat)")
    seq = data.seq_len
    try:
        shapes = trace_layers(instantiate(cfg.model), seq, torch.float16 if dtype == "fp16" else torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        raise ConfigError(f"the model's layers cannot run on the meta device, which the cluster planner costs "
                          f"them on (no weights): {err}") from err
    if meta is not None:
        shapes, lines = measured_layers(shapes, meta, cluster, dtype, seq, str(plan.calibration))
        figures += lines
        if not meta.get("links") and not any(s.measured for s in shapes):
            raise ConfigError(f"plan.calibration={plan.calibration} gives the cluster planner nothing it measured: "
                              f"{'; '.join(lines)}; no link timed at start either (runs record them with a profile, "
                              "pipeline.profile=true, over two ranks or more)")
    kept = getattr(torch, str(cfg.train.param_dtype)).itemsize  # what dp gathers and reduces: the parameters' dtype
    figures.append(f"parameters, gradients and AdamW's state in train.param_dtype={cfg.train.param_dtype} "
                   f"({kept} bytes each): what a rank holds and dp moves")
    work = Workload(shapes, seq, data.batch_size, dtype, param_bytes=kept, grad_bytes=kept,
                    optimizer_factor=2.0)  # AdamW's m and v in the parameters' dtype
    space = cluster_space(cfg)
    limit = plan.memory_limit_gb * 1e9 if plan.memory_limit_gb is not None else HEADROOM * cluster.gpu.memory_gb * 1e9
    picks, counts = search_cluster(work, cluster, space, limit)
    seconds = time.perf_counter() - start
    scaled = sum(s.measured is not None for s in shapes)
    costed = f" ({scaled} scaled to a measured profile)" if scaled else ""
    header = (f"cluster planner: {plan.gpus} x {cluster.gpu.name} ({cluster.name}: {cluster.gpus_per_host} per host, "
              f"{cluster.intra.bandwidth_gbps:g} GB/s within, {cluster.inter.bandwidth_gbps:g} GB/s between hosts), "
              f"{len(shapes)} layers costed by the roofline{costed} in {dtype}, sequence {seq}, global batch {work.global_batch}; "
              f"{counts.estimated} layouts estimated, {counts.pruned} pruned by memory (limit {limit / 1e9:g} GB per "
              f"GPU), {counts.simulated} simulated, in {seconds:.1f} s\nfigures, where from:"
              + "".join(f"\n  {line}" for line in figures))
    return ClusterPlan(picks), header + "\n" + format_cluster_plan(picks, cfg, cluster, limit, overrides)


def matmul_figure(cluster: Cluster, dtype: str) -> str:
    """Where the roofline's matmul rate comes from: the GPU's measured figure, or the assumed fraction."""
    rate, peak = cluster.gpu.matmul_flops(dtype) / 1e12, cluster.gpu.peak_flops(dtype) / 1e12
    share = f"{rate:g} TFLOP/s {dtype} ({rate / peak:.1%} of the peak)"
    if dtype in cluster.gpu.matmul_tflops:
        return f"the fastest large matmul {share}, measured ({cluster.name})"
    return (f"the fastest large matmul taken as {share}, not measured: give gpu.matmul_tflops.{dtype} as "
            "ml-engineering's mamf-finder.py measures it")


def calibration_meta(path: str) -> dict:
    """What the run in `path` (its directory or costs.json) recorded of itself (its costs' meta).

    Raises:
        ConfigError: no readable costs file there.
    """
    from pipeflow.planning.measured_costs import read_costs

    try:
        return read_costs(path).meta
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"plan.calibration={path}: no costs of a run there ({err}); runs write "
                          "<run_dir>/costs.json at their end") from err


def cluster_space(cfg: DictConfig) -> ClusterSpace:
    """The search space: ``parallel.tp`` (when > 1) and ``parallel.pp`` pin those degrees,
    ``plan.tp_sizes`` lists tp degrees, ``plan.schedules`` and ``plan.microbatches`` narrow the rest.

    Raises:
        ConfigError: an unknown schedule.
    """
    plan = cfg.plan
    schedules = tuple(plan.schedules) if plan.schedules is not None else CLUSTER_SCHEDULES
    from pipeflow.schedules import GENERATORS

    unknown = [s for s in schedules if s not in GENERATORS or s == "auto"]
    if unknown:
        raise ConfigError(f"plan.schedules has {unknown}, which the cluster planner cannot cost; use of "
                          f"{', '.join(s for s in GENERATORS if s != 'auto')}")
    tp_list = plan.tp_sizes
    space = ClusterSpace(int(plan.gpus), tp=tuple(int(t) for t in tp_list) if tp_list else None,
                         schedules=schedules, max_chunks=int(plan.max_chunks),
                         microbatches=tuple(int(m) for m in plan.microbatches) if plan.microbatches else None)
    tp = tensor_degree(cfg.parallel)
    ep = int(cfg.parallel.get("ep") or 1)
    if ep > 1 and tp > 1:  # refused now, as train.py would, not as "no layout" after the search
        check_expert_parallel(ep, ep, tp, "none", None)
    return pinned(space, tp if tp > 1 else None, cfg.parallel.pp, ep if ep > 1 else None)


def format_cluster_plan(picks: Sequence[Prediction], cfg: DictConfig, cluster: Cluster, limit: float,
                        overrides: Sequence[str] = ()) -> str:
    """The fastest ``plan.top`` layouts as a table, their overrides and the command that runs the
    first (`overrides`: the planner's command line, repeated but for ``plan.*`` and the pick's keys)."""
    plan = cfg.plan
    tokens = plan.train_tokens
    dtype = "fp16" if cfg.train.precision == "fp16" else "bf16"
    rows = [("#", "step (s)", "tokens/s", "TFLOP/s per GPU", "MFU", "mem/GPU (GB)", "bubble",
             *(("GPU-hours",) if tokens else ()), *(("cost",) if tokens and plan.gpu_hour_price else ()))]
    for k, p in enumerate(picks[: plan.top], 1):
        gpus = p.layout.tp * p.layout.pp * p.layout.dp
        hours = gpus * float(tokens) / p.tokens_per_s / 3600 if tokens else 0.0
        rows.append((str(k), f"{p.step_s:.4g}", f"{p.tokens_per_s:,.0f}", f"{p.model_tflops_per_gpu:.0f}",
                     f"{p.mfu:.1%}", f"{p.memory_bytes / 1e9:.3g}", f"{p.bubble:.1%}",
                     *((f"{hours:,.0f}",) if tokens else ()),
                     *((f"{hours * plan.gpu_hour_price:,.0f}",) if tokens and plan.gpu_hour_price else ())))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    for k, p in enumerate(picks[: plan.top], 1):
        lines.append(f"  #{k}: {p.layout.overrides(p.num_microbatches)}")
    if not picks:
        lines.append(f"no layout fits {limit / 1e9:g} GB per GPU: more GPUs, a GPU with more memory, or "
                     "plan.memory_limit_gb")
    else:
        pick = picks[0].layout.overrides(picks[0].num_microbatches)
        keys = {o.split("=", 1)[0] for o in pick.split()}
        keep = [shlex.quote(o) for o in overrides if not o.startswith("plan.") and o.split("=", 1)[0] not in keys]
        if cfg.train.precision == "fp32":  # the roofline costed bf16: the pick runs what was costed
            keep.append(f"train.precision={dtype}")
        gpus = picks[0].layout.tp * picks[0].layout.pp * picks[0].layout.dp
        hosts = -(-gpus // cluster.gpus_per_host)
        lines.append(f"run the pick: torchrun --nnodes {hosts} --nproc-per-node {min(gpus, cluster.gpus_per_host)} "
                     f"train.py {' '.join([*keep, pick])}")
        lines.append("TFLOP/s per GPU and MFU count model FLOPs (6 x parameters x tokens plus attention, no "
                     f"recomputation) against the dense {cluster.gpu.peak_flops(dtype) / 1e12:g} TFLOP/s {dtype} peak; "
                     "accuracy on published runs: docs/guides/cluster-planning.md")
    return "\n".join(lines)
