"""What the MoE routers did: tokens per expert per step, imbalance, dropped tokens, the aux loss.

Rank 0 writes each step's figures to TensorBoard (``moe/layer{l}/tokens/expert{e}``,
``moe/layer{l}/imbalance`` (max / mean of the tokens per expert), ``moe/layer{l}/dropped``,
``train/aux_loss``) and adds them up for the end-of-run summary (:meth:`RoutingLog.summary`).
With ``parallel.ep`` the time of the token exchanges per pipeline rank (``a2a`` events, summed in
``pipeflow.observability.figures``) has its end-of-run line (:func:`all_to_all_line`).
"""
from __future__ import annotations

import math
from typing import Any

from pipeflow.runtime.parallel.routing import RoutingFigures


class RoutingLog:
    """The run's router figures, step by step."""

    def __init__(self) -> None:
        self.steps = 0
        self.aux = math.nan  # the last step's
        self.tokens: dict[int, list[float]] = {}  # per layer: tokens per expert, summed over the steps
        self.dropped: dict[int, float] = {}
        self.imbalance: dict[int, float] = {}  # per layer: the worst step's max / mean

    def record(self, step: int, figures: RoutingFigures, writer: Any = None) -> None:
        """Add step `step`'s figures; write them to TensorBoard when `writer` is given."""
        self.steps += 1
        self.aux = figures.aux
        for layer, counts in figures.tokens.items():
            total = self.tokens.setdefault(layer, [0.0] * len(counts))
            self.tokens[layer] = [a + b for a, b in zip(total, counts)]
            self.dropped[layer] = self.dropped.get(layer, 0.0) + figures.dropped[layer]
            self.imbalance[layer] = max(self.imbalance.get(layer, 0.0), figures.imbalance(layer))
        if writer is None:
            return
        writer.add_scalar("train/aux_loss", figures.aux, step)
        for layer, counts in figures.tokens.items():
            for e, count in enumerate(counts):
                writer.add_scalar(f"moe/layer{layer}/tokens/expert{e}", count, step)
            writer.add_scalar(f"moe/layer{layer}/imbalance", figures.imbalance(layer), step)
            writer.add_scalar(f"moe/layer{layer}/dropped", figures.dropped[layer], step)

    def summary(self) -> dict[str, Any]:
        """``moe``: per MoE layer (by model index) its mean tokens per expert per step, its imbalance
        over the run (max / mean of those) and over the worst step, its dropped assignments per step."""
        layers = {}
        for layer, total in self.tokens.items():
            per_step = [t / self.steps for t in total]
            mean = sum(per_step) / len(per_step)
            layers[layer] = {"tokens_per_expert": per_step, "imbalance": max(per_step) / mean if mean else math.nan,
                             "worst_step_imbalance": self.imbalance[layer], "dropped_per_step": self.dropped[layer] / self.steps}
        return {"layers": layers, "aux_loss": self.aux, "steps": self.steps}

    def lines(self) -> list[str]:
        """The summary as log lines, one per MoE layer: ``MoE layer 1: tokens per expert per step 130,
        126, 121, 135 | imbalance 1.05 (worst step 1.31) | dropped 0.0 per step``."""
        out = []
        for layer, row in self.summary()["layers"].items():
            tokens = ", ".join(f"{t:.0f}" for t in row["tokens_per_expert"])
            out.append(f"MoE layer {layer}: tokens per expert per step {tokens} | imbalance {row['imbalance']:.2f} "
                       f"(worst step {row['worst_step_imbalance']:.2f}) | dropped {row['dropped_per_step']:.1f} per step")
        return out


def all_to_all_line(a2a_s: list[float], compute_s: list[float]) -> str:
    """The end-of-run line of the MoE layers' token exchanges (``parallel.ep``), per pipeline rank
    per steady step: ``expert all_to_all (dispatch + combine, forward and backward), ms per step
    per pipeline rank: 0 1.23 (8% of its compute); 1 1.10 (7%)``."""
    said = "; ".join(f"{r} {1e3 * a:.2f} ({a / c:.0%} of its compute)" if c > 0 else f"{r} {1e3 * a:.2f}"
                     for r, (a, c) in enumerate(zip(a2a_s, compute_s)))
    return f"expert all_to_all (dispatch + combine, forward and backward), ms per step per pipeline rank: {said}"
