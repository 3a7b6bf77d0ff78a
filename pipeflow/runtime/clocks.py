"""Clock offsets between ranks: every rank's ``time.perf_counter`` on rank 0's time axis.

Each rank times its events with its own ``perf_counter``; processes on one machine share the
monotonic clock behind it, but on several machines each counts from its own boot.  Whatever
compares times recorded on different ranks (the trace, the in-run calibration, the rehearsal)
first subtracts each rank's offset from :func:`clock_offsets`.
"""
from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def clock_offsets(device: torch.device | str | None = None, rounds: int = 7) -> list[float]:
    """Every rank's ``perf_counter`` minus rank 0's (seconds).  Collective over the default group.

    Ranks on rank 0's host get 0 exactly; every other host gets the median of `rounds`
    barrier-then-timestamp exchanges over all its ranks (see :func:`host_offsets`).

    Args:
        device: where the timestamps travel (the backend's device); None: as Python objects.
        rounds: exchanges when the ranks span several hosts.
    """
    world = dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    samples = [_stamps(world, device) for _ in range(rounds if len(set(hosts)) > 1 else 0)]
    return host_offsets(hosts, samples)


def _stamps(world: int, device: torch.device | str | None) -> list[float]:
    """Every rank's ``perf_counter`` read right after one barrier."""
    dist.barrier()
    now = time.perf_counter()
    if device is None:
        stamps: list[Any] = [None] * world
        dist.all_gather_object(stamps, now)
        return [float(t) for t in stamps]
    mine = torch.tensor([now], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [float(t) for t in gathered]


def host_offsets(hosts: Sequence[str], samples: Sequence[Sequence[float]]) -> list[float]:
    """Clock offsets to rank 0 from hostnames and timestamps taken together (one row per round,
    one column per rank): 0 on rank 0's host, else the host's median of ``t_r - t_0``."""
    offsets: dict[str, float] = {hosts[0]: 0.0}
    for host in dict.fromkeys(hosts):
        if host not in offsets:
            ranks = [r for r, h in enumerate(hosts) if h == host]
            offsets[host] = statistics.median(row[r] - row[0] for row in samples for r in ranks)
    return [offsets[h] for h in hosts]
