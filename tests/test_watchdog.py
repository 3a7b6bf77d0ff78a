"""The P2P watchdog that keeps the deadline of waits which do not block the host (CUDA streams)."""
from __future__ import annotations

import os
import sys
import threading
import time

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
