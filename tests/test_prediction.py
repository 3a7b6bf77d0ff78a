"""One prediction per layout: made when the layout is chosen, read by the start-of-run report,
the run's metrics and the sweep table (they used to simulate it each on their own)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pipeflow.models.mlp import build_mlp
from pipeflow.planning.layout import Layout, Prediction, choose_layout, describe_layout, predict, stage_bytes
from pipeflow.planning.partition import partition_layers
from pipeflow.planning.profile import LayerProfile, action_costs
from pipeflow.planning.search import rank_memory
from pipeflow.schedules import build_schedule, forward_only, lower, simulate
from pipeflow.schedules.memory import tensor_memory

MS = 1e-3


def profiles(n: int) -> list[LayerProfile]:
    """n synthetic layers of different costs: F, B (input grad), W (weight grad), memory."""
    return [LayerProfile(f"l{i}", 100 * (i + 1), 400 * (i + 1), (1 + i) * MS, (3 + i) * MS, 1000 * (i + 1),
                         (1 + i) * MS, 2 * MS) for i in range(n)]


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_a_profiled_prediction_is_the_simulated_step_bubble_and_memory(name: str) -> None:
    schedule, layers = build_schedule(name, 2, 4), profiles(4)
    ranges = partition_layers(4, 2)
    prediction = predict(schedule, ranges, layers)
    sim = simulate(schedule, costs=action_costs(ranges, layers, schedule))
    param = [sum(layers[i].param_bytes for i in r) for r in ranges]
    act = [sum(layers[i].activation_bytes for i in r) for r in ranges]
    memory = tensor_memory(schedule, stage_bytes(ranges, layers, schedule), programs=lower(schedule, "ahead"),
                           eval_programs=lower(forward_only(2, 4), "ahead"))
    assert prediction == Prediction("profiled layer costs", sim.bubble, sim.makespan,
                                    tuple(m.peak.total for m in memory), tuple(memory))
    # these profiles send nothing (no output bytes): the peaks are the planner's rank_memory
    assert prediction.memory_bytes == tuple(rank_memory(schedule, param, act))
    assert 0 < prediction.bubble < 1 and len(prediction.memory_bytes) == 2


def test_without_profiles_the_prediction_has_a_unit_cost_bubble_only() -> None:
    schedule = build_schedule("1f1b", 4, 8)
    prediction = predict(schedule, partition_layers(4, 4), None)
    assert prediction.basis == "F = B = W" and prediction.memory_bytes == ()
    assert math.isnan(prediction.step_s)
    assert prediction.bubble == pytest.approx(simulate(schedule, costs={"F": 1, "B": 1, "W": 1}).bubble)


def test_the_chosen_layout_carries_its_prediction_and_the_report_prints_it() -> None:
    spec, schedule = build_mlp(num_layers=2), build_schedule("1f1b", 2, 4)
    cfg = SimpleNamespace(balance="params", split_points=None, profile=False)  # no profile: not collective
    layout = choose_layout(spec, schedule, cfg, None, torch.device("cpu"), torch.float32)
    assert layout.prediction == predict(schedule, layout.ranges, None)
    first = describe_layout(layout, spec, schedule).splitlines()[0]
    assert first == (f"pipeline: 2 ranks, 2 stages, schedule=1f1b, 4 micro-batches, predicted bubble "
                     f"{layout.prediction.bubble:.1%} (F = B = W)")


def test_the_report_of_a_profiled_layout_names_the_predicted_step() -> None:
    schedule, layers = build_schedule("1f1b", 2, 4), profiles(4)
    ranges = partition_layers(4, 2)
    layout = Layout(ranges, layers, [2, 1], predict(schedule, ranges, layers))
    spec = SimpleNamespace(layer_names=lambda: [p.name for p in layers])
    first = describe_layout(layout, spec, schedule).splitlines()[0]  # type: ignore[arg-type]
    sim = simulate(schedule, costs=action_costs(ranges, layers, schedule))
    assert first.endswith(f"predicted bubble {sim.bubble:.1%} (profiled layer costs), "
                          f"predicted step {1e3 * sim.makespan:.1f} ms of compute")
