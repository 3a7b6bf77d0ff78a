"""What ``python -m pipeflow.launch`` says while torchrun's agent waits for its rendezvous.

The agent prints nothing while it waits for the other nodes (at start, and again after a restart
or a lost node), so a job whose other nodes never come looked hung.  The launcher watches its own
child processes (the agent's workers): while it has none, it says every few seconds what it
waits for, for how long, and, on a node that does not host the rendezvous, whether the endpoint
answers at all (a wrong or unreachable address waits out the whole join_timeout otherwise).
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Mapping

from pipeflow.runtime.world.hosts import connect_failure

WAIT_REPORT_S = 5.0  # seconds between two lines while the agent waits
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's: 1, a fresh store per rendezvous round
TORCH_SHUTDOWN_TIMEOUT_S = 30  # torchrun's seconds from SIGTERM to SIGKILL unless told otherwise


def live_children(pid: int | None = None) -> int | None:
    """How many child processes process `pid` (this one) has now, read from ``/proc`` (None where
    ``/proc`` cannot say: not Linux)."""
    pid = os.getpid() if pid is None else pid
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                count += len(f.read().split())
        except FileNotFoundError:  # a thread that just ended
            continue
        except OSError:
            return None
    return count


def endpoint_silence(host: str, port: int, timeout_s: float = 3.0) -> str | None:
    """Why nothing answers at `host`:`port` (``No route to host``, ``nothing listens on port
    29500``, ``no answer within 3 s``), or None when something accepts a connection there."""
    failure = connect_failure(host, port, timeout_s)
    if failure is None:
        return None
    if isinstance(failure, TimeoutError):
        return f"no answer within {timeout_s:.0f} s"
    if failure.errno == errno.ECONNREFUSED:
        return f"nothing listens on port {port} there (not started yet, or another port)"
    return failure.strerror or str(failure)


class WaitReporter:
    """Says (`say`) every `every_s` seconds, while `workers()` counts none, that the launcher waits
    for the rendezvous `what`, for how long, the deadline and (with `probe`) why the endpoint does
    not answer; once workers ran and are gone, that it waits again (a restart's re-rendezvous, or
    the job's end).  Children seen at one look only (a helper the agent runs) are no workers."""

    def __init__(self, what: str, deadline_s: float, say: Callable[[str], None],
                 workers: Callable[[], int | None] = live_children, clock: Callable[[], float] = time.monotonic,
                 every_s: float = WAIT_REPORT_S, probe: Callable[[], str | None] | None = None) -> None:
        self.what, self.deadline_s, self.say, self.workers, self.clock, self.every_s, self.probe = (
            what, deadline_s, say, workers, clock, every_s, probe)
        self._since: float | None = clock()
        self._said = self._since
        self._ran = False
        self._looks_with_children = 0

    def tick(self) -> None:
        """Look once: a line when it has waited another `every_s` seconds without workers."""
        count, now = self.workers(), self.clock()
        if count is None:
            return
        self._looks_with_children = self._looks_with_children + 1 if count > 0 else 0
        if self._looks_with_children >= 2:
            self._ran, self._since = True, None
            return
        if count > 0:
            return
        if self._since is None:  # the workers ended: waiting again
            self._since = self._said = now
            return
        if now - self._said >= self.every_s:
            self._said = now
            again = " again (the workers ended: a restart, or the job's end)" if self._ran else ""
            silence = self.probe() if self.probe is not None else None
            self.say(f"waiting for the rendezvous at {self.what}{again}: {now - self._since:.0f} s of at most "
                     f"{self.deadline_s:.0f} (--rdzv-conf join_timeout)"
                     f"{f'; the endpoint does not answer: {silence}' if silence else ''}")

    def watch(self, stop: threading.Event) -> threading.Thread:
        """Tick every second in a daemon thread until `stop` is set."""
        def loop() -> None:
            while not stop.wait(1.0):
                self.tick()

        thread = threading.Thread(target=loop, name="pipeflow-launch-wait", daemon=True)
        thread.start()
        return thread


def shared_store_warning(env: dict[str, str], nnodes: str | None) -> str | None:
    """What a job across nodes risks on torchrun's shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    set, not 1): an agent that joins a later round (an elastic range's extra node, a replacement)
    reads the master address that rank 0's agent writes in its first round only (torch 2.14's
    DynamicRendezvousHandler.next_rendezvous), and waits out read_timeout; None otherwise."""
    value = env.get(FRESH_STORE_ENV, "1")
    if value == "1":
        return None
    return (f"{FRESH_STORE_ENV}={value} (torchrun's shared store): a node that joins the running job "
            f"(--nnodes {nnodes}: a range's extra node, a replacement) waits in torchrun's rank assignment until the "
            f"rendezvous's read_timeout and fails, since rank 0's agent writes the master address for its first "
            f"round only; unset it for a job that may grow (each round then gets a fresh store)")


def shutdown_timeout_s(given: str | None, env: Mapping[str, str] = os.environ) -> int:
    """torchrun's seconds from SIGTERM to SIGKILL: its ``--shutdown-timeout`` (`given`), else
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else :data:`TORCH_SHUTDOWN_TIMEOUT_S`."""
    value = given or env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or ""
    return int(value) if value.isdigit() else TORCH_SHUTDOWN_TIMEOUT_S  # torchrun refuses what is not a count
