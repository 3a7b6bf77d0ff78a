"""Joining the rendezvous store under one deadline: every rank announces itself (where it runs)
and waits at most ``comm.join_timeout_s`` for the others (:func:`join_store`), so a rank that
died before joining is a :class:`~pipeflow.errors.JoinTimeoutError` naming it, not a hang for
the process-group deadline.  :func:`pipeflow.runtime.world.distributed.init_distributed` calls it.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import time
import uuid

import torch.distributed as dist

from pipeflow.errors import ConfigError, JoinTimeoutError, LaunchError, PipeflowError
from pipeflow.runtime.world import hosts as hosts_of_job
from pipeflow.runtime.failures import first_line

log = logging.getLogger("pipeflow")

JOIN_POLL_S = 0.2
VERDICT_READ_S = 3.0  # how long rank 0 waits for the others to read the join's error before it leaves
DEFAULT_JOIN_TIMEOUT_S = 900.0  # no comm.join_timeout_s given
CONNECT_ATTEMPT_S = 2.0  # one connect attempt to the store's host (an unanswered SYN)
MIN_CONNECT_S = 1.0  # the store's own connect timeout once its host listens


def _agent_serves(addr: str, port: int) -> bool:
    """Whether torchrun's agent hosts the store at addr:port (then every rank is a client)."""
    from torch.distributed import rendezvous

    serves = getattr(rendezvous, "_agent_store_serves", None)
    if serves is not None:
        return bool(serves(addr, port))
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def join_store(rank: int, world: int, timeout_s: float | None, backend: str = "gloo") -> dist.Store:
    """The rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts it unless torchrun's
    agent does), once every rank has announced itself there.

    One deadline, `timeout_s` from the call, bounds the whole join on every rank: reaching the
    store (a client waits for its host to listen, polling, rather than letting the store's
    client retry with the whole timeout per attempt, which waited about twice as long) and
    then waiting for the other ranks' announcements (each says where it runs:
    :class:`~pipeflow.runtime.world.hosts.HostInfo`), and for rank 0's check of their addresses
    across hosts, whose table of hosts every rank keeps for its messages.

    Raises:
        ConfigError: `timeout_s` is not a finite number of seconds > 0 (``comm.join_timeout_s``).
        JoinTimeoutError: the store cannot be reached or hosted, or some ranks never announced
            themselves; the message gives the deadline and the seconds this rank waited.
        LaunchError: on several hosts, an address that cannot work (loopback, or shared).
    """
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    budget = timeout_s if timeout_s is not None else DEFAULT_JOIN_TIMEOUT_S
    if not 0 < budget < float("inf"):  # else every rank would blame a peer for a deadline that never was
        raise ConfigError(f"comm.join_timeout_s={budget} must be a finite number of seconds > 0 (default 120)")
    started = time.monotonic()
    deadline = started + budget
    where = f"the rendezvous store at {addr}:{port}"
    agent = _agent_serves(addr, port)
    hosts = rank == 0 and not agent
    if not hosts and not _await_listener(addr, port, deadline):
        raise JoinTimeoutError(
            f"rank {rank}: could not reach {where} within comm.join_timeout_s={budget:g} s (waited "
            f"{time.monotonic() - started:.1f} s): {_absent_host(agent)}, or raise comm.join_timeout_s"
        )
    store = _open_store(addr, port, world, hosts, max(deadline - time.monotonic(), MIN_CONNECT_S), rank, where)
    meeting = _Meeting(store, rank, world, deadline, started, budget, where, addr)
    try:
        epoch, table = meeting.open(backend == "gloo") if rank == 0 else meeting.join()
    except PipeflowError:
        raise
    except (RuntimeError, ValueError) as exc:  # the store's host went away while this rank waited
        raise JoinTimeoutError(
            f"rank {rank}: {where} went away while waiting for the other ranks to join (after "
            f"{time.monotonic() - started:.1f} s): its host (rank 0 or torchrun's agent) died; "
            f"{first_line(exc)}"
        ) from exc
    hosts_of_job.remember(table)
    return dist.PrefixStore(f"pipeflow/{epoch}", store)


def _loopback_master_note(addr: str) -> str:
    """A hint for a join that failed while several agents were launched and MASTER_ADDR is loopback."""
    several = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) < int(os.environ.get("WORLD_SIZE", "1"))
    if not (several and os.environ.get("LOCAL_WORLD_SIZE") and hosts_of_job.is_loopback(addr)):
        return ""
    return (f"; MASTER_ADDR={addr} is a loopback address: ranks on other hosts cannot reach it (launch every node "
            f"with examples/multinode.sh, or pass torchrun --local-addr <node 0's address>)")


