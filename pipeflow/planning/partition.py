"""Turning an ordered list of layers into pipeline stages: contiguous, complete, non-empty ranges.

Index letters: L = number of layers, S = number of stages, s = a stage.
A split point is the index of the first layer of stage s, for s = 1 .. S-1 (so S-1 of them).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from pipeflow.planning.balance import balance_contiguous, balance_profiles, check_stage_count, estimate_stages
from pipeflow.errors import PartitionError
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.profile import LayerProfile, count_layer_params, profile_layers

SplitPoint = int | str
BALANCE_METHODS = ("uniform", "params", "time", "memory")


def partition_layers(
    num_layers: int,
    num_stages: int,
    split_points: Sequence[SplitPoint] | None = None,
    names: Sequence[str] | None = None,
) -> list[range]:
    """Split layers 0..L-1 into S contiguous stages covering every layer exactly once.

    Without split points the split is uniform: every stage gets L // S layers and the
    L % S extra layers go one each to stages 1, 2, ..., never to stage 0, which also carries
    the input data (and, in a GPT, the embedding); the last stage, which carries the head and
    the loss, gets one only when every stage between them already has one.
    E.g. L=10, S=4 -> sizes [2, 3, 3, 2].  No layer is ever dropped (cf. Megatron-LM#1304).

    Args:
        num_layers: L, the number of layers (>= 1).
        num_stages: S, the number of stages (1 <= S <= L).
        split_points: optional S-1 strictly increasing first-layer indices of stages 1..S-1,
            each in [1, L-1]; an entry may be a layer name when `names` is given.
        names: the layer names, needed to resolve split points given as names.

    Returns:
        S ranges, stage s holding layers ``ranges[s]``.

    Raises:
        PartitionError: bad counts, more stages than layers, or bad split points (the message
            gives the offending values and how to fix them).
    """
    _check_counts(num_layers, num_stages, names)
    if split_points is None:
        ranges = _uniform(num_layers, num_stages)
    else:
        points = _resolve_names(split_points, names)
        _check_split_points(points, num_layers, num_stages)
        bounds = [0, *points, num_layers]
        ranges = [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
    check_coverage(ranges, num_layers)
    return ranges


def _check_counts(num_layers: int, num_stages: int, names: Sequence[str] | None) -> None:
    """Raise PartitionError unless 1 <= S <= L (and len(names) == L when names are given)."""
    if num_layers < 1:
        raise PartitionError(f"the model has {num_layers} layers; it needs at least 1")
    check_stage_count(num_layers, num_stages)
    if names is not None and len(names) != num_layers:
        raise PartitionError(f"got {len(names)} layer names for {num_layers} layers")


def _uniform(num_layers: int, num_stages: int) -> list[range]:
    """Sizes differ by at most one; extra layers go to stages 1, 2, ... (see partition_layers)."""
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 <= s <= extra) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _resolve_names(points: Sequence[SplitPoint], names: Sequence[str] | None) -> list[int]:
    """Turn split points given as layer names into indices; integers pass through."""
    resolved = []
    for point in points:
        if isinstance(point, str):
            if names is None:
                raise PartitionError(
                    f"split point {point!r} is a layer name, but no layer names were given; "
                    "pass names= or give split points as layer indices"
                )
            if point not in names:
                raise PartitionError(
                    f"split point {point!r} is not a layer name; valid names: {list(names)}"
                )
            resolved.append(list(names).index(point))
        elif isinstance(point, bool) or not isinstance(point, int):
            raise PartitionError(
                f"split point {point!r} must be a layer index (int) or a layer name (str)"
            )
        else:
            resolved.append(point)
    return resolved


def _check_split_points(points: list[int], num_layers: int, num_stages: int) -> None:
    """Raise PartitionError on a wrong count, an out-of-range point, or a non-increasing pair."""
    if len(points) != num_stages - 1:
        raise PartitionError(
            f"split_points={points} gives {len(points) + 1} stages but the pipeline has "
            f"{num_stages} stages (split points needed: {num_stages - 1}, the index of the "
            "first layer of each stage after the first)"
        )
    bad = [p for p in points if not 1 <= p <= num_layers - 1]
    if bad:
        raise PartitionError(
            f"split_points={points}: {bad} out of range; with {num_layers} layers each split "
            f"point must be in [1, {num_layers - 1}] (the first layer of a stage after the first)"
        )
    for s, (a, b) in enumerate(zip(points, points[1:]), start=1):
        if a == b:
            raise PartitionError(
                f"split_points={points}: {a} appears twice, so stage {s} would be empty; "
                "split points must be strictly increasing"
            )
        if a > b:
            raise PartitionError(
                f"split_points={points} are not increasing ({a} then {b}); "
                f"sort them: {sorted(points)}"
            )


def check_coverage(ranges: Sequence[range], num_layers: int) -> None:
    """Assert that `ranges` are non-empty, contiguous and cover layers 0..L-1 exactly once.

    Args:
        ranges: the stages' layer ranges, in stage order.
        num_layers: L.

    Raises:
        PartitionError: a stage is empty, a layer is missing or duplicated, or a range has a step.
    """
    expected = 0
    for s, r in enumerate(ranges):
        if r.step != 1 or len(r) == 0 or r.start != expected:
            raise PartitionError(
                f"stage {s} holds {r} but should start at layer {expected} and be non-empty "
                f"(stages: {[(x.start, x.stop) for x in ranges]}, {num_layers} layers)"
            )
        expected = r.stop
    if expected != num_layers:
        raise PartitionError(
            f"stages cover layers 0..{expected - 1} but the model has {num_layers} layers"
        )


def plan_partition(
    model: ModelSpec | Sequence[LayerProfile],
    num_stages: int,
    method: str = "uniform",
    split_points: Sequence[SplitPoint] | None = None,
    *,
    sample_input: Any = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    inflight: Sequence[int] | None = None,
    optimizer_factor: float = 2.0,
) -> list[range]:
    """Choose the stages as ``pipeline.balance=method`` says; explicit `split_points` always win.

    - ``uniform``: layer counts differ by at most one (`partition_layers`).
    - ``params``: balance parameter counts (`count_layer_params`: one layer built at a time).
    - ``time``: balance forward + backward time measured by `profile_layers`.
    - ``memory``: balance `pipeflow.planning.balance.stage_memory` (params, grads, optimizer state and
      ``inflight[s]`` micro-batches of activations).
    Balanced splits are optimal for the bottleneck (`pipeflow.planning.balance`).  Measure once and pass
    the profiles as `model` to reuse them (and, on many ranks, so that all ranks agree).

    Args:
        model: the model, or its per-layer profiles (from `profile_layers`).
        num_stages: S.
        method: one of `BALANCE_METHODS`.
        split_points: as in `partition_layers`; when given, `method` is ignored.
        sample_input: one micro-batch's first-layer input, to profile for time and memory.
        device: where to profile (default CPU).
        dtype: floating dtype to profile in (default float32).
        inflight: micro-batches stage s holds (memory); default 1F1B, ``S - s``.
        optimizer_factor: optimizer state bytes per parameter byte (memory).

    Returns:
        S ranges covering every layer exactly once.

    Raises:
        PartitionError: unknown method, no sample input to profile, or bad counts / split points.
    """
    names = model.layer_names() if isinstance(model, ModelSpec) else [p.name for p in model]
    if method not in BALANCE_METHODS:
        raise PartitionError(
            f"pipeline.balance={method!r} is not a balance method; use one of {BALANCE_METHODS}"
        )
    if split_points is not None or method == "uniform":
        return partition_layers(len(names), num_stages, split_points, names)
    if method == "params" and isinstance(model, ModelSpec):
        ranges = balance_contiguous(count_layer_params(model), num_stages)
    else:
        profiles = _profiles(model, method, sample_input, device, dtype)
        ranges = balance_profiles(profiles, method, num_stages, inflight, optimizer_factor)
    check_coverage(ranges, len(names))
    return ranges


def _profiles(
    model: ModelSpec | Sequence[LayerProfile], method: str, sample_input: Any,
    device: torch.device | str | None, dtype: torch.dtype | None,
) -> Sequence[LayerProfile]:
    """The given profiles, or the model profiled on `sample_input`."""
    if not isinstance(model, ModelSpec):
        return model
    if sample_input is None:
        raise PartitionError(
            f"pipeline.balance={method} measures the layers and needs a sample input (one "
            "micro-batch for the first layer), or profiles from profile_layers"
        )
    return profile_layers(model, sample_input, device, dtype)


def _rank_of(stage: int, stage_to_rank: Sequence[int] | Mapping[int, int] | None) -> str:
    """The rank column for `stage`: '-' when no mapping is given."""
    if stage_to_rank is None:
        return "-"
    if isinstance(stage_to_rank, Mapping):
        return str(stage_to_rank.get(stage, "-"))
    return str(stage_to_rank[stage]) if stage < len(stage_to_rank) else "-"


def _span(r: range, layer_names: Sequence[str]) -> str:
    """``first..last`` layer names of a stage (one name for one layer, '-' for none)."""
    if len(r) == 0:
        return "-"
    if len(r) == 1:
        return layer_names[r.start]
    return f"{layer_names[r.start]}..{layer_names[r[-1]]}"


def _estimates(
    ranges: Sequence[range], layer_params: Sequence[int] | None,
    profiles: Sequence[LayerProfile] | None, inflight: Sequence[int] | None,
    optimizer_factor: float,
) -> tuple[list[str], list[list[str]]]:
    """Extra column headers and per-stage cells: parameters, time (ms), memory (MB)."""
    if profiles is not None:
        est = estimate_stages(ranges, profiles, inflight, optimizer_factor)
        cells = [[f"{e.params:,}", f"{1e3 * e.seconds:.3f}", f"{e.memory_bytes / 1e6:.2f}"]
                 for e in est]
        return ["parameters", "fwd+bwd (ms)", "memory (MB)"], cells
    if layer_params is not None:
        return ["parameters"], [[f"{sum(layer_params[i] for i in r):,}"] for r in ranges]
    return [], [[] for _ in ranges]


def format_partition(
    ranges: Sequence[range],
    layer_names: Sequence[str],
    stage_to_rank: Sequence[int] | Mapping[int, int] | None = None,
    *,
    layer_params: Sequence[int] | None = None,
    profiles: Sequence[LayerProfile] | None = None,
    inflight: Sequence[int] | None = None,
    optimizer_factor: float = 2.0,
    bubble: float | None = None,
) -> str:
    """Render a partition as a text table: stage | rank | layers (first..last) | count [| ...].

    With `layer_params` or `profiles` a ``parameters`` column follows; with `profiles` also
    ``fwd+bwd (ms)`` (per micro-batch) and ``memory (MB)`` (`pipeflow.planning.balance.stage_memory`,
    1 MB = 10^6 bytes).

    Args:
        ranges: the stages' layer ranges.
        layer_names: the names of all layers.
        stage_to_rank: the rank of each stage (list indexed by stage, or a mapping); '-' if None.
        layer_params: parameter count of each layer (ignored when `profiles` are given).
        profiles: per-layer profiles from `profile_layers`.
        inflight: micro-batches each stage holds, for memory; default 1F1B, ``S - s``.
        optimizer_factor: optimizer state bytes per parameter byte, for memory.
        bubble: the predicted bubble fraction; adds a last line ``predicted bubble: x%``.

    Returns:
        The table, one header line, one rule line and one line per stage (no trailing newline).
    """
    heads, extra = _estimates(ranges, layer_params, profiles, inflight, optimizer_factor)
    rows = [("stage", "rank", "layers", "count", *heads)]
    for s, r in enumerate(ranges):
        span = _span(r, layer_names)
        rows.append((str(s), _rank_of(s, stage_to_rank), span, str(len(r)), *extra[s]))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    if bubble is not None:
        lines.append(f"predicted bubble: {bubble:.1%}")
    return "\n".join(lines)
