"""The planner's expert parallelism (``parallel.ep``): the layers' costs as one ep rank runs them,
its share of the experts' parameters and the MoE layers' all_to_alls
(`pipeflow.planning.costs.expert`) costed on the transfer the planner measured between two local
processes (``plan.comm_latency_ms`` where set: that latency per exchange, no per-byte cost)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from pipeflow.planning.costs.comm import fit_line
from pipeflow.planning.ep_links import link_of
from pipeflow.planning.costs.expert import ExpertLink, expert_layers, expert_profiles
from pipeflow.planning.search import CostModel


def expert_degree(cfg: DictConfig) -> int:
    """``parallel.ep`` (1: no expert parallelism)."""
    return cfg.parallel.ep


def planner_link(costs: CostModel, sizes: Sequence[int], latency: Any, device: torch.device) -> ExpertLink:
    """The ep link for the planner: a line through the transfers it measured (`latency`: seconds
    at micro-batch size b, of the largest layer output), else measured here between two local
    processes at those payloads, or a fixed ``plan.comm_latency_ms`` (a number) as latency alone."""
    low, high = min(sizes), max(sizes)
    payload = [float(max(p.output_bytes for p in costs(b))) for b in (low, high)]
    if callable(latency):
        seconds = [latency(low), latency(high)]
    elif latency:
        return ExpertLink(float("inf"), float(latency))
    else:  # one pipeline rank: nothing was measured
        from pipeflow.planning.costs.comm import measure_exchange_s

        use_cuda = device.type == "cuda" and torch.cuda.device_count() >= 2
        seconds = measure_exchange_s([int(b) for b in payload], use_cuda=use_cuda)
    return link_of(*fit_line(list(zip(payload, seconds))))


def expert_costs(cfg: DictConfig, costs: CostModel, sizes: Sequence[int], latency: Any, device: torch.device
                 ) -> tuple[CostModel, str]:
    """The layers' costs as one of ``parallel.ep`` ranks runs them, and a phrase for the report
    (`costs` and "" without expert parallelism)."""
    ep = expert_degree(cfg)
    if ep <= 1:
        return costs, ""
    layers = expert_layers(instantiate(cfg.model))
    link = planner_link(costs, sizes, latency, device)
    rate = "no per-byte cost" if link.bandwidth_Bps == float("inf") else f"{link.bandwidth_Bps / 1e6:.1f} MB/s"
    return (lambda b: expert_profiles(costs(b), layers, ep, link)), (
        f"; ep {ep}: a rank holds 1/{ep} of the experts, the MoE layers' all_to_alls costed at "
        f"{1e3 * link.latency_s:.3f} ms + {rate}")
