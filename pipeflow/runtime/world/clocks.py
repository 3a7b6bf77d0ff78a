"""Clocks across ranks: every rank's ``time.perf_counter`` on rank 0's time axis, and the hosts'
wall clocks compared at start.

Each rank times its events with its own ``perf_counter`` (the monotonic clock): processes that
share a boot and a time namespace share that clock, but on several machines each counts from its
own boot.  Whatever compares times recorded on different ranks (the trace, the in-run
calibration, the rehearsal) first subtracts each rank's offset from :func:`clock_offsets`.  Ranks
are grouped by their clock's identity (:func:`clock_identity`: host name, machine and time
namespace), never by host name alone: containers and cloned images often share a name.

Wall clocks (``time.time``) are compared once, when the process group exists
(:func:`check_wall_clocks`): torchrun's rendezvous compares the agents' wall-clock heartbeats, so
hosts whose clocks are apart by more than a few seconds get a warning that names them.
"""
from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.errors import ConfigError
from pipeflow.runtime.world import hosts

log = logging.getLogger("pipeflow")

# NTP keeps a cluster's clocks within milliseconds, so 2 s means a host is not synchronised; and it
# is below torchrun's tolerance with the short keep-alive the multi-node how-to suggests
# (keep_alive_interval=1 x keep_alive_max_attempt=3 = 3 s; 5 s x 3 = 15 s by default): beyond that
# an agent whose clock runs ahead takes the others' heartbeats for expired and drops them as dead.
WALL_SKEW_WARN_S = 2.0
# For tests and drills only: seconds added to this process's wall clock where it is compared with
# the other hosts' (read in one place, :func:`wall_now`); it changes nothing else.
SKEW_ENV = "PIPEFLOW_CLOCK_SKEW_S"


def clock_identity() -> str:
    """This process's monotonic clock: ``<host name> <boot id>/net:<inode> time:<inode>``; equal
    for every rank that reads the same ``perf_counter``."""
    try:
        time_ns = os.stat("/proc/self/ns/time").st_ino
    except OSError:
        time_ns = 0
    return f"{socket.gethostname()} {hosts.machine_id()} time:{time_ns}"


def clock_offsets(device: torch.device | str | None = None, rounds: int = 7) -> list[float]:
    """Every rank's ``perf_counter`` minus rank 0's (seconds).  Collective over the default group.

    Ranks that share rank 0's clock (:func:`clock_identity`) get 0 exactly; every other clock gets
    the median of `rounds` barrier-then-timestamp exchanges over all its ranks (see
    :func:`host_offsets`).

    Args:
        device: where the timestamps travel (the backend's device); None: as Python objects.
        rounds: exchanges when the ranks read several clocks.
    """
    world = dist.get_world_size()
    clocks: list[Any] = [None] * world
    dist.all_gather_object(clocks, clock_identity())
    samples = [_stamps(world, device) for _ in range(rounds if len(set(clocks)) > 1 else 0)]
    return host_offsets(clocks, samples)


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
    """Clock offsets to rank 0 from clock identities (or host names) and timestamps taken together
    (one row per round, one column per rank): 0 on rank 0's clock, else its median of ``t_r - t_0``."""
    offsets: dict[str, float] = {hosts[0]: 0.0}
    for host in dict.fromkeys(hosts):
        if host not in offsets:
            ranks = [r for r, h in enumerate(hosts) if h == host]
            offsets[host] = statistics.median(row[r] - row[0] for row in samples for r in ranks)
    return [offsets[h] for h in hosts]


def wall_now() -> float:
    """``time.time()``, plus :data:`SKEW_ENV` seconds where that drill variable is set.

    Raises:
        ConfigError: the variable is not a number of seconds.
    """
    text = os.environ.get(SKEW_ENV, "")
    try:
        return time.time() + (float(text) if text else 0.0)
    except ValueError:
        raise ConfigError(f"{SKEW_ENV}={text!r} (a test and drill setting) must be a number of seconds, "
                          f"e.g. 5 or -60; unset it for a real run") from None


@dataclass(frozen=True)
class WallSkew:
    """One host's wall clock against rank 0's host's."""

    host: str  # what messages call it (:func:`pipeflow.runtime.world.hosts.host_labels`)
    ranks: tuple[int, ...]  # its global ranks
    offset_s: float  # its clock minus rank 0's host's (> 0: ahead)
    bound_s: float  # the measurement is good to ± this (the slowest rank's measured round trip)


def wall_skews(stamps: Sequence[tuple[str, str, float, float]]) -> list[WallSkew]:
    """Every host's wall clock against rank 0's host's, from each rank's (host name, machine, wall
    clock read just after a barrier, that barrier's round trip), by global rank; rank 0's host first."""
    infos = [hosts.HostInfo(name, machine, "", "") for name, machine, _, _ in stamps]
    labels = hosts.host_labels(infos)
    bound = max(rtt for *_, rtt in stamps)
    found = []
    for machine, label in labels.items():
        ranks = tuple(r for r, info in enumerate(infos) if info.machine == machine)
        offset = statistics.median(stamps[r][2] - stamps[0][2] for r in ranks)
        found.append(WallSkew(label, ranks, 0.0 if 0 in ranks else offset, bound))
    return found


def skew_warning(skews: Sequence[WallSkew], limit_s: float = WALL_SKEW_WARN_S) -> str | None:
    """The warning for hosts whose wall clocks are surely more than `limit_s` apart from rank 0's
    host's (beyond the measurement's bound), or None."""
    far = [s for s in skews[1:] if abs(s.offset_s) - s.bound_s > limit_s]
    if not far:
        return None
    said = "; ".join(f"host {s.host} (global ranks {hosts.rank_ranges(s.ranks)}) is {abs(s.offset_s):.1f} s "
                     f"{'ahead of' if s.offset_s > 0 else 'behind'} host {skews[0].host} (rank 0's)" for s in far)
    return (f"the hosts' wall clocks disagree by more than {limit_s:g} s: {said} (measured at start to within "
            f"±{far[0].bound_s * 1000:.0f} ms). torchrun's rendezvous compares the agents' wall-clock heartbeats: "
            f"an agent whose clock runs ahead by more than keep_alive_interval x keep_alive_max_attempt (5 s x 3 by "
            f"default) takes the others for dead, so at the next rendezvous (a restart, a node joining) the agents "
            f"disagree on the world size and hang in the exit barrier, and timestamps in logs do not line up. "
            f"Synchronise the hosts' clocks with NTP (chrony or systemd-timesyncd; `chronyc tracking` shows a "
            f"host's offset)")


def check_wall_clocks() -> list[WallSkew]:
    """Compare the hosts' wall clocks once (collective over the default group: two barriers and one
    gather) and log :func:`skew_warning` on rank 0 and on the first rank of each host it names.

    Returns:
        every host's skew against rank 0's host (rank 0's host first).
    """
    dist.barrier()  # every rank is here: the next barrier takes one round trip
    start = time.perf_counter()
    dist.barrier()
    mine = (socket.gethostname(), hosts.machine_id(), wall_now(), time.perf_counter() - start)
    stamps: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stamps, mine)
    skews = wall_skews(stamps)
    warning = skew_warning(skews)
    rank = dist.get_rank()
    named = {s.ranks[0] for s in skews[1:] if abs(s.offset_s) - s.bound_s > WALL_SKEW_WARN_S}
    if warning and (rank == 0 or rank in named):
        log.warning("rank %d: %s", rank, warning)
    return skews
