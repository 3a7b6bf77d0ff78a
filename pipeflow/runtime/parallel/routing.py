"""Router statistics of a training step, summed over micro-batches and ranks in the step's all-reduce.

Every MoE layer (:class:`~pipeflow.models.moe.MoE`) adds up, over the micro-batches of a step,
its tokens per expert, its dropped assignments and its weighted auxiliary loss.  The Trainer
appends this rank's rows to the packet of the step's one all-reduce (no collective of its own):
a ``(layers, E + 2)`` float64 block, row = the layer's index in the whole model, zero where this
rank holds no such layer.  Summed over the world, a row holds its layer's figures over every
micro-batch and data-parallel replica; each rank then moves its own routers' biases by them
(once per step, on the device) and rank 0 reports them (:class:`RoutingFigures`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeflow.models.hf_routing import ROUTING
from pipeflow.models.moe import MoE
from pipeflow.runtime.parallel.expert_parallel import is_expert_parameter


@dataclass(frozen=True)
class RoutingFigures:
    """A step's router statistics, summed over micro-batches and data-parallel replicas.

    Attributes:
        tokens: per MoE layer (by its index in the model), the assignments each expert got.
        dropped: per MoE layer, the assignments over an expert's capacity (0 when dropless).
        aux: the step's auxiliary loss (its share of the step's loss: weighted, averaged over replicas).
    """

    tokens: dict[int, list[float]]
    dropped: dict[int, float]
    aux: float

    def imbalance(self, layer: int) -> float:
        """max / mean of the layer's tokens per expert (1: perfectly balanced)."""
        counts = self.tokens[layer]
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean > 0 else float("nan")


class RoutingSync:
    """This rank's MoE layers, and the step's block of the all-reduce packet for them.

    Args:
        layers: this rank's built layers by their index in the whole model.
        num_layers: the model's layer count (every rank's block has a row per layer).
        experts: routed experts per MoE layer (the same on every rank).
        ep: ``parallel.ep``: the ranks each layer's experts are split over (:attr:`split` names
            their parameters for the grad-norm).
    """

    def __init__(self, layers: Mapping[int, nn.Module], num_layers: int, experts: int, ep: int = 1) -> None:
        self.num_layers, self.experts = num_layers, experts
        self.split = {id(p): ep for layer in layers.values() for name, p in layer.named_parameters()
                      if ep > 1 and is_expert_parameter(name)}  # {id(expert parameter): ep}
        self.routers: dict[int, Any] = {}  # MoE, or a Hugging Face router's RouterFigures
        for index, layer in layers.items():
            found = [m if isinstance(m, MoE) else getattr(m, ROUTING) for m in layer.modules()
                     if isinstance(m, MoE) or hasattr(m, ROUTING)]
            if len(found) > 1:
                raise ValueError(f"layer {index} holds {len(found)} MoE modules; router statistics take one per layer")
            if found:
                self.routers[index] = found[0]
                found[0].take_stats()  # what start-up's rehearsal or warm-up steps counted is no step's

    @property
    def size(self) -> int:
        """The packet's length: layers x (E + 2)."""
        return self.num_layers * (self.experts + 2)

    def packet(self, device: torch.device) -> Tensor:
        """This rank's rows of the step (its routers' statistics, taken and cleared), flat float64."""
        block = torch.zeros(self.num_layers, self.experts + 2, dtype=torch.float64, device=device)
        for index, router in self.routers.items():
            block[index] = router.take_stats().to(device)
        return block.flatten()

    def balance(self, reduced: Tensor) -> None:
        """Move this rank's routers' biases by the world-summed packet `reduced` (on the device)."""
        block = reduced.view(self.num_layers, self.experts + 2)
        for index, router in self.routers.items():
            router.balance(block[index, : self.experts])

    def figures(self, values: list[float], replicas: int) -> RoutingFigures:
        """The summed packet read back (host floats) as figures; the aux loss averaged over the
        `replicas` pipelines (each weighted its micro-batches as its own share of the step)."""
        width = self.experts + 2
        rows = [values[i * width:(i + 1) * width] for i in range(self.num_layers)]
        moe = [i for i, row in enumerate(rows) if sum(row[: self.experts]) > 0]
        return RoutingFigures(tokens={i: rows[i][: self.experts] for i in moe},
                              dropped={i: rows[i][self.experts] for i in moe},
                              aux=sum(row[-1] for row in rows) / replicas)


def routing_sync(layers: Mapping[int, nn.Module], num_layers: int, experts: int, ep: int = 1) -> RoutingSync | None:
    """A :class:`RoutingSync` for a model with `experts` routed experts per MoE layer (split over
    `ep` ranks); None for a dense model (``experts == 0``)."""
    return RoutingSync(layers, num_layers, experts, ep) if experts > 0 else None
