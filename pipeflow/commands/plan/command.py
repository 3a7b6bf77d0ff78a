"""Predict the best pipeline layout before running: ``python -m pipeflow.plan model=gpt parallel.pp=4``.

The same Hydra overrides as train.py (composed from the same ``configs/``), no torchrun.  Every
layer is profiled on this machine's device (forward, the backward split into input-grad B and
weight-grad W, activation bytes) at the smallest and the largest micro-batch size tried; costs
in between are interpolated linearly (per-call overhead included).  Then every (schedule x
micro-batch count x chunks per rank x balanced split) is simulated (`pipeflow.planning.search`) and
the fastest that fit ``plan.memory_limit_gb`` are printed with ready-to-paste overrides:

    python -m pipeflow.plan model=gpt parallel.pp=4 plan.memory_limit_gb=2 plan.top=5
    torchrun --nproc-per-node 4 train.py <overrides of the pick>
"""
from __future__ import annotations

import csv
import dataclasses
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeflow.data.batch_ramp import BatchRamp
from pipeflow.config.schema import register_configs, resolve_layout, tensor_degree
from pipeflow.run.layer_profiles import interpolate, profile_costs, profile_sizes  # noqa: F401 - the API
from pipeflow.commands.plan.cp import context_degree, ring_pricing, search_cp
from pipeflow.commands.plan.ep import expert_costs
from pipeflow.commands.plan.help import CONFIG_DIR, USAGE, help_text
from pipeflow.commands.plan.tp import search_tp, tp_degrees, tp_link_figures  # noqa: F401 - search_tp: part of the API
from pipeflow.runtime.world import hosts
from pipeflow.runtime.world.distributed import choose_device
from pipeflow.runtime.host_link import measured_once
from pipeflow.errors import ConfigError
from pipeflow.planning.order_search import order_note
from pipeflow.planning.search import CostModel, PlanResult, SearchSpace, StepModel, search
from pipeflow.planning.profile import LayerProfile
from pipeflow.schedules import GENERATORS
from pipeflow.schedules.offload import HostLink, check_mode

# what a pick sets (pipeline.stages_per_rank: that key's old name); parallel.order stays: a pick's
# own (when not [dp,pp,tp]) follows it and wins
_PICK_KEYS = {"schedule", "pipeline.num_microbatches", "schedule.stages_per_rank", "pipeline.split_points",
              "parallel.tp", "parallel.cp", "pipeline.offload", "pipeline.stages_per_rank"}
_HELP_FLAGS = ("-h", "--help")


