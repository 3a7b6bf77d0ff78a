"""Which host each rank runs on, and whether the job's addresses can work across hosts.

When the ranks join (:func:`pipeflow.runtime.world.join.join_store`) each announces a
:class:`HostInfo`: its host name, the machine and network stack it runs in (boot id and network
namespace: two containers can share a name, two emulated hosts share a kernel), the address its
gloo sockets bind and the ``MASTER_ADDR`` it was given.  Rank 0 reads them all and checks them
(:func:`check_addresses`) before any process group exists: on several hosts, a loopback
``MASTER_ADDR`` or bind address, or two hosts binding one address, would otherwise fail later
as a connection error, or train over loopback without a word.  The table of hosts it publishes
(:class:`HostTable`) lets every error that names a peer name its host too (:func:`of_ranks`).
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pipeflow.errors import LaunchError

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class HostInfo:
    """What one rank announces about where it runs.

    Attributes:
        name: its host name.
        machine: boot id and network namespace (``<boot id>/net:<inode>``): one per host, even
            where names repeat.
        bind: the address its gloo sockets bind (what peers connect to).
        master: the ``MASTER_ADDR`` it was given.
    """

    name: str
    machine: str
    bind: str
    master: str

    def to_json(self) -> str:
        """The announcement's text."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> HostInfo:
        """An announcement read back (an older one, ``host:pid``, as a host of unknown machine)."""
        text = text.decode() if isinstance(text, bytes) else text
        try:
            return HostInfo(**json.loads(text))
        except (ValueError, TypeError):
            return HostInfo(text.rpartition(":")[0] or text, "?", "?", "?")


