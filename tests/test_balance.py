"""Tests for pipeflow.planning.balance, pipeflow.planning.profile and plan_partition: optimality, errors, profiling."""
from __future__ import annotations

import itertools
import math
import random
import weakref
from typing import Callable, Sequence

import pytest
import torch
from torch import nn

from pipeflow.planning.balance import (
    balance_by_memory,
    balance_contiguous,
    balance_profiles,
    default_inflight,
    estimate_stages,
    stage_memory,
)
from pipeflow.errors import PartitionError
from pipeflow.models import LayerSpec, ModelSpec
from pipeflow.planning.partition import format_partition, partition_layers, plan_partition
from pipeflow.planning.profile import LayerProfile, count_layer_params, profile_layers
from toy_models import build_toy, random_batch

StageCost = Callable[[int, range], float]  # (stage s, its layers) -> cost


def all_splits(num_layers: int, num_stages: int) -> list[list[range]]:
    """Every split of 0..L-1 into S non-empty contiguous stages, in lexicographic order."""
    splits = []
    for points in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = [0, *points, num_layers]
        splits.append([range(bounds[s], bounds[s + 1]) for s in range(num_stages)])
    return splits


def brute_force(num_layers: int, num_stages: int, cost: StageCost) -> list[range]:
    """The documented choice: least bottleneck, then least sum of squares, then first split."""
    def key(split: list[range]) -> tuple[float, float]:
        costs = [cost(s, r) for s, r in enumerate(split)]
        return max(costs), math.fsum(c * c for c in costs)

    return min(all_splits(num_layers, num_stages), key=key)  # min keeps the first of equals


def assert_covers(ranges: Sequence[range], num_layers: int, num_stages: int) -> None:
    assert len(ranges) == num_stages and all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(num_layers))


def random_costs(rng: random.Random, num_layers: int, case: int) -> list[float]:
    """Small integers on even cases (many exact ties), floats over decades on odd cases."""
    if case % 2 == 0:
        return [float(rng.randint(0, 5)) for _ in range(num_layers)]
    return [rng.random() * 10 ** rng.randint(-2, 3) for _ in range(num_layers)]


def test_balance_contiguous_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    for case in range(200):
        num_layers = rng.randint(1, 10)
        num_stages = rng.randint(1, num_layers)
        costs = random_costs(rng, num_layers, case)
        ranges = balance_contiguous(costs, num_stages)
        assert_covers(ranges, num_layers, num_stages)

        def cost(s: int, r: range) -> float:
            return math.fsum(costs[i] for i in r)

        best = brute_force(num_layers, num_stages, cost)
        ours = [cost(s, r) for s, r in enumerate(ranges)]
        assert max(ours) == max(cost(s, r) for s, r in enumerate(best)), (costs, num_stages)
        if case % 2 == 0:  # integers: sums of squares are exact, so the tie-break is exact too
            assert ranges == best, (costs, num_stages)


def test_balance_by_memory_is_optimal_against_brute_force() -> None:
    rng = random.Random(1)
    for case in range(200):
        num_layers = rng.randint(1, 10)
        num_stages = rng.randint(1, num_layers)
        params = random_costs(rng, num_layers, case)
        acts = random_costs(rng, num_layers, case + 1 if case % 4 == 0 else case)
        inflight = [rng.randint(0, num_stages) for _ in range(num_stages)]
        factor = rng.choice([0.0, 1.0, 2.0, 2.5])
        ranges = balance_by_memory(params, acts, num_stages, inflight, factor)
        assert_covers(ranges, num_layers, num_stages)

        def cost(s: int, r: range) -> float:
            p, a = math.fsum(params[i] for i in r), math.fsum(acts[i] for i in r)
            return stage_memory(p, a, inflight[s], factor)

        best = brute_force(num_layers, num_stages, cost)
        ours = max(cost(s, r) for s, r in enumerate(ranges))
        assert ours == max(cost(s, r) for s, r in enumerate(best)), (params, acts, inflight)


def test_tie_break_prefers_the_most_even_split() -> None:
    # Bottleneck 10 either way: [10][1][1 1 1] or [10][1 1][1 1]; the even one wins.
    assert balance_contiguous([10, 1, 1, 1, 1], 3) == [range(0, 1), range(1, 3), range(3, 5)]
    # All splits equal: the lexicographically smallest split points.
    assert balance_contiguous([0, 0, 0, 0], 2) == [range(0, 1), range(1, 4)]
    assert balance_contiguous([5.0], 1) == [range(0, 1)]


def test_memory_balance_gives_early_stages_fewer_activations() -> None:
    # 1F1B: stage 0 holds S micro-batches, the last one 1, so activations push layers later.
    ranges = balance_by_memory([0] * 8, [1] * 8, 2, inflight=[2, 1], optimizer_factor=2.0)
    assert [len(r) for r in ranges] == [2, 6]  # bottleneck 6 as [3, 5] too, but less even
    assert stage_memory(10, 3, 4, 2.0) == 10 * 4 + 3 * 4
    assert default_inflight(4) == [4, 3, 2, 1] and default_inflight(4, 2) == [2, 2, 2, 1]


