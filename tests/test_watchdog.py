"""The P2P watchdog that keeps the deadline of waits which do not block the host (CUDA streams)."""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref

import torch
import torch.multiprocessing as mp

from mp_harness import _free_port
from pipeflow.runtime.transport import DeadlineWatchdog
from pipeflow.errors import PipelineTimeoutError


class FakeWork:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _collect() -> tuple[list[PipelineTimeoutError], threading.Event, DeadlineWatchdog]:
    errors: list[PipelineTimeoutError] = []
    fired = threading.Event()

    def on_timeout(exc: PipelineTimeoutError) -> None:
        errors.append(exc)
        fired.set()

    return errors, fired, DeadlineWatchdog(on_timeout, poll_s=0.01)


class ThreadRecordingWork(FakeWork):
    """A work that notes which thread queries it, and that thread's device then."""

    def __init__(self, devices: dict[str, object]) -> None:
        super().__init__(done=False)
        self.devices = devices
        self.queried_by: list[tuple[str, object]] = []

    def is_completed(self) -> bool:
        name = threading.current_thread().name
        self.queried_by.append((name, self.devices.get(name)))
        return self.done


def _fake_set_device(monkeypatch) -> dict[str, object]:
    """Replace torch.cuda.set_device (no GPU here) by a note of the device each thread set."""
    devices: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.__setitem__(threading.current_thread().name, d))
    return devices


def test_the_thread_queries_works_with_the_ranks_cuda_device_current(monkeypatch) -> None:
    devices = _fake_set_device(monkeypatch)
    watchdog = DeadlineWatchdog(lambda exc: None, poll_s=0.01, device=torch.device("cuda", 3))
    work = ThreadRecordingWork(devices)
    watchdog.watch([work], 60.0, "pipeline rank 3", "recv activation")
    deadline = time.monotonic() + 5
    while not work.queried_by and time.monotonic() < deadline:
        time.sleep(0.01)
    watchdog.stop()
    assert work.queried_by, "the watchdog never polled"
    assert set(work.queried_by) == {("pipeflow-p2p-watchdog", torch.device("cuda", 3))}
    assert threading.current_thread().name not in devices  # the caller's device is left alone


def test_a_cpu_watchdog_sets_no_cuda_device(monkeypatch) -> None:
    devices = _fake_set_device(monkeypatch)
    watchdog = DeadlineWatchdog(lambda exc: None, poll_s=0.01, device=torch.device("cpu"))
    time.sleep(0.05)
    watchdog.stop()
    assert devices == {}


def test_stop_ends_and_joins_the_thread_and_lets_go_of_its_works() -> None:
    errors, fired, watchdog = _collect()
    work = FakeWork(done=False)
    ref = weakref.ref(work)
    watchdog.watch([work], 60.0, "pipeline rank 0", "send activation")
    assert watchdog.alive
    del work
    watchdog.stop()
    assert not watchdog.alive  # joined: the thread has ended
    gc.collect()
    assert ref() is None  # the pending wait was dropped with the thread
    watchdog.stop()  # idempotent
    assert errors == [] and not fired.is_set()


def test_the_runs_watchdog_holds_only_the_rank_and_runs_on_its_device(monkeypatch) -> None:
    from pipeflow.run import assembly, guard

    devices = _fake_set_device(monkeypatch)
    assert assembly.watchdog(torch.device("cpu"), 0) is None  # gloo waits block the host themselves
    watchdog = assembly.watchdog(torch.device("cuda", 1), 5)
    try:
        assert watchdog.device == torch.device("cuda", 1)
        assert watchdog.on_timeout.func is guard.fail and watchdog.on_timeout.args == ()
        assert watchdog.on_timeout.keywords == {"rank": 5}  # nothing of the Trainer
    finally:
        watchdog.stop()
    assert devices == {"pipeflow-p2p-watchdog": torch.device("cuda", 1)}


def test_completed_waits_never_fire() -> None:
    errors, fired, watchdog = _collect()
    work = FakeWork(done=False)
    watchdog.watch([work], 0.3, "pipeline rank 0", "recv activation of micro-batch 0 from stage 0 (rank 0)")
    work.done = True  # completes well before its deadline
    assert not fired.wait(0.6)
    assert errors == []


def test_an_overdue_wait_is_reported_once_with_rank_and_transfer() -> None:
    errors, fired, watchdog = _collect()
    watchdog.watch([FakeWork(True)], 0.05, "pipeline rank 1", "send activation")
    start = time.monotonic()
    watchdog.watch([FakeWork(True), FakeWork(False)], 0.1, "pipeline rank 1 (global rank 5)",
                   lambda: "recv gradient of micro-batch 3 from stage 2 (rank 2)")
    assert fired.wait(2.0)
    assert 0.1 <= time.monotonic() - start < 1.0
    time.sleep(0.1)
    assert len(errors) == 1
    text = str(errors[0])
    assert text.startswith("pipeline rank 1 (global rank 5): no progress within 0.1 s")
    assert "recv gradient of micro-batch 3 from stage 2 (rank 2)" in text and "watchdog" in text


def _stuck_rank(rank: int, port: int) -> None:
    """Rank 0 waits, without blocking on a deadline, for a recv rank 1 never sends."""
    import torch
    import torch.distributed as dist

    from pipeflow.runtime.transport import P2PComm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(20)  # alive but silent: the recv on rank 0 neither completes nor fails
        os._exit(0)
    def on_timeout(exc: PipelineTimeoutError) -> None:
        print(f"TIMEOUT {exc}", flush=True)
        os._exit(3)

    comm = P2PComm(None, torch.device("cpu"), timeout_s=1.0, host_blocking=False,
                   watchdog=DeadlineWatchdog(on_timeout, poll_s=0.1))
    works = comm.post([], [(1, torch.empty(4))])
    comm.wait(works, "recv activation of micro-batch 0 from stage 1 (rank 1)")  # blocks: gloo wait
    os._exit(0)


def test_a_non_blocking_wait_on_a_silent_peer_is_stopped_by_the_watchdog(capfd) -> None:
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_stuck_rank, args=(r, port)) for r in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    procs[0].join(60)
    elapsed = time.monotonic() - start
    procs[1].kill()
    procs[1].join()
    out = capfd.readouterr().out
    assert procs[0].exitcode == 3, out
    assert "TIMEOUT pipeline rank 0 (global rank 0): no progress within 1.0 s" in out
    assert "recv activation of micro-batch 0 from stage 1 (rank 1)" in out
    assert elapsed < 20, elapsed  # the deadline (1 s) + start-up, not rank 1's 20 s of silence
    sys.stdout.flush()
