"""``parallel.shard=full``: each stage's parameters, gradients and AdamW state sharded over its
data-parallel group with FSDP2 (``torch.distributed.fsdp.fully_shard``), driven by the program.

Every stage of this rank (stages sharing a parameter, e.g. both tied copies of a V placement,
together) is one FSDP2 unit on the ``dp`` sub-mesh: its parameters become DTensors sharded on
dim 0 over the dp group, and so do their gradients and (the optimizer being built over them)
the AdamW state.  The unit's module is a holder whose ``forward`` never runs: the stage calls its
layers one by one, so FSDP2's forward and backward hooks never fire and nothing is gathered or
reduced behind the program's back.  The lowered program says when
(:func:`~pipeflow.schedules.lowering.shard_points`): :meth:`FullShard.unshard` all-gathers a
stage's parameters at its first action of a pass (the unsharded parameters are then the layers'
registered parameters, plain tensors, so the full backward, the split B and the W of zero-bubble
schedules, which assigns ``p.grad`` itself, all accumulate into their ``.grad``), and
:meth:`FullShard.reshard` reduce-scatters the accumulated gradients over the dp group (averaged,
as the replicated gradient all-reduce does) and frees the full parameters after its last, so
gradients are reduced once per step, never per micro-batch.

The once-per-step reduction goes through FSDP2 internals, as torch.distributed.pipelining's
``perform_reduce_grad`` does: ``FSDPState._lazy_init`` (what the root's first forward would do)
and ``FSDPState._root_post_backward_final_callback`` (post-backward of every parameter group:
reduce-scatter, reshard, then wait for the reduction).  Why not by hand: the reduce-scatter
must produce exactly FSDP2's sharded gradient layout (its padding of uneven dim-0 shards, its
divide factors for the reduce dtype) and assign the DTensor gradients FSDP2's optimizer state
expects; calling FSDP2 for it keeps that FSDP2's business.  :func:`check_internals` names what
is used; pipeflow pins torch >= 2.11 and a test fails if any of it goes.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from pipeflow.errors import ConfigError

# the FSDP2 internals FullShard calls: methods of a unit's FSDPState (it also reads the state's
# ``_fsdp_param_groups`` and their ``is_unsharded``), and the public FSDPModule methods it uses
INTERNALS = ("_lazy_init", "_root_post_backward_final_callback")
PUBLIC = ("unshard", "reshard", "set_requires_gradient_sync", "set_reshard_after_backward", "set_is_last_backward")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage, outside autograd), or the tensor itself."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def is_sharded(tensor: torch.Tensor | None) -> bool:
    """True for a DTensor sharded over some mesh dimension (a gradient of ``parallel.shard=full``,
    or of a tp-split weight)."""
    return isinstance(tensor, DTensor) and any(splits(p) for p in tensor.placements)


def splits(placement: Any) -> bool:
    """True for a placement that splits a tensor over its mesh dimension: ``Shard``, and the
    strided shard of a fused [q; k; v] weight (``_StridedShard``, whose ``is_shard()`` is False)."""
    return placement.is_shard() or strided(placement) is not None


def strided(placement: Any) -> int | None:
    """A strided shard's split factor (``_StridedShard``: a fused [q; k; v] split over tp, 3, or
    FSDP2's dp split of a tp-split weight), None for any other placement."""
    return getattr(placement, "split_factor", None)


def check_internals() -> None:
    """Raise ConfigError unless this torch has the FSDP2 internals :class:`FullShard` uses."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    missing = [f"FSDPState.{name}" for name in INTERNALS if not callable(getattr(FSDPState, name, None))]
    missing += [f"FSDPModule.{name}" for name in PUBLIC if not callable(getattr(FSDPModule, name, None))]
    if not isinstance(getattr(FSDPParamGroup, "is_unsharded", None), property):
        missing.append("FSDPParamGroup.is_unsharded")
    if not hasattr(fully_shard, "state"):
        missing.append("fully_shard.state")
    if missing:
        raise ConfigError(
            f"parallel.shard=full needs FSDP2 internals this torch {torch.__version__} lacks: {', '.join(missing)}; "
            f"it is tested with torch 2.14.1: use that torch, or parallel.shard=none or optimizer"
        )


class _Unit(nn.Module):
    """The stages' layers gathered and reduced together (FSDP2's module; never called)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.held = nn.ModuleList(modules)

    def forward(self, *args: Any) -> Any:  # pragma: no cover - a holder, the stages run the layers
        raise RuntimeError("a FullShard unit is never called; its stages run their layers")


