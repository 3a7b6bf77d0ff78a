"""The process mesh (data parallel x pipeline parallel x context parallel x tensor parallel) and
the data-parallel gradient reduction (over dp x cp: the ranks holding the same parameters).

Global rank g sits at mesh coordinate (d, r, t) as ``parallel.order`` lays the dimensions out
(:mod:`pipeflow.runtime.parallel.mesh_order`); by default g = (d * pp + r) * tp + t: tensor parallel
innermost (the tp ranks of a stage are consecutive: the GPUs of a node, where its per-layer
collectives run), then the pipeline, then data parallel.  Every (d, t) pair is one pipeline of
pp ranks (tp rank t of stage k exchanges with tp rank t of stage k + 1, batched P2P in that
pipeline's group); the dp group of a rank holds the same stages and the same tp shard in every
replica.

Why not DDP: DDP reduces from autograd's AccumulateGrad hooks and expects one forward then one
backward through the wrapped module.  A pipeline runs many micro-batch forwards before their
backwards, and split-backward schedules (ZB-H1, ZB-V, DualPipeV) compute weight gradients with
``torch.autograd.grad`` and assign ``p.grad`` themselves, which fires no DDP hook at all.  So
the gradients of every stage are reduced here (:class:`GradReducer`), once per step, in
flattened buckets with asynchronous ``all_reduce`` calls: a stage's buckets are posted the
moment its last weight gradient is in, overlapping the rest of the cooldown, and waited for
after the flush.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipeflow.runtime import failures
from pipeflow.runtime.parallel.fsdp import local
from pipeflow.runtime.parallel.mesh_order import DEFAULT_ORDER, MeshGrid

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size
REPLICAS = "dp_cp"  # the flattened (dp, cp) dimension of the DeviceMesh under parallel.cp


@dataclass
class Mesh:
    """This rank's place in the dp x pp x tp mesh.

    Attributes:
        dp, pp: the mesh shape (tp below).
        dp_rank, pp_rank: this rank's coordinates.
        pp_group: the process group of this rank's pipeline (P2P runs inside it).
        dp_group: the ranks holding the same stages (and tp shard) in every replica (gradient all-reduce).
        replicas: ``replicas[k][r]``, the global rank of pipeline rank r in pipeline k, one per
            (d, t) pair (k = d * tp + t): every pipeline that runs the same program.
        device_mesh: torch's DeviceMesh, dims ``("dp", "pp")`` or ``("dp", "pp", "tp")`` (None for one rank).
        tp, tp_rank: the tensor-parallel degree and this rank's place in its tp group.
        tp_group: the ranks that split this rank's stages' layers (None at tp = 1).
        grid: every rank's coordinates under ``parallel.order``.
        cp, cp_rank: the context-parallel degree and this rank's place in its cp ring.
        cp_group: the ranks that split this rank's sequences (None at cp = 1).
        replica_group: the ranks holding this rank's parameters, over dp x cp (the gradient
            reduction's group; the dp group at cp = 1).
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    pp_group: Any
    dp_group: Any
    replicas: list[list[int]]
    device_mesh: DeviceMesh | None
    tp: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    grid: MeshGrid | None = None  # the coordinates of every rank (parallel.order); None: the default order
    order_reason: str = ""  # why parallel.order=auto chose the order (for the start-of-run line)
    order_choice: Any = None  # what parallel.order=auto weighed (planning.mesh_choice.OrderChoice), or None
    cp: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    replica_group: Any = None

    def __post_init__(self) -> None:
        if self.grid is None:
            self.grid = MeshGrid(self.dp, self.pp, self.tp, cp=self.cp)
        if self.replica_group is None:
            self.replica_group = self.dp_group

    @property
    def replicas_of_parameters(self) -> int:
        """How many ranks hold each of this rank's parameters (dp x cp): the gradients' divisor."""
        return self.dp * self.cp

    @property
    def first_pipeline(self) -> bool:
        """True on the ranks of pipeline (d, c, t) = (0, 0, 0): the one whose figures stand for all."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.cp_rank == 0

    @property
    def replica_mesh(self) -> DeviceMesh | None:
        """The one-dimensional mesh of the ranks holding this rank's parameters (dp, or dp x cp
        flattened); None for one rank."""
        if self.device_mesh is None:
            return None
        return self.device_mesh["dp" if self.cp == 1 else REPLICAS]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The one-dimensional mesh of this rank's tp group (None at tp = 1)."""
        return self.device_mesh["tp"] if self.tp > 1 and self.device_mesh is not None else None

    def describe(self) -> str:
        """``dp=2 x pp=4 x cp=2 x tp=8`` (without cp or tp at 1)."""
        return (f"dp={self.dp} x pp={self.pp}" + (f" x cp={self.cp}" if self.cp > 1 else "")
                + (f" x tp={self.tp}" if self.tp > 1 else ""))


