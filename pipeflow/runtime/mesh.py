"""The 2-D process mesh (data parallel x pipeline parallel) and the data-parallel gradient reduction.

Global rank g sits at mesh coordinate (d, r) = divmod(g, pp): the ranks of one pipeline are
consecutive (pipeline rank r of replica d is global rank d * pp + r), and the dp group of a
pipeline rank holds the same stages in every replica.  Put the pipeline inside a node when
pp <= GPUs per node (its P2P traffic is the chattiest); across nodes the dp all-reduce runs
once per step.

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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeflow.runtime import failures

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


@dataclass
class Mesh:
    """This rank's place in the dp x pp mesh.

    Attributes:
        dp, pp: the mesh shape.
        dp_rank, pp_rank: this rank's coordinates.
        pp_group: the process group of this rank's pipeline (P2P runs inside it).
        dp_group: the ranks holding the same stages in every replica (gradient all-reduce).
        replicas: ``replicas[d][r]``, the global rank of pipeline rank r in replica d.
        device_mesh: torch's DeviceMesh (None for a 1 x 1 mesh).
    """

    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    pp_group: Any
    dp_group: Any
    replicas: list[list[int]]
    device_mesh: DeviceMesh | None


def build_mesh(dp: int, pp: int, device: torch.device) -> Mesh:
    """Build the (dp, pp) mesh over the default process group (collective: every rank calls it).

    Args:
        dp: data-parallel degree.
        pp: pipeline degree; dp * pp must equal the world size (checked by config.check_config).
        device: this rank's device (its type names the mesh's device type).
    """
    rank = dist.get_rank()
    dp_rank, pp_rank = divmod(rank, pp)
    replicas = [[d * pp + r for r in range(pp)] for d in range(dp)]
    if dp * pp == 1:
        return Mesh(1, 1, 0, 0, None, None, replicas, None)
    device_mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Mesh(
        dp, pp, dp_rank, pp_rank, device_mesh.get_group("pp"), device_mesh.get_group("dp"), replicas, device_mesh
    )


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters grouped by dtype and device, each group under `bucket_bytes`."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        last = buckets[-1] if buckets else None
        fits = last is not None and last[0].dtype == p.dtype and last[0].device == p.device
        if not fits or size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
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
    """

    def __init__(self, stages: dict[int, Any], group: Any, world: int, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group, self.world, self.bucket_bytes = group, world, bucket_bytes
        self.stage_params = {s: stages[s].parameters() for s in sorted(stages)}  # each parameter once
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
        for bucket in _buckets(params, self.bucket_bytes):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
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
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._ready.clear()
        self._launched.clear()
        self._pending.clear()
