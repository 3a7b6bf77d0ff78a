"""The planner on a run's measured costs (``python -m pipeflow.plan plan.calibration=<run dir>``):
closed-loop tuning, run once, plan on what that run measured, run the pick.

A run writes its costs into ``<run_dir>/costs.json`` (`pipeflow.planning.calibration`): per stage
F, B, W, per rank the runtime's own time, the transfer latency and per-byte cost, the tail after
the pipeline, and the layer profiles and partition they were measured on.  Here they become the
planner's per-layer cost model (each layer's profile scaled to its stage's measured time) and
its :class:`~pipeflow.planning.search.StepModel`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

from pipeflow.planning.calibration import COSTS_FILE, Calibration, mean
from pipeflow.planning.profile import LayerProfile
from pipeflow.planning.search import StepModel


def read_costs(path: str) -> Calibration:
    """A run's measured costs: `path` is its run directory or its ``costs.json``.

    Raises:
        FileNotFoundError: no costs file there (runs write it at their end).
    """
    file = path if path.endswith(".json") else os.path.join(path, COSTS_FILE)
    with open(file) as f:
        return Calibration.from_json(f.read())


def calibrated_layers(cal: Calibration) -> list[LayerProfile]:
    """Per-layer costs at the calibrated run's micro-batch size: each layer's profile scaled so
    that its stage's layers sum to what the run measured for the stage (F, the backward halves,
    the full backward: each scaled by its own measured/profiled ratio; a kind the run did not
    measure is scaled as the backward it did).

    Raises:
        ValueError: the run had no layer profiles (``pipeline.profile=false``).
    """
    profiles, ranges = cal.meta.get("profiles"), cal.meta.get("ranges")
    if not profiles or not ranges:
        raise ValueError("the calibrated run has no layer profiles (it ran with pipeline.profile=false); "
                         "run it with pipeline.profile=true")
    layers = [LayerProfile(**p) for p in profiles]
    out = list(layers)
    for s, (lo, hi) in enumerate(ranges):
        mine = layers[lo:hi]

        def ratio(measured: float, pick: Callable[[LayerProfile], float]) -> float:
            profiled = math.fsum(pick(x) for x in mine)
            return measured / profiled if math.isfinite(measured) and profiled > 0 else math.nan

        f = ratio(cal.forward[s], lambda x: x.forward_s)
        full = ratio(cal.backward[s], lambda x: x.backward_s)
        halves = ratio(cal.input_grad[s] + cal.weight_grad[s], lambda x: x.input_grad_s + x.weight_grad_s)
        b = ratio(cal.input_grad[s], lambda x: x.input_grad_s)
        w = ratio(cal.weight_grad[s], lambda x: x.weight_grad_s)
        backward = next((x for x in (full, halves, 1.0) if math.isfinite(x)), 1.0)
        b, w = (x if math.isfinite(x) else backward for x in (b, w))
        full = full if math.isfinite(full) else backward
        for i in range(lo, hi):
            x = layers[i]
            out[i] = dataclasses.replace(x, forward_s=x.forward_s * (f if math.isfinite(f) else 1.0),
                                         backward_s=x.backward_s * full, input_grad_s=x.input_grad_s * b,
                                         weight_grad_s=x.weight_grad_s * w)
    return out


_PER_SAMPLE = ("forward_s", "backward_s", "input_grad_s", "weight_grad_s", "activation_bytes", "output_bytes")


def calibrated_cost_model(cal: Calibration) -> Callable[[int], list[LayerProfile]]:
    """Per-layer costs at any micro-batch size b for the planner: the calibrated layers at the
    run's size b0, times and activation bytes scaled by b / b0 (the per-step overheads are the
    runtime's, :func:`step_model`, and do not scale)."""
    layers, b0 = calibrated_layers(cal), cal.meta["microbatch_size"]

    def at(b: int) -> list[LayerProfile]:
        if b == b0:
            return list(layers)
        scale = b / b0
        return [dataclasses.replace(x, **{k: type(getattr(x, k))(getattr(x, k) * scale) for k in _PER_SAMPLE})
                for x in layers]

    return at


def step_model(cal: Calibration) -> StepModel:
    """The runtime's program and own costs as the run measured them (means over its ranks)."""
    return StepModel(cal.posting, mean(cal.step_overhead, 0.0), mean(cal.post, 0.0), cal.tail_s)


def transfer_model(cal: Calibration) -> Callable[[int], float]:
    """Seconds of a transfer at micro-batch size b: the largest boundary's bytes scaled from the run's."""
    biggest, b0 = max(cal.boundary_bytes, default=0.0), cal.meta["microbatch_size"]
    return lambda b: cal.transfer_s(biggest * b / b0)
