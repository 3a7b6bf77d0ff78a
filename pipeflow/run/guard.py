"""Guards around a run: every rank starts from the same config and pipeline, and a failed rank
reports the job's first failure and leaves at once instead of hanging.

* :func:`check_same_config` / :func:`check_same_program`: one small all-gather each at start-up.
* :func:`fail`: log, record the first failure in the rendezvous store, ``os._exit(1)``.
* :func:`watch_for_failures`: a rank that is not in a transfer leaves once another has failed.

Naming where a failure happened (stage, micro-batch, transfer) is the runtime's
(:mod:`pipeflow.runtime.failures`).
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch.distributed as dist
from omegaconf import OmegaConf

from pipeflow.errors import (
    AllTargetsMaskedError, CheckpointError, ConfigError, ConfigMismatchError, JoinTimeoutError, LaunchError,
    NonFiniteError, RunDirLockedError, ScheduleError,
)
from pipeflow.runtime import failures

from pipeflow.runtime.world import hosts
log = logging.getLogger("pipeflow")

FAILURE_COUNT_KEY = "pipeflow/failures"
FIRST_FAILURE_KEY = "pipeflow/first_failure"
MAX_LISTED_KEYS = 20
# Keys that may differ between ranks: rank 0's run directory is broadcast to all (a ${now:}
# in it resolves per rank, possibly a second apart).
AGREEMENT_IGNORES = ("train.run_dir",)


# ------------------------------------------------------------------------ config agreement
def flatten_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as ``{"pipeline.num_microbatches": 8, ...}`` (lists stay values)."""
    tree = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(tree, "")
    return flat


def config_hash(flat: Mapping[str, Any]) -> str:
    """A short stable digest of a flattened config."""
    text = json.dumps(flat, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _ranks_by_digest(per_rank: Sequence[tuple[str, Any]]) -> dict[str, list[int]]:
    """The ranks holding each digest, in order of first appearance."""
    holders: dict[str, list[int]] = {}
    for rank, (digest, _) in enumerate(per_rank):
        holders.setdefault(digest, []).append(rank)
    return holders


def _gather_if_different(digest: str, payload: Any, group: dist.ProcessGroup | None) -> list[tuple[str, Any]] | None:
    """All-gather every rank's (digest, payload) (one collective); None when all digests agree."""
    size = dist.get_world_size(group)
    if size == 1:
        return None
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, (digest, payload), group=group)
    return gathered if len({d for d, _ in gathered}) > 1 else None


