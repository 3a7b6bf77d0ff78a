"""Schedules built by the list scheduler (:mod:`~pipeflow.schedules.synthesis`) under a memory
bound: ZB-H2 on the loop placement, and the Controllable Memory paper's V-Half and V-Min on the
V placement (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; "Pipeline Parallelism
with Controllable Memory", NeurIPS 2024).

Memory is counted in (stage, micro-batch) pairs held from F until W, as the simulator does;
"micro-batches of a rank's share" = pairs / stages per rank.  Each generator fixes its bound and
unit costs, so its program depends on (p, m) only.  Pure, no torch.
"""
from __future__ import annotations

import math

from pipeflow.schedules.generators import _check, loop_placement, v_placement
from pipeflow.schedules.ir import PipelineSchedule
from pipeflow.schedules.registry import ClosedForm, register_schedule
from pipeflow.schedules.synthesis import Policy, list_schedule


@register_schedule(
    "zb_h2",
    stages_per_rank=1,
    closed_form=ClosedForm("3m+p-1 (m>=p)", lambda p, m, v: 3 * m + p - 1 if m >= p else None),
)
def zb_h2(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """ZB-H2: zero bubble holding up to 2p micro-batches per rank, loop placement.

    Each rank runs a B as soon as its gradient is there, else an F while it holds fewer than
    2p micro-batches (the extra warm-up forwards fill the start-up bubble), else a pending W
    (the Ws fill the tail).  With F = B = W = 1 the makespan is 3m + p - 1 for m >= p, the loop
    placement's bound (as ZB-H1; unlike it, no W waits behind a B that costs more than it, so
    with B > W it is shorter).  The paper's "zero bubble" for ZB-H2 also moves the optimizer
    step into the next iteration's warm-up, which pipeflow does not do.
    """
    _check(num_ranks, num_microbatches)
    p = num_ranks
    return list_schedule("zb_h2", num_microbatches, loop_placement(p), Policy((2 * p,) * p))


def v_half_limit(num_ranks: int) -> int:
    """V-Half's bound in (stage, micro-batch) pairs per rank: p/2 + 1 micro-batches of a rank's share."""
    return num_ranks + 2


def v_min_limit(num_ranks: int) -> int:
    """V-Min's bound in pairs per rank: ceil(p/3) + 1 micro-batches of a rank's share."""
    return 2 * (math.ceil(num_ranks / 3) + 1)


@register_schedule("v_half", stages_per_rank=2, placements=("v",))
def v_half(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """V-Half: V placement (rank r holds stages r and 2p-1-r), B/W split, at most p/2 + 1
    micro-batches of a rank's share per rank (about half of 1F1B's p), any m >= 1."""
    _check(num_ranks, num_microbatches)
    p = num_ranks
    return list_schedule("v_half", num_microbatches, v_placement(p), Policy((v_half_limit(p),) * p))


@register_schedule("v_min", stages_per_rank=2, placements=("v",))
def v_min(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """V-Min: V placement, B/W split, at most ceil(p/3) + 1 micro-batches of a rank's share per
    rank (about a third of 1F1B's p), any m >= 1."""
    _check(num_ranks, num_microbatches)
    p = num_ranks
    return list_schedule("v_min", num_microbatches, v_placement(p), Policy((v_min_limit(p),) * p))
