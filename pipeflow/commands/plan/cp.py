"""The planner's context-parallel degrees (``plan.cp_sizes``, ``parallel.cp``) and the ring's price.

Each degree is planned on its own profile: the layers run as one cp rank runs them (its share of
each row, attention round a loopback ring that logs every pass), and the ring's passes are
priced on the link between a stage's cp ranks (``plan.tp_bandwidth_gbps``, ``plan.tp_latency_us``:
a node's), less the attention compute they hide behind (`pipeflow.planning.costs.context`).
With ``plan.cp_sizes`` null the planner plans ``parallel.cp`` and, where nothing fits
``plan.memory_limit_gb``, doubles cp while 2 x cp divides ``data.seq_len``: a sequence whose
activations do not fit a rank is answered with the cp that makes them fit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from pipeflow.errors import ConfigError
from pipeflow.planning.costs.context import ring_profiles
from pipeflow.planning.profile import LayerProfile
from pipeflow.planning.search import PlanResult
from pipeflow.planning.costs.tensor import TensorLink
from pipeflow.config.checks import check_context_parallel
from pipeflow.commands.plan.tp import tp_link_figures

MAX_DOUBLED_CP = 64  # plan.cp_sizes=null doubles cp up to this while nothing fits


def context_degree(cfg: DictConfig) -> int:
    """``parallel.cp`` (1 where unset)."""
    return int(OmegaConf.select(cfg, "parallel.cp", default=1) or 1)


def checked_degree(cfg: DictConfig, cp: int) -> None:
    """What a run with ``parallel.cp=cp`` would refuse, refused for the plan (by the same check).

    Raises:
        ConfigError: 2 x cp does not divide ``data.seq_len``, or cp with what it does not run with.
    """
    if cp < 1:
        raise ConfigError(f"plan.cp_sizes has {cp}: every size must be at least 1")
    trial = OmegaConf.merge(cfg, {"parallel": {"cp": cp}})
    check_context_parallel(trial)


def ring_link(cfg: DictConfig) -> TensorLink:
    """The link the ring's passes are priced on: the tp link's figures (a node's)."""
    gbps, us = tp_link_figures(cfg)
    return TensorLink(gbps * 1e9, us * 1e-6)


def ring_pricing(cfg: DictConfig, cp: int) -> tuple[Callable[[Sequence[LayerProfile]], list[LayerProfile]] | None, str]:
    """What prices the ring's passes on a cp rank's (tp-split) profiles, and a phrase for the
    report (None and "" at cp = 1)."""
    if cp <= 1:
        return None, ""
    link = ring_link(cfg)
    return (lambda profiles: ring_profiles(profiles, link)), (
        f", as one of cp {cp} ranks (data.seq_len / {cp} of each row; the ring's passes at "
        f"{link.bandwidth_Bps / 1e9:g} GB/s + {1e6 * link.latency_s:g} us each, less the attention they hide behind)")


def search_cp(cfg: DictConfig, plan_one: Callable[[int], tuple[PlanResult, str]], limit: float | None
              ) -> tuple[PlanResult, str]:
    """Plan every cp degree (``plan.cp_sizes``), or ``parallel.cp`` doubled while nothing fits
    `limit`; `plan_one(cp)` plans one degree.  The results merged fastest first, and the report's
    phrase (the last degree's, with the degrees tried).

    Raises:
        ConfigError: a degree a run would refuse (:func:`checked_degree`).
    """
    listed = cfg.plan.cp_sizes
    degrees = sorted({int(c) for c in listed}) if listed else [context_degree(cfg)]
    for cp in degrees:
        checked_degree(cfg, cp)
    merged, phrase, tried = PlanResult(), "", []
    while degrees:
        cp = degrees.pop(0)
        result, phrase = plan_one(cp)
        tried.append(cp)
        merged.candidates += [dataclasses.replace(c, cp=cp) for c in result.candidates]
        merged.over_memory += [dataclasses.replace(c, cp=cp) for c in result.over_memory]
        for reason, n in result.skipped.items():
            merged.skipped[reason] = merged.skipped.get(reason, 0) + n
        if not listed and not merged.candidates and limit is not None and _doubles(cfg, 2 * cp):
            degrees.append(2 * cp)  # nothing fits: a rank's share of the sequence halved
    merged.candidates.sort(key=lambda c: c.step_s)
    if len(tried) > 1:
        how = "plan.cp_sizes" if listed else "nothing fit the memory limit below the last"
        phrase += f"; cp {', '.join(map(str, tried))} planned ({how})"
    return merged, phrase


def _doubles(cfg: DictConfig, cp: int) -> bool:
    """Whether cp may double to `cp`: within :data:`MAX_DOUBLED_CP` and a degree a run takes."""
    if cp > MAX_DOUBLED_CP:
        return False
    try:
        checked_degree(cfg, cp)
    except ConfigError:
        return False
    return True