def build_mesh(dp: int, pp: int, device: torch.device, tp: int = 1, order: tuple[str, ...] = DEFAULT_ORDER,
               cp: int = 1) -> Mesh:
    """Build the (dp, pp[, cp][, tp]) mesh over the default process group (collective: every rank calls it).

    Args:
        dp: data-parallel degree.
        pp: pipeline degree; dp * pp * cp * tp must equal the world size (checked by config.check_config).
        device: this rank's device (its type names the mesh's device type).
        tp: tensor-parallel degree.
        order: ``parallel.order``, the dimensions outermost first (:mod:`pipeflow.runtime.parallel.mesh_order`).
        cp: context-parallel degree.
    """
    grid = MeshGrid(dp, pp, tp, order, cp)
    me = dist.get_rank()
    dp_rank, pp_rank, tp_rank = grid.coordinates(me)
    replicas = grid.pipelines()
    if dp * pp * tp * cp == 1:
        return Mesh(1, 1, 0, 0, None, None, replicas, None, grid=grid)
    table = torch.tensor(grid.rank_table(), dtype=torch.int)
    if cp == 1:
        names = ("dp", "pp") if tp == 1 else ("dp", "pp", "tp")
        device_mesh = DeviceMesh(device.type, table[..., 0] if tp == 1 else table, mesh_dim_names=names)
    else:
        device_mesh = DeviceMesh(device.type, table, mesh_dim_names=("dp", "cp", "pp", "tp"))
    tp_group = device_mesh.get_group("tp") if tp > 1 else None
    cp_group = device_mesh.get_group("cp") if cp > 1 else None
    # dp x cp: the ranks holding the same parameters, one flattened dimension ("dp_cp": FSDP2's mesh too)
    replica_group = device_mesh["dp", "cp"]._flatten(REPLICAS).get_group() if cp > 1 else None
    return Mesh(dp, pp, dp_rank, pp_rank, device_mesh.get_group("pp"), device_mesh.get_group("dp"), replicas,
                device_mesh, tp, tp_rank, tp_group, grid, cp=cp, cp_rank=grid.cp_rank(me), cp_group=cp_group,
                replica_group=replica_group)


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters grouped by dtype and device, each group under `bucket_bytes`
    (a tp-sharded parameter counted by its local shard)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        shard = local(p)
        last = buckets[-1] if buckets else None
        fits = last is not None and last[0].dtype == p.dtype and last[0].device == p.device
        if not fits or size + shard.numel() * shard.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += shard.numel() * shard.element_size()
    return buckets


