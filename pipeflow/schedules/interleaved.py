"""Megatron's interleaved order, for any micro-batch count: which forward and which backward a
rank runs k-th, given v chunks per rank on the loop placement (stage c p + r is rank r's chunk c).

Micro-batches go through the chunks in *groups*: every micro-batch of a group through chunk 0,
then through chunk 1, ...; backwards walk the chunks in reverse.  Megatron uses groups of p, so
m must be a multiple of p.  Like torch.distributed.pipelining's flexible interleaving, other
counts use ``max(1, m // p)`` groups (so m < p is one group of m); where m does not divide
evenly, the first ``m % groups`` groups take one micro-batch more (larger groups first keep every
backward's forward inside the warm-up).  Pure functions, no torch.
"""
from __future__ import annotations

from pipeflow.schedules.ir import FORWARD, Action


def group_sizes(num_ranks: int, num_microbatches: int) -> list[int]:
    """The micro-batch groups' sizes, larger first: p each when p divides m, else
    ``max(1, m // p)`` groups as even as possible (torch's flexible interleaving where it divides)."""
    p, m = num_ranks, num_microbatches
    if m % p == 0:
        return [p] * (m // p)
    groups = max(1, m // p)
    return [m // groups + (1 if j < m % groups else 0) for j in range(groups)]


def interleaved_order(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int, rank: int) -> list[Action]:
    """Rank r's forwards (kind F) or backwards (kind B) in Megatron's interleaved order."""
    p, v = num_ranks, stages_per_rank
    chunks = range(v) if kind == FORWARD else range(v - 1, -1, -1)
    order, first = [], 0
    for size in group_sizes(p, num_microbatches):
        for c in chunks:
            order += [Action(kind, i, c * p + rank) for i in range(first, first + size)]
        first += size
    return order


def one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then alternate the next forward and the next backward, then drain."""
    acts = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        acts += [forwards[warmup + k], backwards[k]]
    return acts + backwards[len(forwards) - warmup :]

