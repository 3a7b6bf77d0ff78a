"""``parallel.replan=true``: the layout chosen at every (re)start for the world that met.

With ``parallel.pp=auto`` (and ``parallel.tp=auto``, ``parallel.dp=auto``) a run does not fix its
degrees: at start, before anything is built, rank 0 plans dp x pp x tp for the world size on the
model's profiled layers (:func:`pipeflow.planning.search.search`, the configured schedule and
micro-batch count, the balanced splits), within ``plan.memory_limit_gb`` per rank (on a GPU, by
default, the share of its memory the run plans for), fastest predicted step first; every rank
takes the same degrees (broadcast).  The profile is measured once and kept in the run directory
(``<run_dir>/replan/profile.json``, reused while the model, data, precision and device are the
same), and so is each world size's plan (``plans.json``): a restart after a host was lost or
joined re-plans in well under a second.  Checkpoints load under any layout, so the run goes on
from its last checkpoint on whatever the planner chose.

A world too small for the model stops with :class:`~pipeflow.errors.ConfigError` naming the
fewest ranks of that memory that would hold it, before anything is written.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from pipeflow.errors import ConfigError, PipeflowError
from pipeflow.planning.profile import LayerProfile
from pipeflow.planning.search import Candidate, SearchSpace, search
from pipeflow.planning.costs.tensor import split_profiles
from pipeflow.checkpoint.saving import write_atomic
from pipeflow.runtime.world import hosts
from pipeflow.schedules import LAYOUTS

log = logging.getLogger("pipeflow")

AUTO = "auto"
TP_SIZES = (1, 2, 4, 8)  # parallel.tp=auto tries these (within a host's ranks)
FOLDER = "replan"


@dataclasses.dataclass(frozen=True)
class Degrees:
    """A chosen layout: replicas, pipeline ranks, ranks per stage; its predicted step and peak."""

    dp: int
    pp: int
    tp: int
    step_s: float
    peak_bytes: float

    def shape(self) -> str:
        """``dp 1 x pp 2 x tp 2``."""
        return f"dp {self.dp} x pp {self.pp} x tp {self.tp}"


def replanned(cfg: DictConfig, device: torch.device) -> DictConfig:
    """`cfg` with ``parallel.dp``, ``parallel.pp`` and ``parallel.tp`` chosen for this world when
    ``parallel.replan`` is set (collective: rank 0 plans, every rank takes its degrees); `cfg`
    itself otherwise.

    Raises:
        ConfigError: ``auto`` degrees without ``parallel.replan``; no layout of this world fits
            the memory (naming the ranks it would need).
    """
    parallel = cfg.parallel
    autos = [k for k in ("pp", "tp") if parallel.get(k) == AUTO]
    if not parallel.get("replan", False):
        if autos:
            raise ConfigError(f"parallel.{autos[0]}=auto is chosen at each start by re-planning: add "
                              f"parallel.replan=true (or give parallel.{autos[0]} a number)")
        return cfg
    for key, what in (("cp", "context parallelism"), ("ep", "expert parallelism")):
        if int(parallel.get(key, 1) or 1) > 1:
            raise ConfigError(f"parallel.replan plans dp x pp x tp; with parallel.{key}={parallel[key]} ({what}) it "
                              f"does not yet: set parallel.{key}=1 or give the degrees (parallel.replan=false)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box[0] = _plan(cfg, world, device)
        except PipeflowError as exc:  # every rank raises what rank 0 found
            box[0] = exc
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], PipeflowError):
        raise box[0]
    degrees, line = box[0]
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(line)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.parallel.dp, out.parallel.pp, out.parallel.tp = degrees.dp, degrees.pp, degrees.tp
    return out


def _plan(cfg: DictConfig, world: int, device: torch.device) -> tuple[Degrees, str]:
    """Rank 0: the degrees for `world` ranks (cached per world size) and the line saying why."""
    folder = os.path.join(cfg.train.run_dir, FOLDER) if cfg.train.run_dir else None
    low, b_low, high, b_high, key = _profiles(cfg, device, folder)
    limit = _memory_limit(cfg, device)
    # a kept plan stands for the same profile, memory limit and degrees asked for
    key = f"{key}:{limit}:{cfg.parallel.dp}:{cfg.parallel.pp}:{cfg.parallel.tp}:{cfg.parallel.shard}"
    plans = _read(folder, "plans.json") or {}
    if plans.get("key") != key:
        plans = {"key": key, "worlds": {}, "last": plans.get("last")}
    cached = plans["worlds"].get(str(world))
    if cached is not None:
        degrees, how = Degrees(**cached), "the plan kept for this world size"
    else:
        costs = _interpolated(low, b_low, high, b_high)
        degrees = best_degrees(costs, cfg, world, limit, local_ranks=_local_ranks(world))
        if degrees is None:
            raise ConfigError(_too_small(costs, cfg, world, limit))
        how = "planned on the profile kept in the run directory" if folder else "planned on the profile"
        plans["worlds"][str(world)] = dataclasses.asdict(degrees)
    last = plans.get("last")
    was = ""
    if last is not None and last.get("world") != world:
        before = Degrees(**last["degrees"])
        change = "lost" if last["world"] > world else "gained"
        n = abs(last["world"] - world)
        was = f" (was {before.shape()} on {last['world']} ranks: the job {change} {n} rank{'s' if n > 1 else ''})"
    plans["last"] = {"world": world, "degrees": dataclasses.asdict(degrees)}
    _write(folder, "plans.json", plans)
    line = (f"re-planned for {world} ranks{_where()}: {degrees.shape()}{was}, predicted step "
            f"{1e3 * degrees.step_s:.1f} ms, peak {degrees.peak_bytes / 1e6:.1f} MB per rank ({how})")
    return degrees, line


def best_degrees(costs: Any, cfg: DictConfig, world: int, limit: float | None, local_ranks: int | None = None
                 ) -> Degrees | None:
    """The fastest (dp, pp, tp) of `world` ranks whose busiest rank fits `limit` bytes, for the
    configured schedule and micro-batch count (None when none fits).  `costs`: per-layer costs
    of a micro-batch of b samples; tp stays within `local_ranks` (a host's)."""
    found = [c for c in _candidates(costs, cfg, world, limit, local_ranks) if c[1] is not None]
    if not found:
        return None
    (dp, pp, tp), best = min(found, key=lambda c: (c[1].step_s, c[0][1], c[0][2]))
    return Degrees(dp, pp, tp, best.step_s, best.peak_bytes)


def _candidates(costs: Any, cfg: DictConfig, world: int, limit: float | None, local_ranks: int | None
                ) -> list[tuple[tuple[int, int, int], Candidate | None]]:
    """Every (dp, pp, tp) of `world` the config allows, with its fastest fitting layout (or None)."""
    parallel, batch, m = cfg.parallel, int(cfg.data.batch_size), int(cfg.pipeline.num_microbatches)
    layers = len(costs(1))
    tps = ([t for t in TP_SIZES if world % t == 0 and (local_ranks is None or t <= local_ranks)]
           if parallel.tp == AUTO else [int(parallel.tp)])
    out = []
    for tp in tps:
        if world % tp:
            continue
        pps = [p for p in range(1, min(layers, world // tp) + 1) if (world // tp) % p == 0] \
            if parallel.pp in (AUTO, None) else [int(parallel.pp)]
        for pp in pps:
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if (parallel.dp != AUTO and int(parallel.dp) != dp) or batch % (dp * m):
                continue
            per_rank = costs if tp == 1 else (lambda b, tp=tp: split_profiles(costs(b), tp))
            out.append(((dp, pp, tp), _fastest(per_rank, cfg, pp, dp, batch // dp, m, limit)))
    return out


def _fastest(costs: Any, cfg: DictConfig, pp: int, dp: int, batch: int, m: int, limit: float | None
             ) -> Candidate | None:
    """The fastest layout of the configured schedule at `pp` ranks within `limit` (None: none fits)."""
    name = str(cfg.schedule.name)
    fixed = LAYOUTS[name][0] if name in LAYOUTS else None
    chunks = (fixed,) if fixed is not None else (int(cfg.schedule.stages_per_rank or 1),)
    space = SearchSpace((name,), (m,), chunks, "balanced", dp=dp, shard=str(cfg.parallel.shard))
    latency = (cfg.plan.comm_latency_ms or 0.0) / 1e3
    try:
        result = search(costs, pp, batch, space, limit, float(cfg.plan.optimizer_factor), latency)
    except PipeflowError:
        return None
    return result.candidates[0] if result.candidates else None


def _too_small(costs: Any, cfg: DictConfig, world: int, limit: float | None) -> str:
    """What a world too small for the model is told: the fewest ranks of this memory that hold it."""
    gb = "no limit" if limit is None else f"{limit / 1e9:g} GB"
    for bigger in range(world + 1, 8 * world + 9):
        fits = best_degrees(costs, cfg, bigger, limit)
        if fits is not None:
            return (f"parallel.replan: no layout of {world} ranks holds the model within {gb} per rank "
                    f"(plan.memory_limit_gb); it needs at least {bigger} ranks of that memory ({fits.shape()}, "
                    f"{fits.peak_bytes / 1e6:.1f} MB per rank). Add hosts, or raise the limit if the ranks have "
                    f"more memory; the last checkpoint is left as it was")
    return (f"parallel.replan: no layout of up to {8 * world + 8} ranks holds the model within {gb} per rank "
            f"(plan.memory_limit_gb) with data.batch_size={cfg.data.batch_size} and "
            f"pipeline.num_microbatches={cfg.pipeline.num_microbatches}; the last checkpoint is left as it was")


def _profiles(cfg: DictConfig, device: torch.device, folder: str | None
              ) -> tuple[list[LayerProfile], int, list[LayerProfile], int, str]:
    """The layers' profiles at one sample and at a whole replica's micro-batch, read from `folder`
    when measured there for the same model, data, precision and device, else measured (and kept)."""
    key = _profile_key(cfg, device)
    kept = _read(folder, "profile.json")
    if kept is not None and kept.get("key") == key:
        return ([LayerProfile(**p) for p in kept["low"]], kept["b_low"], [LayerProfile(**p) for p in kept["high"]],
                kept["b_high"], key)
    from pipeflow.run.layer_profiles import profile_sizes

    sizes = sorted({1, max(1, int(cfg.data.batch_size) // int(cfg.pipeline.num_microbatches))})
    low, b_low, high, b_high = profile_sizes(cfg, sizes, device)
    _write(folder, "profile.json", {"key": key, "b_low": b_low, "b_high": b_high,
                                    "low": [dataclasses.asdict(p) for p in low],
                                    "high": [dataclasses.asdict(p) for p in high]})
    return low, b_low, high, b_high, key


def _interpolated(low: Sequence[LayerProfile], b_low: int, high: Sequence[LayerProfile], b_high: int) -> Any:
    from pipeflow.run.layer_profiles import interpolate

    return interpolate(low, b_low, high, b_high)


def _profile_key(cfg: DictConfig, device: torch.device) -> str:
    """What the kept profile was measured for: the model, the data, the dtypes and the device."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = json.dumps([OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.data, resolve=True),
                       str(cfg.train.param_dtype), str(cfg.train.precision), device.type, name,
                       str(cfg.schedule.name), int(cfg.pipeline.num_microbatches)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _memory_limit(cfg: DictConfig, device: torch.device) -> float | None:
    """Bytes per rank: ``plan.memory_limit_gb``, else on a GPU the share the run plans for."""
    if cfg.plan.memory_limit_gb is not None:
        return float(cfg.plan.memory_limit_gb) * 1e9
    from pipeflow.runtime.memory import device_memory_limit

    return device_memory_limit(device)


def _local_ranks(world: int) -> int:
    """The ranks of a host (torchrun's LOCAL_WORLD_SIZE; the world on one host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _where() -> str:
    """`` (2 hosts x 2 ranks)`` where the host table has several hosts."""
    rows = hosts.table().hosts
    if len(rows) < 2:
        return ""
    sizes = {len(r[2]) for r in rows}
    if len(sizes) > 1:
        return f" ({len(rows)} hosts)"
    each = sizes.pop()
    return f" ({len(rows)} hosts x {each} rank{'s' if each > 1 else ''})"


def _read(folder: str | None, name: str) -> dict | None:
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(folder: str | None, name: str, value: dict) -> None:
    """Write `value` atomically (a crash mid-write leaves the old file)."""
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    write_atomic(os.path.join(folder, name), json.dumps(value))
