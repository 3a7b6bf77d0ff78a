"""Per-rank figures of a step from its timed events: compute, comm-wait, idle time and bubbles.

Pure arithmetic on ``TimedEvent``-like records (kind, name, start, end), shared by the metrics
of every step and the traces of chosen steps.  Definitions (r = a pipeline rank):

    compute_r   time in F / B / W actions
    comm_r      time in batched calls, post to completion (waiting on peers included), and in
                the gathers and reductions of sharded stages (``shard`` events)
    idle_r      the rest of the training step (gaps between actions, grad clipping, optimizer)
    a2a_r       time in the MoE layers' all_to_alls (``a2a`` events, parallel.ep), within its
                F / B / W actions: part of compute_r, shown apart
    span_r      first to last event of the rank's pipeline program (the simulator's makespan
                counts only the program, not the optimizer)
    bubble_r    1 - compute_r / span_r
    bubble      1 - sum_r compute_r / (p * max_r span_r), as ``SimResult.bubble``
    wait_l      per link l (two pipeline ranks): the transfer waits of its two ranks on each
                other (a wait on several peers split evenly), :func:`wait_by_link`
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from pipeflow.runtime.events import A2A, COPY_KINDS, SHARD
from pipeflow.schedules.ir import KINDS

# batched P2P calls; gathers and reductions (parallel.shard=full); activation copies issued (pipeline.offload)
COMM_KINDS = ("comm", SHARD, *COPY_KINDS)


@dataclass
class RankFigures:
    """Seconds one rank spent in one step (or summed over several steps)."""

    compute_s: float = 0.0
    comm_wait_s: float = 0.0
    idle_s: float = 0.0
    step_s: float = 0.0
    span_s: float = 0.0
    all_to_all_s: float = 0.0

    def __iadd__(self, other: RankFigures) -> RankFigures:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


def step_figures(events: Sequence[Any], step_start: float, step_end: float) -> RankFigures:
    """Compute, comm-wait, idle and all_to_all time of one rank's step from its ``TimedEvent``s.

    Idle time is the part of [step_start, step_end] that no event covers.
    """
    compute = sum(e.end - e.start for e in events if e.kind in KINDS)
    a2a = sum(e.end - e.start for e in events if e.kind == A2A)
    comm = sum(e.end - e.start for e in events if e.kind in COMM_KINDS)
    idle, cursor = 0.0, step_start
    for e in sorted(events, key=lambda e: e.start):
        idle += max(0.0, e.start - cursor)
        cursor = max(cursor, e.end)
    idle += max(0.0, step_end - cursor)
    span = max(e.end for e in events) - min(e.start for e in events) if events else 0.0
    return RankFigures(compute, comm, idle, step_end - step_start, span, a2a)


def rank_bubble(compute_s: float, span_s: float) -> float:
    """Idle fraction of one rank's pipeline program, ``1 - compute / span``."""
    return min(1.0, max(0.0, 1.0 - compute_s / span_s)) if span_s > 0 else 0.0


def pipeline_bubble(compute_s: Sequence[float], span_s: Sequence[float]) -> float:
    """Idle fraction of the pipeline, ``1 - sum(compute) / (p * max(span))`` (as the simulator)."""
    longest = max(span_s, default=0.0)
    return min(1.0, max(0.0, 1.0 - sum(compute_s) / (len(span_s) * longest))) if longest > 0 else 0.0


_PEER = re.compile(r"r(\d+)(?:;|$)")  # CommOp's text ends with its peer's pipeline rank: "...]<-r0"


def wait_by_link(events: Sequence[Any], pp_rank: int) -> dict[tuple[int, int], float]:
    """Seconds this rank waited on each of its links in a step, ``{(lower, higher pipeline rank):
    s}``: each transfer wait (its ops' text names their peers) split evenly over the peers it
    waited on."""
    out: dict[tuple[int, int], float] = {}
    for e in events:
        if e.kind != "comm":
            continue
        peers = {int(p) for p in _PEER.findall(e.name)} - {pp_rank}
        for peer in peers:
            link = (min(pp_rank, peer), max(pp_rank, peer))
            out[link] = out.get(link, 0.0) + (e.end - e.start) / len(peers)
    return out