def config_differences(per_rank: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Text listing every key whose value differs between ranks, and which ranks hold which value.

    Args:
        per_rank: (config hash, flattened config) of every rank, by rank.
    """
    keys = sorted(set().union(*(flat.keys() for _, flat in per_rank)))
    lines = []
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank, (_, flat) in enumerate(per_rank):
            value = json.dumps(flat[key], default=str) if key in flat else "(absent)"
            holders.setdefault(value, []).append(rank)
        if len(holders) > 1:
            lines.append(f"  {key}: " + "; ".join(f"{value} on {_ranks(r)}" for value, r in holders.items()))
    shown = lines[:MAX_LISTED_KEYS] + ([f"  ... and {len(lines) - MAX_LISTED_KEYS} more keys"] if len(lines) > MAX_LISTED_KEYS else [])
    hashes = "; ".join(f"{digest} on {_ranks(r)}" for digest, r in _ranks_by_digest(per_rank).items())
    return "\n".join([f"config hashes: {hashes}", *shown])


def check_same_config(cfg: Any, group: dist.ProcessGroup | None = None) -> str:
    """Check that every rank of `group` resolved the same config (one all-gather); returns its hash.

    Raises:
        ConfigMismatchError: on every rank, listing the differing keys and each rank's value.
    """
    flat = {k: v for k, v in flatten_config(cfg).items() if k not in AGREEMENT_IGNORES}
    digest = config_hash(flat)
    gathered = _gather_if_different(digest, flat, group)
    if gathered is not None:
        raise ConfigMismatchError(
            "the ranks were started with different configs; launch every rank with the same "
            "overrides (and the same config files):\n" + config_differences(gathered)
        )
    return digest


# ----------------------------------------------------------------------- program agreement
def program_summary(schedule: Any, ranges: Sequence[range]) -> str:
    """One line naming what every rank must agree on: schedule, placement, actions, partition."""
    actions = " | ".join(" ".join(map(str, acts)) for acts in schedule.actions)
    spans = [(r.start, r.stop) for r in ranges]
    return (
        f"schedule {schedule.name} p={schedule.num_ranks} stages={schedule.num_stages} "
        f"m={schedule.num_microbatches} stage_to_rank={list(schedule.stage_to_rank)} "
        f"layers per stage={spans} actions: {actions}"
    )


def check_same_program(schedule: Any, ranges: Sequence[range], group: dist.ProcessGroup | None = None) -> str:
    """Check that every rank built the same schedule and partition (one all-gather); returns its hash.

    Each rank builds them itself (a custom schedule file, profiled balance), so a file that
    differs between nodes would otherwise give ranks programs that do not pair up.

    Raises:
        ScheduleError: naming which ranks built which schedule.
    """
    summary = program_summary(schedule, ranges)
    digest = hashlib.sha256(summary.encode()).hexdigest()[:12]
    gathered = _gather_if_different(digest, summary, group)
    if gathered is not None:
        listed = "\n".join(f"  {_ranks(r)}: {gathered[r[0]][1][:600]}" for r in _ranks_by_digest(gathered).values())
        raise ScheduleError(
            "the ranks built different pipelines, so their programs would not pair up. Is the "
            "schedule.path file the same on every node? Does the partition depend on a "
            "per-node measurement?\n" + listed
        )
    return digest


# ----------------------------------------------------------------------------- failing fast
# errors whose message says everything (no traceback logged)
# failures whose message names the place and the fix: one line, no traceback (a NaN's step and
# stage, a batch with nothing to learn from)
MESSAGE_SAYS_ALL = (ConfigError, ScheduleError, CheckpointError, RunDirLockedError, JoinTimeoutError, LaunchError,
                    NonFiniteError, AllTargetsMaskedError)
# words of a failure that only saw a peer go away (its connection closed or reset; a save's own
# wording, pipeflow.checkpoint.saving)
LOST_PEER_SIGNS = (*failures.CONNECTION_LOST_SIGNS, "a peer stopped taking part")
UNKNOWN_FIRST = "not known: "  # a failure watch that lost the store: no record to read


def first_failure_note(first: str) -> str:
    """How a rank names the job's first recorded failure `first` (``rank R: Type: message``).

    A rank that dies outright (SIGKILL, a native crash) records nothing; the first record is then
    a survivor's that only saw its connection go.  Such a record is named as what it is, not as
    the job's root cause.
    """
    if first.startswith(UNKNOWN_FIRST):
        return f"the job's first failure is not known here: {first.removeprefix(UNKNOWN_FIRST)}"
    if not any(sign in first for sign in LOST_PEER_SIGNS):
        return f"the first failure in this job was {first}"
    return (f"the first failure recorded in this job was {first}; that rank had only lost a peer, so the rank "
            f"that failed first ended without a record (killed, or died in native code): the launcher's report "
            f"(its exitcode lines) names it")


def failure_summary(exc: BaseException, rank: int, limit: int = 2000) -> str:
    """``rank R: Type: message`` (the message cut to `limit` characters)."""
    text = str(exc)
    text = text if len(text) <= limit else text[:limit] + " ..."
    return f"rank {rank}: {type(exc).__name__}: {text}"


def record_failure(exc: BaseException, rank: int, store: Any = None, wait_s: float = 2.0) -> str | None:
    """Record this rank's failure in the rendezvous store; return the first failure if another rank's.

    The first rank to fail writes its summary; the ranks that fail after it (a peer's
    connection closed, a deadline passed) read it back, so every log names the root cause.
    Never raises, and returns within about ``2 * wait_s``: when the store is unreachable, or its
    host (rank 0, when no launcher hosts it) is stopped, on which a store call blocks without
    end, the failure is simply not shared.
    """
    found: list[str | None] = []
    thread = threading.Thread(target=lambda: found.append(_record(exc, rank, store, wait_s)),
                              name="pipeflow-record-failure", daemon=True)
    thread.start()
    thread.join(2 * wait_s)
    return found[0] if found else None


def _record(exc: BaseException, rank: int, store: Any, wait_s: float) -> str | None:
    """:func:`record_failure`'s store calls (they may block for good on a stopped store host)."""
    try:
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        if store.add(FAILURE_COUNT_KEY, 1) == 1:
            store.set(FIRST_FAILURE_KEY, failure_summary(exc, rank))
            return None
        store.wait([FIRST_FAILURE_KEY], datetime.timedelta(seconds=wait_s))
        return store.get(FIRST_FAILURE_KEY).decode()
    except Exception:  # noqa: BLE001 - reporting must never hide the real error
        return None


def watch_for_failures(
    rank: int, poll_s: float = 1.0, store: Any = None, stop: threading.Event | None = None
) -> threading.Thread:
    """Leave (exit 1) within about `poll_s` once another rank has recorded the job's first
    failure, or once the rendezvous store is gone (its host, rank 0 or the launcher, died), until
    `stop` is set (set it when training is over: at a normal end the store goes away too).

    A rank that is not waiting on a transfer (stuck in a long computation, or hand-launched
    without torchrun to stop it) would otherwise outlive the failed job.
    """
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    stop = stop if stop is not None else threading.Event()

    beat = heartbeat_key(rank)

    def watch() -> None:
        while not stop.wait(poll_s):
            try:
                if beat is not None:
                    store.add(beat, 1)
                if not store.check([FIRST_FAILURE_KEY]):
                    continue
                first = store.get(FIRST_FAILURE_KEY).decode()
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: so is the job
                if stop.is_set():
                    return
                first = f"{UNKNOWN_FIRST}the rendezvous store is gone ({type(exc).__name__}); its host (rank 0 or the launcher) ended"
            if first.startswith(f"rank {rank}:") or _FAILING.is_set():  # fail() is ending this rank
                return
            log.error("rank %d: leaving because the job failed elsewhere; %s", rank, first_failure_note(first))
            _say_lost_hosts(rank, store)
            _flush()
            os._exit(1)

    thread = threading.Thread(target=watch, name="pipeflow-failure-watch", daemon=True)
    thread.start()
    return thread


_FAILING = threading.Event()  # set by fail(): the failure watch leaves the ending to it
HEARTBEAT_PREFIX = "pipeflow/alive/"  # + a host's first global rank: a count its failure watch raises every poll
LOST_PROBE_S = 2.5  # how long a failing rank watches the other hosts' heartbeats (two polls and a half)


def heartbeat_key(rank: int) -> str | None:
    """The heartbeat this rank keeps for its host (the first rank of each host keeps one), on
    several hosts only; else None."""
    table = hosts.table()
    if len(table.hosts) < 2:
        return None
    mine = table.host_of(rank)
    return f"{HEARTBEAT_PREFIX}{mine[2][0]}" if mine is not None and mine[2][0] == rank else None


def lost_hosts(rank: int, store: Any = None, probe_s: float = LOST_PROBE_S) -> str | None:
    """On several hosts: which hosts stopped answering (their heartbeats did not move over
    `probe_s`), as a line naming each with its address and global ranks; a line saying this
    host is cut off when the store cannot be reached; None on one host or when all answer.
    Never raises; returns within about ``2 * probe_s``."""
    table = hosts.table()
    if len(table.hosts) < 2:
        return None
    found: list[str] = []

    def probe() -> None:
        try:
            st = store if store is not None else dist.distributed_c10d._get_default_store()
            keys = [f"{HEARTBEAT_PREFIX}{ranks[0]}" for _, _, ranks in table.hosts]
            beat, mine = heartbeat_key(rank), table.host_of(rank)
            before = [st.add(k, 0) for k in keys]
            for _ in range(2):  # this host's heartbeat goes on while its keeper probes
                if beat is not None:
                    st.add(beat, 1)
                time.sleep(probe_s / 2)
            after = [st.add(k, 0) for k in keys]
            gone = [(name, bind, ranks) for (name, bind, ranks), a, b in zip(table.hosts, before, after)
                    if a == b and (name, bind, ranks) != mine]
            if gone:
                found.append("lost host" + ("s " if len(gone) > 1 else " ") + "; ".join(
                    f"{name} ({bind}, global ranks {hosts.rank_ranges(ranks)})" for name, bind, ranks in gone)
                    + f": no heartbeat for {probe_s:g} s (its processes died, or its network is cut off)")
        except Exception as exc:  # noqa: BLE001 - reporting must never hide the real error
            mine = table.host_of(rank)
            found.append(f"the rendezvous store cannot be reached from host {mine[0] if mine else '?'} "
                         f"({type(exc).__name__}): this host is cut off, or the store's host is lost")
    thread = threading.Thread(target=probe, name="pipeflow-lost-hosts", daemon=True)
    thread.start()
    thread.join(2 * probe_s)
    return found[0] if found else None


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def named_failure(exc: BaseException) -> BaseException:
    """`exc`, or for a backend's raw failure of a collective (gloo's ``RuntimeError``) a
    ``CommError`` naming the collective by the code that called it, caused by `exc`."""
    if not failures.is_backend_failure(exc):
        return exc
    named = failures.collective_failure(exc, failures.called_collective(exc.__traceback__))
    named.__cause__ = exc
    return named


def leave(code: int) -> NoReturn:
    """Flush the logs and end this process with `code` at once, skipping the interpreter's
    finalization (which a thread still inside a store or group call would turn into an abort)."""
    _flush()
    os._exit(code)


def fail(exc: BaseException, rank: int) -> NoReturn:
    """Log `exc`, share it as the job's first failure if it is, and end this process with status 1.

    The process group is not torn down: with peers stuck in (or waiting for) a transfer,
    destroying it can block (NCCL) or abort the peers with an unrelated message (gloo).
    ``os._exit`` closes this rank's connections, so peers fail fast, and torchrun stops the rest.
    A backend's raw failure of a collective that reached here unnamed (outside a training step)
    is logged and shared as a named ``CommError`` (:func:`pipeflow.runtime.failures.collective_failure`).
    """
    _FAILING.set()
    exc = named_failure(exc)
    first = record_failure(exc, rank)
    if isinstance(exc, MESSAGE_SAYS_ALL):
        log.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
    else:
        log.error("rank %d failed with %s; its traceback ends with the message:", rank, type(exc).__name__, exc_info=exc)
    if first is not None:
        log.error("rank %d: %s", rank, first_failure_note(first))
    if failures.is_peer_failure(exc):
        _say_lost_hosts(rank)
    _flush()
    os._exit(1)


def _say_lost_hosts(rank: int, store: Any = None) -> None:
    """Log :func:`lost_hosts` (on several hosts).  While it watches, a SIGTERM (the launcher
    stopping the workers that are left) is ignored: this process ends right after anyway."""
    if len(hosts.table().hosts) < 2:
        return
    with contextlib.suppress(ValueError):  # not the main thread: then the launcher may end it first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lost = lost_hosts(rank, store)
    if lost is not None:
        log.error("rank %d: %s", rank, lost)
    if rank == 0:  # it may host the store: the others' probes, started a little later, still need it
        _flush()
        time.sleep(LOST_PROBE_S / 2)
