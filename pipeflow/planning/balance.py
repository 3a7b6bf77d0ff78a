"""Optimal contiguous balancing: split per-layer costs into stages that minimise the bottleneck.

Pure numbers, no torch.  Index letters as in `partition.py`: L = layers, S = stages, s = a stage;
a stage holding layers i..j-1 is the segment [i, j).

A stage's cost is ``math.fsum`` of its layers' costs (correctly rounded, so it does not depend
on the order of summation), and the bottleneck is the largest stage cost.  Both balancers are
exact: a dynamic programme over (stage, first layer) finds the least bottleneck B*, and then,
among all splits whose every stage costs at most B*, the one with the least sum of squared stage
costs (the most even one); any tie left is broken toward the lexicographically smallest split
points.  Time O(S * L^2), plus O(L^3) float additions (in C) to tabulate the segment sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from pipeflow.errors import PartitionError

if TYPE_CHECKING:  # profiles are only read here; importing them at run time would pull in torch
    from pipeflow.planning.profile import LayerProfile

SegmentCost = Callable[[int, int, int], float]  # (stage s, first layer i, stop j) -> cost


def balance_contiguous(costs: Sequence[float], num_stages: int) -> list[range]:
    """Split layers 0..L-1 into S non-empty contiguous stages minimising the largest stage cost.

    Args:
        costs: ``costs[i]``, the cost of layer i (time, parameters, bytes...): finite, >= 0.
        num_stages: S, with 1 <= S <= L.

    Returns:
        S ranges covering 0..L-1 in order; ties broken as the module docstring says.

    Raises:
        PartitionError: no layers, S < 1, S > L, or a negative / non-finite cost (the message
            gives the offending values).
    """
    _check_inputs("costs", costs, num_stages)
    seg = _segment_sums(costs)
    return _optimal_split(len(costs), num_stages, lambda s, i, j: seg[i][j - i - 1])


def balance_by_memory(
    param_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    num_stages: int,
    inflight: Sequence[int],
    optimizer_factor: float = 2.0,
) -> list[range]:
    """Split layers into S stages minimising the largest estimated stage memory.

    Stage s costs ``stage_memory(P, A, inflight[s], optimizer_factor)`` where P and A are the
    sums of its layers' parameter and activation bytes: see `stage_memory`.

    Args:
        param_bytes: ``param_bytes[i]``, bytes of layer i's parameters.
        activation_bytes: ``activation_bytes[i]``, bytes layer i keeps per micro-batch.
        num_stages: S.
        inflight: ``inflight[s]``, micro-batches whose activations stage s holds at its peak
            (1F1B with m >= S: ``S - s``; GPipe: m); see `default_inflight`.
        optimizer_factor: optimizer state per parameter byte (2.0 for Adam's two moments).

    Returns:
        S ranges covering 0..L-1 in order, ties broken as the module docstring says.

    Raises:
        PartitionError: mismatched lengths, bad counts, negative or non-finite values.
    """
    _check_inputs("param_bytes", param_bytes, num_stages)
    _check_inputs("activation_bytes", activation_bytes, num_stages)
    if len(param_bytes) != len(activation_bytes):
        raise PartitionError(
            f"got {len(param_bytes)} param_bytes but {len(activation_bytes)} activation_bytes; "
            "give one of each per layer"
        )
    _check_inflight(inflight, num_stages, optimizer_factor)
    seg_p, seg_a = _segment_sums(param_bytes), _segment_sums(activation_bytes)

    def cost(s: int, i: int, j: int) -> float:
        k = j - i - 1
        return stage_memory(seg_p[i][k], seg_a[i][k], inflight[s], optimizer_factor)

    return _optimal_split(len(param_bytes), num_stages, cost)


def stage_memory(
    param_bytes: float, activation_bytes: float, inflight: int, optimizer_factor: float = 2.0
) -> float:
    """The memory model: weights, grads and optimizer state, plus the activations held.

    Args:
        param_bytes: bytes of the stage's parameters.
        activation_bytes: bytes the stage keeps per micro-batch until its backward.
        inflight: micro-batches the schedule makes the stage hold at once.
        optimizer_factor: optimizer state bytes per parameter byte.

    Returns:
        ``param_bytes * (1 + 1 + optimizer_factor) + activation_bytes * inflight``.
    """
    return param_bytes * (2.0 + optimizer_factor) + activation_bytes * inflight


def default_inflight(num_stages: int, num_microbatches: int | None = None) -> list[int]:
    """Peak micro-batches held per stage under 1F1B with one stage per rank: ``min(S - s, m)``.

    Args:
        num_stages: S.
        num_microbatches: m; None means m >= S.

    Returns:
        ``inflight[s]`` for s = 0..S-1.
    """
    m = num_stages if num_microbatches is None else num_microbatches
    return [min(num_stages - s, m) for s in range(num_stages)]


def balance_profiles(
    profiles: Sequence[LayerProfile],
    method: str,
    num_stages: int,
    inflight: Sequence[int] | None = None,
    optimizer_factor: float = 2.0,
) -> list[range]:
    """Balance measured layers by ``params``, ``time`` (forward + backward) or ``memory``.

    Args:
        profiles: per-layer profiles (`pipeflow.planning.profile.profile_layers`).
        method: "params", "time" or "memory".
        num_stages: S.
        inflight: for memory, micro-batches stage s holds; default `default_inflight(S)`.
        optimizer_factor: for memory, optimizer state bytes per parameter byte.

    Returns:
        S ranges covering every layer once.

    Raises:
        PartitionError: an unknown method, or what the balancers raise.
    """
    if method == "params":
        return balance_contiguous([p.params for p in profiles], num_stages)
    if method == "time":
        return balance_contiguous([p.seconds for p in profiles], num_stages)
    if method != "memory":
        raise PartitionError(f"cannot balance profiles by {method!r}; use params, time or memory")
    inflight = default_inflight(num_stages) if inflight is None else inflight
    return balance_by_memory(
        [p.param_bytes for p in profiles], [p.activation_bytes for p in profiles],
        num_stages, inflight, optimizer_factor,
    )


@dataclass(frozen=True)
class StageEstimate:
    """What one stage is predicted to cost: parameters, seconds per micro-batch, memory bytes."""

    params: int
    seconds: float
    memory_bytes: float


def estimate_stages(
    ranges: Sequence[range],
    profiles: Sequence[LayerProfile],
    inflight: Sequence[int] | None = None,
    optimizer_factor: float = 2.0,
) -> list[StageEstimate]:
    """Sum the profiles of each stage's layers; memory by `stage_memory`.

    Args:
        ranges: the stages' layer ranges.
        profiles: per-layer profiles.
        inflight: micro-batches stage s holds; default `default_inflight(S)`.
        optimizer_factor: optimizer state bytes per parameter byte.

    Returns:
        One `StageEstimate` per stage (seconds = forward + backward of one micro-batch).
    """
    inflight = default_inflight(len(ranges)) if inflight is None else inflight
    estimates = []
    for s, r in enumerate(ranges):
        param_bytes = sum(profiles[i].param_bytes for i in r)
        activation_bytes = sum(profiles[i].activation_bytes for i in r)
        estimates.append(StageEstimate(
            params=sum(profiles[i].params for i in r),
            seconds=math.fsum(profiles[i].seconds for i in r),
            memory_bytes=stage_memory(param_bytes, activation_bytes, inflight[s], optimizer_factor),
        ))
    return estimates


def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Raise PartitionError unless 1 <= S <= L: every stage needs at least one layer."""
    if num_stages < 1:
        raise PartitionError(f"the pipeline has {num_stages} stages; it needs at least 1")
    if num_stages > num_layers:
        raise PartitionError(
            f"the pipeline has {num_stages} stages but the model has only {num_layers} layers: "
            f"every stage needs at least one layer; use at most {num_layers} stages"
        )


def _check_inputs(what: str, costs: Sequence[float], num_stages: int) -> None:
    """Raise PartitionError unless 1 <= S <= L and every cost is finite and >= 0."""
    num_layers = len(costs)
    if num_layers < 1:
        raise PartitionError(f"{what} is empty: the model needs at least 1 layer")
    check_stage_count(num_layers, num_stages)
    bad = {i: c for i, c in enumerate(costs) if not (math.isfinite(c) and c >= 0)}
    if bad:
        raise PartitionError(
            f"{what} must be finite and >= 0; bad values (layer: value): {bad}"
        )


def _check_inflight(inflight: Sequence[int], num_stages: int, optimizer_factor: float) -> None:
    """Raise PartitionError unless there is one non-negative in-flight count per stage."""
    if len(inflight) != num_stages:
        raise PartitionError(
            f"inflight={list(inflight)} has {len(inflight)} entries for {num_stages} stages; "
            "give one per stage"
        )
    if any(n < 0 for n in inflight):
        raise PartitionError(f"inflight={list(inflight)} must be >= 0 for every stage")
    if not (math.isfinite(optimizer_factor) and optimizer_factor >= 0):
        raise PartitionError(f"optimizer_factor={optimizer_factor} must be finite and >= 0")


def _segment_sums(costs: Sequence[float]) -> list[list[float]]:
    """``seg[i][k] = fsum(costs[i : i + k + 1])``: the cost of every segment, correctly rounded."""
    values = [float(c) for c in costs]
    return [
        [math.fsum(values[i:j]) for j in range(i + 1, len(values) + 1)]
        for i in range(len(values))
    ]


def _optimal_split(num_layers: int, num_stages: int, cost: SegmentCost) -> list[range]:
    """Least bottleneck, then least sum of squares under it, then smallest split points."""
    bottleneck = _least_bottleneck(num_layers, num_stages, cost)
    # sq[k][i]: least sum of squares splitting layers i..L-1 into the last k stages, each stage
    # costing <= bottleneck (inf if impossible).  Stage of a segment: s = S - k.
    inf = math.inf
    sq = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    sq[0][num_layers] = 0.0
    for k in range(1, num_stages + 1):
        s = num_stages - k
        for i in range(s, num_layers - k + 1):  # s layers before, k layers at least after
            fits = _fits(i, num_layers - k + 2, s, cost, bottleneck)
            sq[k][i] = min((c * c + sq[k - 1][j] for j, c in fits), default=inf)
    return _walk(num_layers, num_stages, cost, bottleneck, sq)


def _fits(
    i: int, stop: int, s: int, cost: SegmentCost, bottleneck: float
) -> list[tuple[int, float]]:
    """(j, cost) for every segment [i, j) with j < stop that stage s can hold within bottleneck."""
    return [(j, c) for j in range(i + 1, stop) if (c := cost(s, i, j)) <= bottleneck]


def _walk(
    num_layers: int, num_stages: int, cost: SegmentCost, bottleneck: float, sq: list[list[float]]
) -> list[range]:
    """Rebuild the split from the table, taking the first (smallest) optimal end at each stage."""
    ranges, i = [], 0
    for s in range(num_stages):
        k = num_stages - s
        target = sq[k][i]
        for j, c in _fits(i, num_layers - k + 2, s, cost, bottleneck):
            if c * c + sq[k - 1][j] == target:
                ranges.append(range(i, j))
                i = j
                break
    return ranges


def _least_bottleneck(num_layers: int, num_stages: int, cost: SegmentCost) -> float:
    """B*: the least, over all splits, of the largest stage cost (exact: max and min round not)."""
    # best[i]: least bottleneck of layers i..L-1 as the last k stages; inf where impossible.
    best = [math.inf] * num_layers + [0.0]
    for k in range(1, num_stages + 1):
        s = num_stages - k
        new = [math.inf] * (num_layers + 1)
        for i in range(s, num_layers - k + 1):
            new[i] = min(
                max(cost(s, i, j), best[j]) for j in range(i + 1, num_layers - k + 2)
            )
        best = new
    return best[0]