def _units(stages: dict[int, Any]) -> list[list[int]]:
    """This rank's stages grouped so that stages sharing a parameter are in one group."""
    owner: dict[int, int] = {}  # parameter id -> a stage holding it
    parent = {s: s for s in stages}

    def root(s: int) -> int:
        while parent[s] != s:
            s = parent[s]
        return s

    for s in sorted(stages):
        for p in stages[s].module.parameters():
            other = owner.setdefault(id(p), s)
            parent[root(s)] = root(other)
    groups: dict[int, list[int]] = {}
    for s in sorted(stages):
        groups.setdefault(root(s), []).append(s)
    return list(groups.values())


class FullShard:
    """This rank's stages sharded over their data-parallel group; gathered and reduced when the
    program says (``Step.unshard`` / ``Step.reshard``).

    Args:
        stages: this rank's stages (objects with a ``module``), by index.  Their parameters are
            replaced by DTensor shards here: build the optimizer, tied weights and anything else
            that holds parameters after this.
        dp_mesh: the ``dp`` sub-mesh of the run's DeviceMesh.
    """

    def __init__(self, stages: dict[int, Any], dp_mesh: DeviceMesh) -> None:
        from torch.distributed.fsdp import fully_shard

        check_internals()
        self.units: list[nn.Module] = []
        self._states: list[Any] = []
        self._unit_of: dict[int, int] = {}
        self._active: list[set[int]] = []  # per unit: its stages gathered and not yet done
        for members in _units(stages):
            unit = _Unit([stages[s].module for s in members])
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=False)
            state = fully_shard.state(unit)
            state._lazy_init()  # what the root's first forward would do; it never runs here
            unit.set_requires_gradient_sync(True)  # the reshard point reduces the step's gradients
            unit.set_reshard_after_backward(True)
            unit.set_is_last_backward(True)
            self._unit_of.update({s: len(self.units) for s in members})
            self.units.append(unit)
            self._states.append(state)
            self._active.append(set())

    def unit_stages(self) -> list[list[int]]:
        """The stages of each unit (gathered together), e.g. for the start-of-run table."""
        return [sorted(s for s, u in self._unit_of.items() if u == k) for k in range(len(self.units))]

    def unshard(self, stages: Iterable[int]) -> list[Any]:
        """Start gathering the parameters of `stages` (asynchronous; collective over the dp group);
        returns the handles for :meth:`wait` (none for a unit already gathered)."""
        handles = []
        for s in stages:
            u = self._unit_of[s]
            if not self._active[u] and not self._gathered(u):
                handles.append(self.units[u].unshard(async_op=True))
            self._active[u].add(s)
        return handles

    def wait(self, handles: Sequence[Any]) -> None:
        """Wait for gathers started by :meth:`unshard`: the full parameters are the layers' now."""
        for handle in handles:
            handle.wait()

    def unshard_all(self) -> None:
        """Gather every unit now (e.g. for shape negotiation's trial forwards); the program's
        unshard points then find them gathered."""
        self.wait([self.units[u].unshard(async_op=True) for u in range(len(self.units)) if not self._gathered(u)])

    def reshard(self, stages: Iterable[int], train: bool) -> None:
        """`stages` are done for this pass: once every stage of a unit is, reduce-scatter its
        gradients over the dp group (`train`) and free its full parameters (collective)."""
        for s in stages:
            u = self._unit_of[s]
            self._active[u].discard(s)
            if self._active[u]:
                continue
            if train:
                self._states[u]._root_post_backward_final_callback()  # reduce-scatter, reshard, wait
            self.units[u].reshard()

    def _gathered(self, u: int) -> bool:
        return all(group.is_unsharded for group in self._states[u]._fsdp_param_groups)