def compose_config(overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> DictConfig:
    """The job config train.py would get for these overrides."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def search_space(cfg: DictConfig, batch_size: int) -> SearchSpace:
    """The planner's search space from the ``plan`` config."""
    plan = cfg.plan
    names = tuple(plan.schedules) if plan.schedules is not None else tuple(GENERATORS)
    unknown = [n for n in names if n not in GENERATORS]
    if unknown:
        raise ConfigError(f"plan.schedules has unknown {unknown}; valid: {', '.join(GENERATORS)}")
    counts = plan.microbatches or [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    if plan.max_chunks < 1:
        raise ConfigError(f"plan.max_chunks={plan.max_chunks} must be at least 1")
    if plan.rehearse < 0:
        raise ConfigError(f"plan.rehearse={plan.rehearse} must be >= 0 (layouts rehearsed; 0: none)")
    modes = tuple(check_mode(str(mode)) for mode in plan.offload_modes)
    if not modes:
        raise ConfigError("plan.offload_modes=[] tries nothing; use [none], [none,auto] or [none,auto,all]")
    gbps = plan.host_link_gbps
    if gbps is not None and gbps <= 0:
        raise ConfigError(f"plan.host_link_gbps={gbps} must be > 0 (GB/s each way), or null: measured here")
    link = SearchSpace.host_link if gbps is None else HostLink(gbps * 1e9, gbps * 1e9, SearchSpace.host_link.latency_s)
    return SearchSpace(names, tuple(int(m) for m in counts), tuple(range(1, plan.max_chunks + 1)), plan.splits,
                       dp=cfg.parallel.dp, shard=cfg.parallel.shard,
                       offload=modes, host_link=link)


def host_link_for(cfg: DictConfig, space: SearchSpace, device: torch.device) -> tuple[SearchSpace, str]:
    """The search space with the host link its offload plans assume: ``plan.host_link_gbps``, or
    measured on `device` as ``train.py`` measures it (null); and a phrase saying which."""
    if space.offload == ("none",):
        return space, ""
    gbps = cfg.plan.host_link_gbps
    if gbps is not None:
        return space, f"; offload over {gbps:g} GB/s each way (plan.host_link_gbps)"
    measured = measured_once(str(device))
    link = measured.link(SearchSpace.host_link.latency_s if measured.overlapped else 0.0)
    where = "beside compute" if measured.overlapped else "on the compute thread: auto hides nothing"
    return dataclasses.replace(space, host_link=link), (
        f"; offload over the host link measured here ({link.d2h_bytes_per_s / 1e9:.1f} GB/s out, "
        f"{link.h2d_bytes_per_s / 1e9:.1f} back, {where}; plan.host_link_gbps sets a GPU's)")


def run_plan(cfg: DictConfig, costs: CostModel | None = None, overrides: Sequence[str] = ()) -> tuple[PlanResult, str]:
    """Profile (unless `costs` are given), search and format; returns the result and the report.

    `overrides` (the planner's command line) are repeated in the printed train.py command,
    except the ``plan.*`` ones and those the pick sets.

    Raises:
        ConfigError: ``parallel.pp`` missing or inconsistent, a bad ``plan`` setting.
    """
    if cfg.plan.hardware is not None:  # a cluster described, not profiled
        from pipeflow.commands.plan.cluster import run_cluster_plan

        return run_cluster_plan(cfg, overrides)
    if cfg.parallel.pp is None:
        raise ConfigError("the planner needs the pipeline size: add parallel.pp=<ranks>")
    if cfg.parallel.dp == "auto":
        raise ConfigError("parallel.dp=auto takes the replicas from the world size, which the planner does not have: "
                          "give the replicas to plan for, e.g. parallel.dp=2")
    dp, pp = resolve_layout(cfg.parallel, cfg.parallel.dp * cfg.parallel.pp * tensor_degree(cfg.parallel))
    batch = cfg.data.batch_size // dp
    space = search_space(cfg, batch)
    sizes = [batch // m for m in space.microbatches if batch % m == 0]
    if not sizes:
        raise ConfigError(f"no count in plan.microbatches={list(space.microbatches)} divides data.batch_size={batch}")
    limit = None if cfg.plan.memory_limit_gb is None else cfg.plan.memory_limit_gb * 1e9
    replicas = f" x {dp} data-parallel replicas, batch {batch} per replica" if dp > 1 else f", batch {batch}"
    if cfg.plan.calibration is not None:
        if context_degree(cfg) > 1 or cfg.plan.cp_sizes:
            raise ConfigError("plan.calibration ranks layouts on one run's measured costs, which fix its cp; plan "
                              "context parallelism on profiled costs: leave plan.calibration=null")
        result, header = _plan_calibrated(cfg, pp, batch, space, limit)
        header = f"planner: {pp} pipeline ranks{replicas}; {header}"
    else:
        result, header = search_cp(cfg, lambda cp: _profiled_search(cfg, cp, costs, pp, dp, batch, sizes, space, limit),
                                   limit)
        header = f"planner: {pp} pipeline ranks{replicas}, {header}"
    header += order_note(dp, pp, tp_degrees(cfg), space.hosts)
    if cfg.plan.rehearse > 0 and result.candidates:
        if any(c.cp > 1 for c in result.candidates):
            raise ConfigError("plan.rehearse builds layouts without context parallelism so far: plan.rehearse=0 "
                              "with parallel.cp or plan.cp_sizes")
        result, rehearsed = rehearse_shortlist(result, cfg, overrides, dp * pp)
        header += f"; {rehearsed}"
    if cfg.plan.csv:
        write_csv(result, cfg.plan.csv)
    return result, header + "\n" + format_plan(result, cfg.plan.top, dp * pp, limit, overrides)


def _profiled_search(cfg: DictConfig, cp: int, costs: CostModel | None, pp: int, dp: int, batch: int,
                     sizes: Sequence[int], space: SearchSpace, limit: float | None) -> tuple[PlanResult, str]:
    """Profile the layers as a rank of cp `cp` runs them (its share of each row, attention round a
    loopback ring; `costs` given: those), price the runtime and the ring on its links, and search
    every tp degree; the result and a phrase saying what was profiled and how it is costed."""
    device = choose_device(cfg.dist.backend, cfg.dist.device)[1]
    threads = torch.get_num_threads()
    try:  # profile with the threads each rank of the run computes with
        torch.set_num_threads(run_threads(dp * pp * cp))
        costs = costs or profile_costs(cfg, sizes, device, cp)
        latency, comm = comm_model(cfg, costs, sizes, device, pp)
        costs, ep_note = expert_costs(cfg, costs, sizes, latency, device)  # parallel.ep: experts and all_to_alls
        model, overhead_s, runtime = runtime_model(cfg, costs(max(sizes)), device, dp * cp, pp)
        if cfg.plan.comm_latency_ms is None and pp > 1 and device.type == "cpu":
            model, busy = busy_comm(model, costs(max(sizes)), latency(max(sizes)) if callable(latency) else latency)
            comm += busy
    finally:
        torch.set_num_threads(threads)
    space, link_note = host_link_for(cfg, dataclasses.replace(space, dp=space.dp * cp), device)
    ring, cp_note = ring_pricing(cfg, cp)  # parallel.cp: the ring's exposed passes, on each tp rank's share
    result = search_tp(cfg, costs, pp, batch, space, limit, latency, overhead_s, model, ring)
    ramped = ramp_steps(cfg, result, space, batch, dp,
                        lambda sub, sp, b: search_tp(sub, costs, pp, b, sp, limit, latency, overhead_s, model, ring))
    amp = "" if cfg.train.precision == "fp32" else f", {cfg.train.precision} autocast"
    degrees = tp_degrees(cfg)
    tp_note = "" if degrees == [1] else (
        "; tp {} costed over {:g} GB/s + {:g} us per collective (plan.tp_bandwidth_gbps, plan.tp_latency_us)"
        .format(", ".join(map(str, degrees)), *tp_link_figures(cfg)))
    return result, (f"profiled on {device} ({cfg.train.param_dtype}{amp}) at micro-batch sizes {min(sizes)} and "
                    f"{max(sizes)}{cp_note}; {comm}; {runtime}{tp_note}{ep_note}{link_note}{ramped}")


def ramp_steps(cfg: DictConfig, result: PlanResult, space: SearchSpace, batch: int, dp: int,
               price: Callable[[DictConfig, SearchSpace, int], PlanResult]) -> str:
    """``train.batch_ramp``: the pick's step at each size of the ramp (its schedule, split, v, tp
    and offload, fewer micro-batches of the same rows), as a phrase for the report; "" without a
    ramp or a pick. `price(cfg, space, batch)` searches on the costs already profiled."""
    ramp_cfg = OmegaConf.select(cfg, "train.batch_ramp")
    if ramp_cfg is None or ramp_cfg.start is None or not result.candidates:
        return ""
    pick = result.candidates[0]
    try:
        ramp = BatchRamp(int(ramp_cfg.start), int(ramp_cfg.increment), int(ramp_cfg.samples),
                         int(cfg.data.batch_size), dp, pick.num_microbatches)
    except ConfigError as exc:
        return f"; the pick cannot ramp its batch: {exc}"
    sub = OmegaConf.merge(cfg, {"plan": {"tp_sizes": [pick.tp]}})
    rows, steps = batch // pick.num_microbatches, []
    for size in ramp.sizes():
        m = size // (dp * rows)
        got = price(sub, dataclasses.replace(space, schedules=(pick.schedule,), microbatches=(m,),
                                             chunks=(pick.stages_per_rank,), offload=(pick.offload,)), m * rows)
        same = [c for c in got.candidates + got.over_memory if c.split_points == pick.split_points]
        ranked = same or got.candidates or got.over_memory
        steps.append(f"{size} samples (m {m}) {1e3 * ranked[0].step_s:.2f} ms" if ranked else f"{size} samples: -")
    return f"; the pick's step as the batch ramps (train.batch_ramp): {', '.join(steps)}"


def rehearse_shortlist(result: PlanResult, cfg: DictConfig, overrides: Sequence[str], world: int
                       ) -> tuple[PlanResult, str]:
    """``plan.rehearse=k``: the k fastest layouts (one per schedule, m, v) built as train.py would
    in `world` processes on this host and re-ranked, first, by the step each run predicted from
    its rehearsal (`pipeflow.commands.plan.rehearsal`); and a line saying so.

    Raises:
        ConfigError: a negative count, a planner on a GPU (the rehearsal is for shared CPU cores),
            or a layout whose run cannot be built (its error).
    """
    from pipeflow.commands.plan.rehearsal import rehearse_layouts, run_words, shortlist

    if choose_device(cfg.dist.backend, cfg.dist.device)[1].type != "cpu":
        raise ConfigError("plan.rehearse rehearses on this host's CPU cores (gloo); on GPUs the ranks do not share "
                          "cores and the simulated ranking stands: leave plan.rehearse=0")
    picks = shortlist(result.candidates, cfg.plan.rehearse)
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in _PICK_KEYS and not o.startswith("plan.")]
    with tempfile.TemporaryDirectory(prefix="pipeflow-plan-rehearsal-") as tmp:
        configs = [compose_config(run_words(keep, result.candidates[i].overrides(), os.path.join(tmp, str(k)),
                                            result.candidates[i].step_s))
                   for k, i in enumerate(picks)]
        try:
            steps = rehearse_layouts(configs, world)
        except RuntimeError as err:
            raise ConfigError(str(err)) from err
    rehearsed = sorted((dataclasses.replace(result.candidates[i], rehearsed_s=s) for i, s in zip(picks, steps)),
                       key=lambda c: c.rehearsed_s)
    rest = [c for i, c in enumerate(result.candidates) if i not in set(picks)]
    return dataclasses.replace(result, candidates=rehearsed + rest), (
        f"the {len(picks)} fastest (one per schedule, m, v) rehearsed in {world} processes here and ranked first "
        "by their rehearsed step")


def _plan_calibrated(cfg: DictConfig, pp: int, batch: int, space: SearchSpace, limit: float | None
                     ) -> tuple[PlanResult, str]:
    """Search on the costs a run measured (``plan.calibration``): its per-layer costs, transfers,
    the runtime's overheads, posting and tail; a line saying what they are and where from."""
    from pipeflow.planning.measured_costs import calibrated_cost_model, read_costs, step_model, transfer_model

    try:
        cal = read_costs(cfg.plan.calibration)
        costs = calibrated_cost_model(cal)
    except (OSError, ValueError) as err:
        raise ConfigError(f"plan.calibration={cfg.plan.calibration}: {err}") from err
    meta = cal.meta
    if meta.get("num_ranks") != pp or len(meta["profiles"]) != len(instantiate(cfg.model)):
        raise ConfigError(f"plan.calibration={cfg.plan.calibration} measured {meta.get('num_ranks')} pipeline ranks "
                          f"and {len(meta['profiles'])} layers; this plan has parallel.pp={pp} and another model: "
                          "calibrate with a run of the same model and pipeline size")
    model = step_model(cal)
    result = search(costs, pp, batch, space, limit, cfg.plan.optimizer_factor, transfer_model(cal), 0.0, model)
    machine = meta.get("machine", {})
    return result, (
        f"costs measured by the run in {cfg.plan.calibration} ({meta.get('schedule')}, m={meta.get('num_microbatches')}, "
        f"micro-batch {meta.get('microbatch_size')}, {cal.steps} steps on {machine.get('host', '?')}: "
        f"{machine.get('local_ranks', '?')} ranks on {machine.get('cpus', '?')} cores), scaled linearly in the "
        f"micro-batch size; transfer {1e3 * cal.latency_s:.3f} ms + {1e9 * cal.per_byte_s:.3f} ms/MB; "
        f"{1e3 * (model.step_overhead_s + model.post_s):.3f} ms per program step, posting {model.posting}; "
        f"tail {1e3 * model.tail_s:.2f} ms")


def run_threads(world: int) -> int:
    """The compute threads of each rank of a run of `world` ranks on this host: OMP_NUM_THREADS,
    else torchrun's 1 for several ranks, else torch's default."""
    return int(os.environ.get("OMP_NUM_THREADS", 1 if world > 1 else torch.get_num_threads()))


def runtime_model(cfg: DictConfig, layers: Sequence[LayerProfile], device: torch.device, dp: int, pp: int
                  ) -> tuple[StepModel, float, str]:
    """What the run adds to the layers (`pipeflow.planning.step_model`): the lowering it will
    interpret (NCCL: group; gloo: recvs posted ahead unless ``comm.post_recvs=at_step``), the
    per-action overhead (``plan.action_overhead_ms``, else measured), the cores its dp x pp ranks
    share on this host (threads per rank: OMP_NUM_THREADS, torchrun's 1 by default), and the
    optimizer's tail on the parameters of a p-th of the model; and a line saying so."""
    from pipeflow.planning.costs.runtime_timing import measure_action_overhead_s, measure_optimizer_s
    from pipeflow.planning.step_model import HostShare

    posting = "group" if device.type == "cuda" else "at_step" if cfg.comm.post_recvs == "at_step" else "ahead"
    set_ms = cfg.plan.action_overhead_ms
    overhead = set_ms / 1e3 if set_ms is not None else measure_action_overhead_s(device)
    cores = len(hosts.usable_cores())
    threads = run_threads(dp * pp)
    share = HostShare(cores, threads, float(dp), device.type)
    per_rank = sorted((p.params for p in layers), reverse=True)[: max(1, -(-len(layers) // pp))]
    tail = measure_optimizer_s([torch.nn.Parameter(torch.zeros(max(1, n), device=device)) for n in per_rank], device)
    how = "plan.action_overhead_ms" if set_ms is not None else "measured"
    shared = f", {dp * pp} ranks x {threads} thread(s) on {cores} cores" if device.type == "cpu" else ""
    return StepModel(posting, 0.0, 0.0, tail, share), overhead, (
        f"{1e3 * overhead:.3f} ms per action ({how}), posting {posting}, tail {1e3 * tail:.2f} ms{shared}")


def busy_comm(model: StepModel, layers: Sequence[LayerProfile], idle_s: float) -> tuple[StepModel, str]:
    """The model with transfers measured again while both processes compute (a delivery waits for a
    core where the ranks share them): their ratio to the idle ones, at the largest payload."""
    from pipeflow.planning.costs.comm import measure_exchange_s

    busy_s = measure_exchange_s([max(p.output_bytes for p in layers)], busy=True)[0]
    factor = max(1.0, busy_s / idle_s) if idle_s > 0 else 1.0
    return dataclasses.replace(model, busy_factor=factor), f", {1e3 * busy_s:.3f} ms while the host computes"


def comm_model(cfg: DictConfig, costs: CostModel, sizes: Sequence[int], device: torch.device,
               num_ranks: int) -> tuple[Any, str]:
    """The simulated cost of a communicating step: ``plan.comm_latency_ms``, or when that is null,
    an exchange of the largest layer output measured between two local processes at the smallest
    and the largest micro-batch size (linear in between); and a line saying which."""
    if cfg.plan.comm_latency_ms is not None or num_ranks == 1:
        ms = cfg.plan.comm_latency_ms or 0.0
        return ms / 1e3, f"comm {ms:g} ms per step (plan.comm_latency_ms)"
    from pipeflow.planning.costs.comm import measure_exchange_s
    b_low, b_high = min(sizes), max(sizes)
    payload = [max(p.output_bytes for p in costs(b)) for b in (b_low, b_high)]
    use_cuda = device.type == "cuda" and torch.cuda.device_count() >= 2
    low, high = measure_exchange_s(payload, use_cuda=use_cuda)

    def latency(b: int) -> float:
        return low if b_high == b_low else max(0.0, low + (high - low) * (b - b_low) / (b_high - b_low))

    how = "nccl" if use_cuda else "gloo"
    return latency, (f"comm measured ({how}): {1e3 * low:.3f} ms per step at {payload[0] / 1e6:.2f} MB, "
                     f"{1e3 * high:.3f} ms at {payload[1] / 1e6:.2f} MB")


def format_plan(result: PlanResult, top: int, num_ranks: int, limit_bytes: float | None,
                overrides: Sequence[str] = ()) -> str:
    """The top layouts as a table (rank, predicted step, bubble, memory, overrides) and a summary;
    `num_ranks` is the world size the pick is launched with."""
    rehearsed = any(c.rehearsed_s is not None for c in result.candidates)
    tp = any(c.tp > 1 for c in result.candidates + result.over_memory)  # a tp column where tp was searched
    cp = any(c.cp > 1 for c in result.candidates + result.over_memory)  # likewise cp
    offload = any(c.offload != "none" for c in result.candidates + result.over_memory)  # likewise plan.offload_modes
    rows = [("#", "schedule", "m", "v", *(("tp",) if tp else ()), *(("cp",) if cp else ()),
             *(("offload",) if offload else ()), "step (ms)",
             *(("rehearsed (ms)",) if rehearsed else ()), "bubble", "peak mem/rank (MB)", "overrides")]
    for k, c in enumerate(result.candidates[:top], 1):
        step = (f"{1e3 * c.rehearsed_s:.2f}" if c.rehearsed_s is not None else "-",) if rehearsed else ()
        rows.append((str(k), c.schedule, str(c.num_microbatches), str(c.stages_per_rank), *((str(c.tp),) if tp else ()),
                     *((str(c.cp),) if cp else ()), *((c.offload,) if offload else ()),
                     f"{1e3 * c.step_s:.2f}", *step, f"{c.bubble:.1%}", f"{c.peak_bytes / 1e6:.1f}", c.overrides()))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]) - 1)]
    lines = [" | ".join([cell.ljust(w) for cell, w in zip(r, widths)] + [r[-1]]) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-" + "-" * 9)
    simulated = len(result.candidates) + len(result.over_memory)
    limit = "no memory limit" if limit_bytes is None else f"{len(result.over_memory)} over the memory limit {limit_bytes / 1e9:g} GB"
    by_schedule: dict[str, int] = {}
    for reason, n in result.skipped.items():
        name = reason.split(":")[0]
        by_schedule[name] = by_schedule.get(name, 0) + n
    skipped = ", ".join(f"{name} {n}" for name, n in sorted(by_schedule.items())) or "none"
    lines.append(f"{simulated} layouts simulated ({limit}); invalid combinations skipped: {skipped}")
    if result.candidates:
        keep = [shlex.quote(o) for o in overrides if o.split("=", 1)[0].lstrip("+~") not in _PICK_KEYS
                and not o.startswith("plan.")]
        command = " ".join(["train.py", *keep, result.candidates[0].overrides()])
        pick = result.candidates[0]
        lines.append(f"run the pick: torchrun --nproc-per-node {num_ranks * pick.tp * pick.cp} {command}")
    else:
        hint = "" if offload else ", or let held activations go to host memory (plan.offload_modes=[none,auto,all])"
        lines.append(f"no layout fits: raise plan.memory_limit_gb, or try more micro-batches (plan.microbatches){hint}")
    return "\n".join(lines)


def write_csv(result: PlanResult, path: str) -> None:
    """Every simulated layout, fastest first, with whether it fits the memory limit."""
    rows = [(c, True) for c in result.candidates] + [(c, False) for c in result.over_memory]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["schedule", "num_microbatches", "stages_per_rank", "split_points", "step_ms", "bubble",
                         "peak_memory_mb", "fits", "overrides", "rehearsed_ms", "offload"])
        for c, fits in sorted(rows, key=lambda row: row[0].step_s):
            writer.writerow([c.schedule, c.num_microbatches, c.stages_per_rank, " ".join(map(str, c.split_points)),
                             f"{1e3 * c.step_s:.4f}", f"{c.bubble:.4f}", f"{c.peak_bytes / 1e6:.3f}", fits,
                             c.overrides(), "" if c.rehearsed_s is None else f"{1e3 * c.rehearsed_s:.4f}", c.offload])


def main(argv: Sequence[str] | None = None) -> int:
    """Compose the config from the command line's overrides, plan, print; returns the exit code
    (0, 1 when no layout fits the memory limit, 2 for a bad command line or config).
    ``-h``/``--help`` prints `help_text` and returns 0."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in _HELP_FLAGS for a in args):
        print(help_text())
        return 0
    flags = [a for a in args if a.startswith("-")]
    if flags:
        print(f"{USAGE}\npipeflow.plan: unknown option {flags[0]!r}; it takes key=value overrides only "
              f"(see --help)", file=sys.stderr)
        return 2
    cfg = compose_config(args)
    try:
        result, report = run_plan(cfg, overrides=args)
    except ConfigError as err:
        print(f"pipeflow.plan: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0 if result.candidates else 1


if __name__ == "__main__":
    sys.exit(main())
