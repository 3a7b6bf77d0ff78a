"""Parameters shared by several stages (e.g. GPT's token embedding and output head).

A tie is declared once in the ModelSpec (``spec.tied``). Copies held by one rank become one
Parameter; copies on different ranks start equal (broadcast from the rank of the first member)
and, every step, their gradients are summed over a process group of just those ranks, so the
pipelined model equals the unsplit model in which the parameter is a single tensor.

With ``parallel.shard=full`` a copy is a DTensor sharded on dim 0 over its dp group; the copies
of a tie group all sit at the same dp coordinate, so their local shards hold the same rows and
are broadcast and summed shard by shard.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeflow.errors import ConfigError
from pipeflow.models.spec import ModelSpec
from pipeflow.runtime.parallel.fsdp import local


def _get_param(module: nn.Module, path: str) -> nn.Parameter:
    owner, _, leaf = path.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    param = getattr(sub, leaf, None)
    if not isinstance(param, nn.Parameter):
        raise ConfigError(f"tied parameter path {path!r} is not a parameter of {type(module).__name__}")
    return param


def _set_param(module: nn.Module, path: str, param: nn.Parameter) -> None:
    owner, _, leaf = path.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


def tie_in_place(spec: ModelSpec, layers: dict[int, nn.Module]) -> None:
    """Make every tied copy among `layers` (by layer index) the same Parameter as its first one."""
    index = {name: i for i, name in enumerate(spec.layer_names())}
    for members in spec.tied.values():
        present = [(index[layer], path) for layer, path in members if index[layer] in layers]
        if len(present) > 1:
            first = _get_param(layers[present[0][0]], present[0][1])
            for i, path in present[1:]:
                if _get_param(layers[i], path).shape != first.shape:
                    raise ConfigError(f"tied copies {members} have different shapes")
                _set_param(layers[i], path, first)


@dataclass
class _Tie:
    name: str
    param: nn.Parameter  # this rank's copy
    ranks: list[int]  # pipeline ranks holding a copy
    group: dist.ProcessGroup | None
    source: int  # global rank holding the first member: the initial value comes from there
    primary: bool  # this rank holds the first member (its copy counts in the grad norm)


class TiedWeights:
    """This rank's view of the model's ties, with one process group per tie spanning ranks.

    Must be constructed on every rank of the pipeline group (it creates process groups).

    Args:
        spec: the model description with its ``tied`` declarations.
        ranges: layer ranges of every stage (the partition).
        stage_to_rank: pipeline rank of every stage.
        layers: this rank's built layers, by layer index.
        global_ranks: global rank of every pipeline rank.
        my_rank: this process's pipeline rank.
        replicas: with data parallelism, the global ranks of every replica's pipeline (one
            list per replica, `global_ranks` among them): ``dist.new_group`` is collective over
            the world, so every rank creates each replica's tie group and keeps its own.
    """

    def __init__(
        self,
        spec: ModelSpec,
        ranges: Sequence[range],
        stage_to_rank: Sequence[int],
        layers: dict[int, nn.Module],
        global_ranks: Sequence[int],
        my_rank: int,
        replicas: Sequence[Sequence[int]] | None = None,
    ) -> None:
        tie_in_place(spec, layers)
        index = {name: i for i, name in enumerate(spec.layer_names())}
        rank_of_layer = {i: stage_to_rank[s] for s, r in enumerate(ranges) for i in r}
        self.ties: list[_Tie] = []
        for name, members in spec.tied.items():
            ranks = sorted({rank_of_layer[index[layer]] for layer, _ in members})
            group = None
            for replica in replicas or [global_ranks]:
                made = dist.new_group([replica[r] for r in ranks]) if len(ranks) > 1 else None
                group = made if list(replica) == list(global_ranks) else group
            mine = [(index[layer], path) for layer, path in members if index[layer] in layers]
            if mine:
                first_rank = rank_of_layer[index[members[0][0]]]
                param = _get_param(layers[mine[0][0]], mine[0][1])
                tie = _Tie(name, param, ranks, group, global_ranks[first_rank], first_rank == my_rank)
                self.ties.append(tie)

    def groups(self) -> list[dist.ProcessGroup]:
        """This rank's tie groups (one per tie spanning ranks), e.g. to set their timeouts."""
        return [t.group for t in self.ties if t.group is not None]

    def sync_initial_values(self) -> None:
        """Copy the first member's initial value to every copy (broadcast within each tie)."""
        for tie in self.ties:
            if tie.group is not None:
                with torch.no_grad():
                    dist.broadcast(local(tie.param.data), src=tie.source, group=tie.group)

    def reduce_grads(self) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy."""
        for tie in self.ties:
            if tie.group is None or not tie.param.requires_grad:  # frozen (a LoRA run's base): no gradient
                continue
            if tie.param.grad is None:
                tie.param.grad = torch.zeros_like(tie.param)
            dist.all_reduce(local(tie.param.grad), group=tie.group)

    def duplicates(self) -> set[int]:
        """ids of this rank's copies that must not count again in the global grad norm."""
        return {id(t.param) for t in self.ties if not t.primary}