def test_balance_errors_name_the_values() -> None:
    with pytest.raises(PartitionError) as err:
        balance_contiguous([1, 2, 3], 5)
    assert "5 stages" in str(err.value) and "3 layers" in str(err.value)
    with pytest.raises(PartitionError) as err:
        balance_contiguous([1, -2.5, 3], 2)
    assert "-2.5" in str(err.value) and "1: -2.5" in str(err.value)
    with pytest.raises(PartitionError, match="nan"):
        balance_contiguous([1, math.nan], 2)
    with pytest.raises(PartitionError, match="empty"):
        balance_contiguous([], 1)
    with pytest.raises(PartitionError, match="0 stages"):
        balance_contiguous([1, 2], 0)
    with pytest.raises(PartitionError, match=r"inflight=\[1\] has 1 entries for 2 stages"):
        balance_by_memory([1, 2], [1, 2], 2, [1])
    with pytest.raises(PartitionError, match="-1"):
        balance_by_memory([1, 2], [1, 2], 2, [1, -1])
    with pytest.raises(PartitionError, match="3 param_bytes but 2 activation_bytes"):
        balance_by_memory([1, 2, 3], [1, 2], 2, [2, 1])
    with pytest.raises(PartitionError, match="-7"):
        balance_by_memory([1, 2], [1, -7], 2, [2, 1])


# --- profiling ---------------------------------------------------------------------------------

def test_profile_layers_on_tiny_gpt() -> None:
    spec = build_toy("gpt")
    x, _ = random_batch("gpt", 2)
    profiles = profile_layers(spec, x, dtype=torch.float64, repeats=2)
    assert [p.name for p in profiles] == spec.layer_names()
    for i, p in enumerate(profiles):
        (layer,) = spec.build_layers([i], dtype=torch.float64)
        numel = sum(t.numel() for t in layer.parameters())
        assert p.params == numel and p.param_bytes == 8 * numel
        assert p.forward_s > 0 and p.backward_s > 0 and p.seconds == p.forward_s + p.backward_s
        assert p.activation_bytes > 0
    # the head keeps at least its logits (B, T, V) in float64
    assert profiles[-1].activation_bytes >= 2 * 16 * 64 * 8
    assert count_layer_params(spec) == [p.params for p in profiles]


class Tracked(nn.Module):
    """A layer that counts how many instances are alive, and the most ever alive at once."""

    alive = 0
    peak = 0

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        Tracked.alive += 1
        Tracked.peak = max(Tracked.peak, Tracked.alive)
        weakref.finalize(self, Tracked._died)

    @staticmethod
    def _died() -> None:
        Tracked.alive -= 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def tracked_spec(num_layers: int = 5, dim: int = 8) -> ModelSpec:
    layers = [LayerSpec(f"layer.{k}", Tracked, (dim,)) for k in range(num_layers)]
    return ModelSpec("tracked", layers, loss_fn=lambda out, y: (out - y).pow(2).mean())


@pytest.mark.parametrize("what", ["profile", "count", "plan_params", "plan_time"])
def test_layers_are_built_one_at_a_time(what: str) -> None:
    spec, x = tracked_spec(), torch.randn(3, 8)
    Tracked.alive = Tracked.peak = 0
    if what == "profile":
        assert len(profile_layers(spec, x, repeats=1)) == 5
    elif what == "count":
        assert count_layer_params(spec) == [72] * 5
    elif what == "plan_params":
        assert plan_partition(spec, 2, "params") == [range(0, 2), range(2, 5)]
    else:
        assert_covers(plan_partition(spec, 3, "time", sample_input=x), 5, 3)
    assert Tracked.peak == 1 and Tracked.alive == 0


def test_profile_layers_rejects_zero_repeats() -> None:
    with pytest.raises(ValueError, match="repeats=0"):
        profile_layers(tracked_spec(), torch.randn(2, 8), repeats=0)


class AutocastSeen(nn.Module):
    """A linear layer that records whether autocast was on in its forward."""

    seen: list[bool] = []

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        AutocastSeen.seen.append(torch.is_autocast_enabled(x.device.type))
        return self.linear(x)


def test_profile_runs_the_layers_in_the_runs_compute_dtype() -> None:
    """train.precision=bf16: a stage runs its forward under autocast and sends bf16, so the
    profile must (an H200 run profiled in fp32 predicted a bf16 step 4x too slow)."""
    spec = ModelSpec("amp", [LayerSpec(f"layer.{k}", AutocastSeen, (16,)) for k in range(2)],
                     loss_fn=lambda out, y: (out - y).pow(2).mean())
    x = torch.randn(4, 16)
    AutocastSeen.seen = []
    fp32 = profile_layers(spec, x, repeats=1, split_backward=True)
    assert AutocastSeen.seen and not any(AutocastSeen.seen)
    AutocastSeen.seen = []
    bf16 = profile_layers(spec, x, repeats=1, split_backward=True, autocast_dtype=torch.bfloat16)
    assert AutocastSeen.seen and all(AutocastSeen.seen)
    assert [p.output_bytes for p in fp32] == [4 * 16 * 4] * 2
    assert [p.output_bytes for p in bf16] == [4 * 16 * 2] * 2  # sent in bf16
    assert [p.param_bytes for p in bf16] == [p.param_bytes for p in fp32]  # master weights stay fp32


