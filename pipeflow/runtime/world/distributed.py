"""Process-group setup: backend and device from the environment torchrun sets (or a single process).

Joining is bounded and named: every rank announces itself in the rendezvous store and waits at
most ``comm.join_timeout_s`` for the others (:func:`~pipeflow.runtime.world.join.join_store`), so a
rank that died before joining is a :class:`~pipeflow.errors.JoinTimeoutError` naming it, not a
hang for the process-group deadline.  A rank started by a launcher leaves when the launcher dies
(:func:`watch_parent`), so ``kill -9`` of torchrun leaves no workers behind.  At the end,
:func:`end_process_group` stops the threads that touch the store, waits for every rank (bounded)
and only then destroys the groups.
"""
from __future__ import annotations

import datetime
import gc
import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipeflow.errors import CommError
from pipeflow.runtime.world import hosts as hosts_of_job
from pipeflow.runtime.world.clocks import check_wall_clocks
from pipeflow.runtime.failures import first_line
from pipeflow.runtime.world.join import join_store  # noqa: F401 - also part of this module's API

log = logging.getLogger("pipeflow")

PARENT_POLL_S = 1.0
# set while a preemption save finishes (train.save_on_signal): the launcher may go first (a
# second signal ends torchrun before its 30 s grace), and its workers must not leave mid-save
_SAVING_ON_SIGNAL = threading.Event()
THREAD_JOIN_S = 5.0  # how long the teardown waits for a watcher thread to end


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def choose_device(backend: str | None, device: str | None) -> tuple[str, torch.device]:
    """(backend, device) for this rank: NCCL on ``cuda:LOCAL_RANK`` when CUDA is present, else gloo/CPU.

    Args:
        backend: ``dist.backend`` override (``nccl`` or ``gloo``), or None for automatic.
        device: ``dist.device`` override (``cpu``, ``cuda``, ``cuda:3``), or None for automatic.
    """
    if device is None:
        device = f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{local_rank()}"
    dev = torch.device(device)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    return backend, dev


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local_ranks(target: Callable[..., None], world: int, args: tuple, timeout_s: float) -> Any:
    """Run ``target(rank, port, results, *args)`` in `world` spawned processes on this host and
    return the first object one of them puts on the queue `results` (rank 0's answer, by the
    callers' convention).  `port` is a free local port for their ``tcp://`` rendezvous.

    Raises:
        RuntimeError: a process exited with an error before answering, or `timeout_s` passed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(rank, port, results, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a spawned process exited with {dead[0]}")
        raise RuntimeError(f"no result within {timeout_s:g} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def init_distributed(backend: str, device: torch.device, timeout_s: float | None = None,
                     join_timeout_s: float | None = None) -> None:
    """Initialise the default process group (from torchrun's env, or as a 1-process group); on
    several hosts, compare their wall clocks once (:func:`~pipeflow.runtime.world.clocks.check_wall_clocks`).

    Args:
        backend, device: from :func:`choose_device`.
        timeout_s: the process group's deadline for collectives (``comm.first_step_timeout_s``).
        join_timeout_s: how long to wait for every rank to join (``comm.join_timeout_s``).

    Raises:
        JoinTimeoutError: a rank never joined, naming the ranks missing.
    """
    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        watch_parent()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = join_store(rank, world, join_timeout_s if join_timeout_s is not None else timeout_s, backend)
        if timeout_s is not None:
            store.set_timeout(kwargs["timeout"])
        # the store is the join's epoch: a restart under torchrun's shared store meets no key (a
        # peer's address, the first failure) of the attempt before
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                                **kwargs)
        if len(hosts_of_job.table().hosts) > 1:  # several machines: are their wall clocks together?
            check_wall_clocks()
    else:  # plain `python train.py`: a pipeline of one rank
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs
        )


def end_process_group(
    barrier_timeout_s: float | None, watchers: Sequence[tuple[threading.Event, threading.Thread]] = (),
    join_s: float = THREAD_JOIN_S,
) -> bool:
    """Tear every process group down at the end of a run, in an order that aborts neither this
    process nor a peer.

    1. Stop and join each thread of `watchers` (an event that stops it, the thread): a daemon
       thread still inside a store or group call when the interpreter finalizes is ended there by
       ``pthread_exit``, which unwinds through C++ and calls ``std::terminate`` ("terminate called
       without an active exception", exit -6).
    2. Collect garbage, so that run objects in reference cycles (a pipeline holding its groups
       and their works) free the groups now, not during interpreter finalization.
    3. A barrier bounded by `barrier_timeout_s` (None: none, as after a failure), so that no peer
       still uses a group when it goes.
    4. Destroy the groups: torch shuts the subgroups down first (newest first), then the world.

    Returns:
        False when a watcher did not end within `join_s` (then leave with ``os._exit``: the
        interpreter's finalization is what a thread still in C++ cannot survive); else True.

    Raises:
        CommError: the barrier failed or timed out (a peer died, or never finished its run).
    """
    joined = True
    for stop, thread in watchers:
        stop.set()
    for _, thread in watchers:
        if thread is not threading.current_thread():
            thread.join(join_s)
            joined = joined and not thread.is_alive()
    gc.collect()
    if not dist.is_initialized():
        return joined
    if barrier_timeout_s is not None and dist.get_world_size() > 1:
        _bounded_barrier(barrier_timeout_s)
    dist.destroy_process_group()
    return joined


def _bounded_barrier(timeout_s: float) -> None:
    """A barrier over the world that waits at most `timeout_s` seconds.

    Raises:
        CommError: naming this rank, the deadline, and the backend's words.
    """
    rank = dist.get_rank()
    try:
        dist.barrier(async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CommError(
            f"rank {rank}: the barrier that ends the run failed within {timeout_s:g} s (comm.timeout_s): a peer died "
            f"or did not finish its run (its own error, if it printed one, is the job's first failure): "
            f"{first_line(exc)}"
        ) from exc


def saving_on_signal(on: bool) -> None:
    """While on, :func:`watch_parent` lets a gone launcher be: the job is saving because a signal
    asked it to stop (``train.save_on_signal``), and leaves by itself once saved."""
    if on:
        _SAVING_ON_SIGNAL.set()
    else:
        _SAVING_ON_SIGNAL.clear()


def watch_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread | None:
    """Leave (exit 1) within about `poll_s` once the process that started this one is gone (a
    daemon thread watching the parent pid), unless a save on a signal is under way
    (:func:`saving_on_signal`); None when there is no parent to watch (pid 1)."""
    parent = os.getppid()
    if parent <= 1:
        return None

    def watch() -> None:
        while os.getppid() == parent or _SAVING_ON_SIGNAL.is_set():
            time.sleep(poll_s)
        print(f"[pipeflow] rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher (pid {parent}) is "
              f"gone; exiting so that no worker is left behind", file=sys.stderr, flush=True)
        os._exit(1)

    thread = threading.Thread(target=watch, name="pipeflow-parent-watch", daemon=True)
    thread.start()
    return thread
