"""The benchmarks' sleep-stage helpers (benchmarks/sleep_tools.py): they live beside the
benchmarks, not in the product, and make every stage of sleep-stages pay what the simulator charges."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from sleep_tools import sleep_batch  # noqa: E402  (benchmarks/sleep_tools.py)

from pipeflow.models.sleep import build_sleep  # noqa: E402
from pipeflow.runtime.stage import build_stages  # noqa: E402


def test_sleep_stage_zero_costs_b_with_sleep_batch() -> None:
    """Stage 0 of sleep-stages pays B as every stage does (its input gradient is computed), in a
    full and in a split backward; with plain inputs its B would cost nothing."""
    stage = build_stages(build_sleep(1, 1.0, 8.0, 1.0), [range(1)], [0])[0]
    inputs, _ = sleep_batch(2)
    took = []
    for i, weights in enumerate((True, False)):
        out = stage.forward(i, inputs[i])
        start = time.perf_counter()
        grads = stage.backward(i, (torch.ones_like(out[0]),), weights=weights)
        took.append(time.perf_counter() - start)
        assert grads[0] is not None
    stage.backward_weight(1)
    assert took[0] >= 9e-3 and took[1] >= 8e-3  # full: B + W; split: B


def test_the_sleep_model_is_only_a_model() -> None:
    """The product's sleep module keeps the model and sheds the benchmark helpers."""
    import pipeflow.models.sleep as sleep

    assert {"SleepLayer", "build_sleep", "sleep_loss"} <= set(vars(sleep))
    assert not {"sleep_batch", "profile_sleep_layer", "sleep_costs"} & set(vars(sleep))