# --- plan_partition and the table ----------------------------------------------------------------

def heavy_gpt() -> ModelSpec:
    """Embedding and head (vocab 512 x 16) outweigh each block (about 3.3k parameters)."""
    return build_toy("gpt", vocab_size=512, n_layer=6)


def test_plan_params_beats_uniform_when_the_head_is_heavy() -> None:
    spec = heavy_gpt()
    params = count_layer_params(spec)
    assert params[-1] > 2 * params[1]
    uniform = plan_partition(spec, 4, "uniform")
    balanced = plan_partition(spec, 4, "params")
    assert uniform == partition_layers(len(spec), 4)
    assert_covers(balanced, len(spec), 4)

    def bottleneck(ranges: list[range]) -> int:
        return max(sum(params[i] for i in r) for r in ranges)

    assert bottleneck(balanced) < bottleneck(uniform)
    assert balanced == balance_contiguous(params, 4)


def test_plan_from_profiles_and_every_method() -> None:
    spec = heavy_gpt()
    x, _ = random_batch("gpt", 2, vocab_size=512)
    profiles = profile_layers(spec, x, repeats=1)
    assert plan_partition(profiles, 4, "params") == plan_partition(spec, 4, "params")
    assert plan_partition(profiles, 4, "time") == balance_profiles(profiles, "time", 4)
    memory = plan_partition(profiles, 4, "memory", inflight=[4, 3, 2, 1])
    assert memory == balance_by_memory(
        [p.param_bytes for p in profiles], [p.activation_bytes for p in profiles], 4, [4, 3, 2, 1]
    )
    for method in ("time", "memory"):
        assert_covers(plan_partition(spec, 3, method, sample_input=x), len(spec), 3)


def test_plan_split_points_win_and_errors() -> None:
    spec = heavy_gpt()
    assert plan_partition(spec, 2, "params", split_points=["block.3"]) == [range(0, 4), range(4, 8)]
    with pytest.raises(PartitionError, match="'fastest' is not a balance method"):
        plan_partition(spec, 2, "fastest")
    with pytest.raises(PartitionError, match="pipeline.balance=time .* sample input"):
        plan_partition(spec, 2, "time")
    with pytest.raises(PartitionError, match="9 stages"):
        plan_partition(spec, 9, "params")
    with pytest.raises(PartitionError, match="'fastest'"):
        balance_profiles([], "fastest", 1)


def fake_profiles() -> list[LayerProfile]:
    return [
        LayerProfile("embedding", 1000, 4000, 0.001, 0.002, 500_000),
        LayerProfile("block.0", 200, 800, 0.004, 0.008, 1_000_000),
        LayerProfile("head", 3000, 12000, 0.002, 0.003, 2_000_000),
    ]


def test_estimate_stages_sums_profiles() -> None:
    est = estimate_stages([range(0, 2), range(2, 3)], fake_profiles(), inflight=[2, 1])
    assert [e.params for e in est] == [1200, 3000]
    assert est[0].seconds == pytest.approx(0.015) and est[1].seconds == pytest.approx(0.005)
    assert est[0].memory_bytes == 4800 * 4 + 1_500_000 * 2
    assert est[1].memory_bytes == 12000 * 4 + 2_000_000


def test_format_partition_with_profiles_and_bubble() -> None:
    names = ["embedding", "block.0", "head"]
    ranges = [range(0, 2), range(2, 3)]
    table = format_partition(ranges, names, [0, 1], profiles=fake_profiles(), bubble=0.125)
    lines = table.splitlines()
    header = [cell.strip() for cell in lines[0].split("|")]
    assert header == ["stage", "rank", "layers", "count", "parameters", "fwd+bwd (ms)",
                      "memory (MB)"]
    assert len(lines) == 2 + 2 + 1
    assert [c.strip() for c in lines[2].split("|")] == [
        "0", "0", "embedding..block.0", "2", "1,200", "15.000", "3.02"]
    assert [c.strip() for c in lines[3].split("|")] == ["1", "1", "head", "1", "3,000", "5.000",
                                                        "2.05"]
    assert lines[-1] == "predicted bubble: 12.5%"
    params_only = format_partition(ranges, names, layer_params=[1000, 200, 3000]).splitlines()
    assert params_only[0].split("|")[-1].strip() == "parameters"
    assert params_only[2].split("|")[-1].strip() == "1,200"
