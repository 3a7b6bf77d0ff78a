"""A stage boundary under ``parallel.tp`` without sequence parallelism: which way to move the activation.

    python benchmarks/features/tp_boundary.py --mb 0.25 1 4 16 --rounds 15 --out benchmarks/RESULTS.md

Every tp rank of stage k holds the whole activation (it is replicated over the tp group), and tp
rank t of stage k + 1 needs it whole too.  Two ways, timed side by side in alternating rounds
on a pp 2 x tp 2 mesh (4 spawned gloo ranks, the mesh pipeflow builds: tp innermost):

- **replicated** (what pipeflow runs): tp rank t of stage k sends the whole tensor to tp rank t
  of stage k + 1 (one batched P2P per pair, the pairs at once): tp times the bytes cross the
  stage boundary in all;
- **split + re-gather**: tp rank t sends only its 1/tp slice (along the sequence), and stage
  k + 1's tp ranks all-gather the slices: the boundary carries the bytes once, the receiving
  node's tp link the all-gather.

Each round is barrier to barrier, the slowest rank's time; medians over rounds.  On one host's
CPU cores (gloo over loopback) both the P2P and the all-gather go through the same memory, so
this measures that machine; across nodes with NVLink inside them the all-gather is the cheap
part and the split saves inter-node bytes.  With ``parallel.sequence_parallel`` the activation
is already split and only slices cross the boundary.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.runner import alternate_rounds, gloo_worker, medians, report, spawn_ranks  # noqa: E402

TP, PP = 2, 2


def _replicated(x: torch.Tensor, first: bool, peer: int, group: object) -> None:
    op = dist.P2POp(dist.isend if first else dist.irecv, x, peer, group)
    for work in dist.batch_isend_irecv([op]):
        work.wait()


def _split(x: torch.Tensor, first: bool, peer: int, group: object, tp_group: object, t: int) -> None:
    part = x.chunk(TP, dim=1)[t].contiguous()
    op = dist.P2POp(dist.isend if first else dist.irecv, part, peer, group)
    for work in dist.batch_isend_irecv([op]):
        work.wait()
    if not first:
        parts = [torch.empty_like(part) for _ in range(TP)]
        dist.all_gather(parts, part, group=tp_group)
        torch.cat(parts, dim=1)


@gloo_worker()
def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    """One rank of the pp 2 x tp 2 mesh: time both ways for every size; rank 0 puts the rows."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    pp_group, tp_group = mesh.get_group("pp"), mesh.get_group("tp")
    r, t = divmod(rank, TP)
    first = r == 0
    peer = dist.get_global_rank(pp_group, 1 - r)
    rows = []
    for mb in args.mb:
        seq = 64
        width = max(1, int(mb * 2**20 / (4 * args.batch * seq)))
        x = torch.randn(args.batch, seq, width)
        times = medians(alternate_rounds({  # the first round warms the groups up
            "replicated": lambda _, x=x: lambda: _replicated(x, first, peer, pp_group),
            "split": lambda _, x=x: lambda: _split(x, first, peer, pp_group, tp_group, t),
        }, args.rounds, warmup=1))
        rows.append((x.numel() * 4 / 2**20, times["replicated"], times["split"]))
    if rank == 0:
        queue.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/features/tp_boundary.py",
                                     description="parallel.tp stage boundary: the replicated activation sent by every "
                                                 "tp rank against its 1/tp slices sent and all-gathered (pp 2 x tp 2)")
    parser.add_argument("--mb", type=float, nargs="+", default=[0.25, 1, 4, 16], help="activation sizes in MiB")
    parser.add_argument("--batch", type=int, default=4, help="rows of the activation (its sequence is 64)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per size and way (medians)")
    parser.add_argument("--out", default=None, help="also append the table to this file")
    args = parser.parse_args()
    args.ranks = PP * TP
    rows = spawn_ranks(worker, args)
    lines = ["| activation (MiB) | replicated (ms) | split + all-gather (ms) | split / replicated |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {mb:.2f} | {1e3 * a:.3f} | {1e3 * b:.3f} | {b / a:.2f} |" for mb, a, b in rows]
    report("parallel.tp stage boundary: replicated vs split + re-gather", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