def interface_addresses() -> dict[str, str]:
    """This host's IPv4 addresses by interface name (``{"eth0": "10.0.0.2", "lo": "127.0.0.1"}``)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                found[name] = socket.inet_ntoa(packed[20:24])
    return found


def gloo_bind_address(env: dict[str, str] | os._Environ = os.environ) -> str:
    """The address gloo's sockets bind on this host: ``GLOO_SOCKET_IFNAME``'s (first) interface's,
    else what the host name resolves to, else loopback (gloo's own fallback)."""
    names = env.get("GLOO_SOCKET_IFNAME")
    if names:
        return interface_addresses().get(names.split(",")[0], "?")
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def machine_id() -> str:
    """``<boot id>/net:<network namespace inode>``: the same for every rank of one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{boot}/net:{net}"


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity; every core where that is unknown)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def host_labels(infos: Sequence[HostInfo]) -> dict[str, str]:
    """What a message calls each machine of `infos` (in order of their first rank): its host name,
    or ``node (machine <boot id>/net:<inode>)`` where several machines share that name."""
    first: dict[str, HostInfo] = {}
    for info in infos:
        first.setdefault(info.machine, info)
    counts: dict[str, int] = {}
    for info in first.values():
        counts[info.name] = counts.get(info.name, 0) + 1
    return {machine: info.name if counts[info.name] == 1 else f"{info.name} (machine {machine})"
            for machine, info in first.items()}


def this_host() -> HostInfo:
    """This rank's announcement."""
    return HostInfo(socket.gethostname(), machine_id(), gloo_bind_address(), os.environ.get("MASTER_ADDR", "127.0.0.1"))


def connect_failure(host: str, port: int, timeout_s: float) -> OSError | None:
    """Why a TCP connection to `host`:`port` failed within `timeout_s` (a ``TimeoutError``, a
    ``socket.gaierror`` for a name that does not resolve, or the ``OSError`` with its errno), or
    None when something accepted it (closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP, or a name as this host resolves it) is a loopback address; a
    name that does not resolve is not."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
        except OSError:
            return False


def check_addresses(infos: Sequence[HostInfo], gloo: bool = True) -> None:
    """On several hosts: raise where the ranks' addresses cannot work (rank 0, before any group).

    Args:
        infos: every rank's announcement, by global rank.
        gloo: the backend is gloo (whose bind address is checked; NCCL picks its own interface).

    Raises:
        LaunchError: ``MASTER_ADDR`` is loopback, a host's ranks bind a loopback address, or two
            hosts bind the same address; naming the hosts, the addresses and the fix.
    """
    machines: dict[str, list[int]] = {}
    for rank, info in enumerate(infos):
        machines.setdefault(info.machine, []).append(rank)
    if len(machines) < 2 or any(info.machine == "?" for info in infos):
        return
    labels = host_labels(infos)
    names = ", ".join(labels.values())
    fix = ("launch each node with examples/multinode.sh (python -m pipeflow.launch finds the address and "
           "interface itself), or pass torchrun --local-addr <this node's address> and set GLOO_SOCKET_IFNAME "
           "and NCCL_SOCKET_IFNAME to the interface between the hosts")
    if is_loopback(infos[0].master):
        raise LaunchError(f"the job spans {len(machines)} hosts ({names}), but MASTER_ADDR={infos[0].master} is a "
                          f"loopback address that only its own host reaches; {fix}")
    if not gloo:
        return
    binds: dict[str, set[str]] = {}
    for machine, ranks in machines.items():
        info = infos[ranks[0]]
        if is_loopback(info.bind):
            how = (f"GLOO_SOCKET_IFNAME names an interface with address {info.bind}" if info.bind != "127.0.0.1"
                   else f"its host name {info.name!r} resolves to {info.bind} (or not at all), and gloo binds that")
            raise LaunchError(f"the job spans {len(machines)} hosts ({names}), but the ranks on host {labels[machine]} "
                              f"(global ranks {rank_ranges(ranks)}) would talk over loopback: {how}; {fix}")
        binds.setdefault(info.bind, set()).add(f"{labels[machine]} (global ranks {rank_ranges(ranks)})")
    shared = {address: hosts for address, hosts in binds.items() if len(hosts) > 1}
    if shared:
        address, hosts = next(iter(shared.items()))
        raise LaunchError(f"the hosts {', '.join(sorted(hosts))} all bind address {address}, so their ranks cannot "
                          f"tell each other apart; {fix}")


def rank_ranges(ranks: Sequence[int]) -> str:
    """``0-3, 8`` for [0, 1, 2, 3, 8]."""
    parts, start = [], None
    ordered = sorted(ranks)
    for i, rank in enumerate(ordered):
        start = rank if start is None else start
        if i + 1 == len(ordered) or ordered[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


@dataclass(frozen=True)
class HostTable:
    """The job's hosts: each with its address and its global ranks (published by rank 0)."""

    hosts: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    @staticmethod
    def of(infos: Sequence[HostInfo]) -> HostTable:
        """The table of `infos` (by global rank), hosts in order of their first rank, each named as
        :func:`host_labels` says (with its machine where several share a name)."""
        labels = host_labels(infos)
        by_machine: dict[str, tuple[str, str, list[int]]] = {}
        for rank, info in enumerate(infos):
            by_machine.setdefault(info.machine, (labels[info.machine], info.bind, []))[2].append(rank)
        return HostTable(tuple((name, bind, tuple(ranks)) for name, bind, ranks in by_machine.values()))

    def to_json(self) -> str:
        """The table's text (ranks as ``first-last`` runs: a host's ranks are usually consecutive)."""
        return json.dumps([[name, bind, rank_ranges(ranks)] for name, bind, ranks in self.hosts])

    @staticmethod
    def from_json(text: str | bytes) -> HostTable:
        """A table read back from :meth:`to_json`."""
        rows = json.loads(text.decode() if isinstance(text, bytes) else text)
        hosts = []
        for name, bind, runs in rows:
            ranks: list[int] = []
            for run in filter(None, runs.split(", ")):
                first, _, last = run.partition("-")
                ranks.extend(range(int(first), int(last or first) + 1))
            hosts.append((name, bind, tuple(ranks)))
        return HostTable(tuple(hosts))

    def host_of(self, rank: int) -> tuple[str, str, tuple[int, ...]] | None:
        """(name, address, ranks) of the host that runs global `rank`, or None."""
        return next((host for host in self.hosts if rank in host[2]), None)


_TABLE = HostTable()


def remember(table: HostTable) -> None:
    """Keep the job's host table for the messages of this process."""
    global _TABLE
    _TABLE = table


def table() -> HostTable:
    """The job's host table (empty before the join, or in a single process)."""
    return _TABLE


def of_ranks(ranks: Sequence[int]) -> str:
    """`` (on host host1, which runs global ranks 2-3)`` for the global `ranks` a message names
    (several hosts listed where they differ); empty where the job is on one host or unknown."""
    if len(_TABLE.hosts) < 2:
        return ""
    found = [h for h in _TABLE.hosts if any(r in h[2] for r in ranks)]
    if not found:
        return ""
    said = "; ".join(f"host {name} ({bind}), which runs global ranks {rank_ranges(rs)}" for name, bind, rs in found)
    return f" (on {said})"


_ADDRESS = re.compile(r"\[?(\d+\.\d+\.\d+\.\d+)\]?:\d+")


def of_addresses(text: str) -> str:
    """The hosts whose addresses a backend's message names (``[10.0.0.2]:4321``), as
    `` (10.0.0.2 is host host1, which runs global ranks 2-3)``; empty where none is known."""
    if len(_TABLE.hosts) < 2:
        return ""
    said = []
    for address in dict.fromkeys(_ADDRESS.findall(text)):
        host = next((h for h in _TABLE.hosts if h[1] == address), None)
        if host is not None:
            said.append(f"{address} is host {host[0]}, which runs global ranks {rank_ranges(host[2])}")
    return f" ({'; '.join(said)})" if said else ""
