"""The planner's tensor-parallel degrees: which it searches (``plan.tp_sizes``), the link their
collectives are costed over (``plan.tp_bandwidth_gbps``, ``plan.tp_latency_us``), and one search
per degree on the layers' costs as one tp rank runs them, merged into one ranking."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from omegaconf import DictConfig

from pipeflow.errors import ConfigError
from pipeflow.planning.search import CostModel, PlanResult, search
from pipeflow.config.schema import tensor_degree


def tp_degrees(cfg: DictConfig) -> list[int]:
    """The tensor-parallel degrees the planner searches: ``plan.tp_sizes``, else ``parallel.tp``."""
    degrees = [int(t) for t in (cfg.plan.tp_sizes or [tensor_degree(cfg.parallel)])]
    if any(t < 1 for t in degrees):
        raise ConfigError(f"plan.tp_sizes={degrees}: every size must be at least 1")
    return sorted(set(degrees))


def tp_link_figures(cfg: DictConfig) -> tuple[float, float]:
    """(GB/s, us) tp's collectives are costed at: the ``plan.tp_*`` keys, else an NVLink-class node's."""
    gbps, us = cfg.plan.tp_bandwidth_gbps, cfg.plan.tp_latency_us
    return (150.0 if gbps is None else float(gbps)), (10.0 if us is None else float(us))


def search_tp(cfg: DictConfig, costs: CostModel, pp: int, batch: int, space: Any, limit: float | None,
              latency: Any, overhead_s: float, model: Any, ring: Callable[[Any], Any] | None = None) -> PlanResult:
    """:func:`search` once per tensor-parallel degree (:func:`tp_degrees`), each on the layers' costs
    as one tp rank runs them (`pipeflow.planning.costs.tensor`), merged into one ranking.  `ring`
    (``parallel.cp``) prices the cp ring's passes on a tp rank's profiles."""
    from pipeflow.planning.costs.tensor import TensorLink, split_profiles

    gbps, us = tp_link_figures(cfg)
    link = TensorLink(gbps * 1e9, us * 1e-6)
    sp = cfg.parallel.sequence_parallel
    merged = PlanResult()
    for tp in tp_degrees(cfg):
        per_rank = costs if tp == 1 else (lambda b, tp=tp: split_profiles(costs(b), tp, link, sp))
        if ring is not None:
            per_rank = (lambda b, split=per_rank: ring(split(b)))
        got = search(per_rank, pp, batch, dataclasses.replace(space, tp=tp), limit, cfg.plan.optimizer_factor, latency,
                     overhead_s, model)
        merged.candidates += [dataclasses.replace(c, tp=tp) for c in got.candidates]
        merged.over_memory += [dataclasses.replace(c, tp=tp) for c in got.over_memory]
        for reason, n in got.skipped.items():
            merged.skipped[reason] = merged.skipped.get(reason, 0) + n
    merged.candidates.sort(key=lambda c: c.step_s)
    return merged