def _leaving() -> None:
    """This rank leaves with the join's error in a moment: a launcher's SIGTERM, sent as soon as
    the first of its node's workers has left, must not end it before it has said why."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Meeting:
    """The join's protocol in the rendezvous store, under one deadline.

    Rank 0 opens an *epoch* (a fresh random id) under ``pipeflow/join/<run id>/epoch``; every other
    rank acknowledges the epoch it reads there with a token of its own process and its
    :class:`~pipeflow.runtime.world.hosts.HostInfo`, again whenever the epoch changes; once every rank
    has acknowledged its epoch, rank 0 checks their addresses across hosts and confirms each
    rank's token.  A rank joined when rank 0 confirmed *its* token, so keys left by an earlier
    attempt of a restarted job (a store torchrun's agent keeps across restarts, whose agents count
    their restarts each on their own: pytorch#135712) are never taken for this one's; every key
    the job writes later lives under the epoch (:func:`join_store` returns that prefix).
    """

    def __init__(self, store: dist.Store, rank: int, world: int, deadline: float, started: float, budget: float,
                 where: str, addr: str) -> None:
        self.store, self.rank, self.world, self.deadline = store, rank, world, deadline
        self.started, self.budget, self.where, self.addr = started, budget, where, addr
        self.base = f"pipeflow/join/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
        self.token = f"{uuid.uuid4().hex}"

    def _key(self, epoch: str, what: str) -> str:
        return f"{self.base}{epoch}/{what}"

    def _waited(self) -> str:
        return f"waited {time.monotonic() - self.started:.1f} s"

    def open(self, gloo: bool) -> tuple[str, hosts_of_job.HostTable]:
        """Rank 0: open the epoch, wait for every rank's acknowledgement, check and confirm.

        Raises:
            JoinTimeoutError: ranks that never acknowledged by the deadline (named).
            LaunchError: addresses that cannot work across the hosts (every rank raises it too).
        """
        epoch = uuid.uuid4().hex
        self.store.set(f"{self.base}epoch", epoch)
        acks = [self._key(epoch, f"ack/{r}") for r in range(1, self.world)]
        while self.store.add(self._key(epoch, "acks"), 0) < self.world - 1 and time.monotonic() < self.deadline:
            time.sleep(min(JOIN_POLL_S, max(0.0, self.deadline - time.monotonic())))
        present = [self.store.check([key]) for key in acks]
        missing = [r for r, here in enumerate(present, start=1) if not here]
        if missing:
            heard = [json.loads(v)["token"] for v in self.store.multi_get([k for k, h in zip(acks, present) if h])]
            text = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {self.world} never "
                    f"joined the process group within comm.join_timeout_s={self.budget:g} s ({self._waited()}; "
                    f"{self.where}); start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and look "
                    f"at why those ranks died or did not start{_loopback_master_note(self.addr)}")
            self.store.set(self._key(epoch, "hosts"), json.dumps({"error": text, "kind": "JoinTimeoutError",
                                                                  "heard": heard}))
            self._await_readers(epoch, len(heard))
            raise JoinTimeoutError(f"rank 0: {text}")  # no local holds it: its frame would keep the store alive
        answers = [json.loads(v) for v in self.store.multi_get(acks)] if acks else []
        infos = [hosts_of_job.this_host(), *(hosts_of_job.HostInfo.from_json(a["host"]) for a in answers)]
        try:
            hosts_of_job.check_addresses(infos, gloo=gloo)
            table = hosts_of_job.HostTable.of(infos)
            verdict = {"table": table.to_json()}
        except LaunchError as exc:
            table, verdict = None, {"error": str(exc), "kind": "LaunchError", "heard": [a["token"] for a in answers]}
        self.store.set(self._key(epoch, "hosts"), json.dumps(verdict))
        if table is None:  # every other rank reads the error in place of its confirmation
            self._await_readers(epoch, len(answers))
            raise LaunchError(f"rank 0: {verdict['error']}")
        if answers:
            self.store.multi_set([self._key(epoch, f"ok/{r}") for r in range(1, self.world)], [a["token"] for a in answers])
        return epoch, table

    def _await_readers(self, epoch: str, count: int) -> None:
        """Before raising the join's error: wait (at most :data:`VERDICT_READ_S`) until the `count`
        ranks rank 0 heard from have read it, so that all leave together and each names it (a
        launcher stops a node's other workers as soon as one exits)."""
        if count == 0:  # no one else to wait for
            return
        _leaving()
        until = time.monotonic() + VERDICT_READ_S
        while self.store.add(self._key(epoch, "read"), 0) < count and time.monotonic() < until:
            time.sleep(JOIN_POLL_S / 4)

    def join(self) -> tuple[str, hosts_of_job.HostTable]:
        """Every other rank: acknowledge rank 0's epoch (again when it changes) until confirmed.

        Raises:
            JoinTimeoutError: rank 0 never opened an epoch, or never confirmed this rank, or named
                ranks that never joined.
            LaunchError: rank 0 found addresses that cannot work across the hosts.
        """
        acked, answer = None, json.dumps({"token": self.token, "host": hosts_of_job.this_host().to_json()})
        grace = self.deadline + 2 * JOIN_POLL_S + 1.0  # rank 0 names the missing ranks at its own deadline
        while time.monotonic() < grace:
            if self.store.check([f"{self.base}epoch"]):
                epoch = self.store.get(f"{self.base}epoch").decode()
                if epoch != acked:
                    self.store.set(self._key(epoch, f"ack/{self.rank}"), answer)
                    self.store.add(self._key(epoch, "acks"), 1)
                    acked = epoch
                confirmed = self._key(epoch, f"ok/{self.rank}")
                if self.store.check([confirmed]) and self.store.get(confirmed).decode() == self.token:
                    return epoch, self._table(epoch)
                if self.store.check([self._key(epoch, "hosts")]):
                    verdict = json.loads(self.store.get(self._key(epoch, "hosts")))
                    if "error" in verdict and self.token in verdict["heard"]:  # not an earlier attempt's
                        _leaving()
                        self.store.add(self._key(epoch, "read"), 1)
                        self._await_readers(epoch, len(verdict["heard"]))  # all leave together, each naming it
                        kind = LaunchError if verdict.get("kind") == "LaunchError" else JoinTimeoutError
                        raise kind(f"rank {self.rank}: {verdict['error']}")
            time.sleep(JOIN_POLL_S)
        if acked is None:
            raise JoinTimeoutError(
                f"rank {self.rank}: rank 0 never opened the join in {self.where} within comm.join_timeout_s="
                f"{self.budget:g} s ({self._waited()}): rank 0 never arrived (not started, or died first); start "
                f"rank 0 with the same MASTER_ADDR and MASTER_PORT, and look at why it did not start")
        raise JoinTimeoutError(
            f"rank {self.rank}: rank 0 did not confirm this rank in {self.where} within comm.join_timeout_s="
            f"{self.budget:g} s ({self._waited()}): rank 0 died, or waits for ranks that never joined (its own "
            f"error names them)")

    def _table(self, epoch: str) -> hosts_of_job.HostTable:
        verdict = json.loads(self.store.get(self._key(epoch, "hosts")))
        return hosts_of_job.HostTable.from_json(verdict["table"])


def _absent_host(agent: bool) -> str:
    """Who hosts the store that no one answers at, and what to do about it."""
    if agent:  # torchrun's agent hosts it for every rank, rank 0 included
        return ("torchrun's agent, which hosts it, is not listening there (it ended, or MASTER_ADDR and "
                "MASTER_PORT name another host); relaunch the job with torchrun")
    return ("rank 0, which hosts it, never arrived (not started, or died first); start rank 0 with the same "
            "MASTER_ADDR and MASTER_PORT")


def _await_listener(addr: str, port: int, deadline: float) -> bool:
    """Whether something listens at addr:port before `deadline` (``time.monotonic()``), polling
    every :data:`JOIN_POLL_S` with a plain socket (a refused or unanswered connect is retried)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((addr, port), timeout=min(left, CONNECT_ATTEMPT_S)):
                return True
        except OSError:  # refused (nobody listens yet), unreachable, or no answer in time
            time.sleep(min(JOIN_POLL_S, max(0.0, deadline - time.monotonic())))


def _open_store(addr: str, port: int, world: int, hosts: bool, timeout_s: float, rank: int, where: str) -> dist.Store:
    """Host (`hosts`) or connect to the TCPStore, with `timeout_s` for the connection and as the
    store's default timeout (:func:`init_distributed` sets the process group's after the join).

    Raises:
        JoinTimeoutError: the port is taken (host), or the host vanished since it listened (client).
    """
    try:
        return dist.TCPStore(addr, port, world, is_master=hosts, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, ValueError) as exc:
        if hosts:
            raise JoinTimeoutError(
                f"rank {rank}: could not host {where}: {first_line(exc)}; is another job using MASTER_PORT={port}? "
                f"Start the job with a free MASTER_PORT"
            ) from exc
        raise JoinTimeoutError(
            f"rank {rank}: could not join {where}: {first_line(exc)}; rank 0, which hosts it, may have died"
        ) from exc