class GradReducer:
    """Averages every stage's gradients over the data-parallel group, once per step.

    A stage's buckets are posted (asynchronous ``all_reduce``) as soon as the pipeline reports
    its weight gradients complete (``Pipeline.on_stage_grads_ready``), so the reduction of
    early-finishing stages overlaps the cooldown of the others; :meth:`finish` posts whatever
    has not started and waits for all.  A parameter held by several local stages (a tie inside
    one rank) waits for the last of them.  Every replica of a pipeline rank runs the same
    program, so the buckets are posted in the same order on every member of the dp group.

    Args:
        stages: this rank's stages (objects with ``parameters()``), by stage index.
        group: the dp process group.
        world: its size.
        bucket_bytes: the largest flattened bucket.
        unreduced: parameters split over the group's ranks (``parallel.ep``'s experts): their
            gradients are not all-reduced over the group, only averaged (divided by `world`).
        unreduced_group: the ranks holding the same `unreduced` parameters (ep < dp), over which
            their gradients are summed first; None: each is held by one rank of the group.
    """

    def __init__(self, stages: dict[int, Any], group: Any, world: int, bucket_bytes: int = BUCKET_BYTES,
                 unreduced: Sequence[torch.nn.Parameter] = (), unreduced_group: Any = None) -> None:
        self.group, self.world, self.bucket_bytes = group, world, bucket_bytes
        # parallel.ep's experts: their gradients already gather their ep group's tokens (all_to_all);
        # summed over the ranks holding the same experts (unreduced_group, ep < dp), averaged over dp
        self.unreduced, self.unreduced_group = list(unreduced), unreduced_group
        alone = {id(p) for p in self.unreduced}
        # each parameter once; frozen ones (a LoRA run's base weights) have no gradient to reduce
        self.stage_params = {s: [p for p in stages[s].parameters() if p.requires_grad and id(p) not in alone]
                             for s in sorted(stages)}
        self.owners: dict[int, set[int]] = {}
        for s, params in self.stage_params.items():
            for p in params:
                self.owners.setdefault(id(p), set()).add(s)
        self._ready: set[int] = set()
        self._launched: set[int] = set()
        self._pending: list[tuple[list[torch.nn.Parameter], torch.Tensor, Any, int]] = []

    def _describe(self, s: int, k: int, flat: torch.Tensor) -> str:
        """Names the all-reduce of bucket `k` (stage `s`'s gradients, `flat`) in an error."""
        size = flat.numel() * flat.element_size()
        return (f"the data-parallel gradient all-reduce of stage {s} (bucket {k + 1} of this step, "
                f"{size / 2**20:.2f} MiB)")

    def stage_ready(self, s: int) -> None:
        """Post the all-reduce of stage s's gradients (those not shared with a stage still running)."""
        self._ready.add(s)
        params = [p for p in self.stage_params[s] if id(p) not in self._launched and self.owners[id(p)] <= self._ready]
        for p in params:
            self._launched.add(id(p))
            if p.grad is None:  # a missing gradient counts as zeros, so the collective stays matched
                p.grad = torch.zeros_like(p)
        for bucket in _buckets(params, self.bucket_bytes):  # a tp-sharded parameter: its local shard
            flat = torch.cat([local(p.grad).reshape(-1) for p in bucket])
            with failures.collective(self._describe(s, len(self._pending), flat), self.group):
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((bucket, flat, work, s))

    def finish(self) -> None:
        """Post what has not started, wait for every bucket and write the averages back.

        Raises:
            CommError: a bucket's all-reduce failed (a peer in the dp group died or stopped
                answering), naming the stage, the bucket and the group's global ranks.
        """
        for s in self.stage_params:
            self.stage_ready(s)
        for k, (bucket, flat, work, s) in enumerate(self._pending):
            with failures.collective(self._describe(s, k, flat), self.group):
                work.wait()
            flat.div_(self.world)
            offset = 0
            for p in bucket:
                grad = local(p.grad)
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        for p in self.unreduced:
            if p.grad is None:  # a missing gradient counts as zeros, so the collective stays matched
                p.grad = torch.zeros_like(p)
            if self.unreduced_group is not None:
                dist.all_reduce(p.grad, group=self.unreduced_group)
            p.grad.div_(self.world)
        self._ready.clear()
        self._launched.clear()
        self._pending.clear()
