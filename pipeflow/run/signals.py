"""``train.save_on_signal``: the signals on which a job saves at the next step boundary and ends
with :data:`PREEMPTED_EXIT_CODE` (what a cluster scheduler sends before it kills a job)."""
from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

from pipeflow.errors import ConfigError

log = logging.getLogger("pipeflow")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: the job saved and stopped on a signal; relaunch to continue
# A signal again within this long is the same request: Ctrl-C reaches a worker twice under torchrun
# (from the terminal's process group, and forwarded by the agent).  A Ctrl-C later than this quits.
REPEAT_WITHIN_S = 5.0


def signal_names(names: Any) -> list[str]:
    """``train.save_on_signal`` as signal names (``["SIGTERM"]``)."""
    return [signal.Signals(n).name for n in signal_numbers(names)]


def signal_numbers(names: Any) -> list[int]:
    """``train.save_on_signal`` as signal numbers: a name (``SIGTERM``, ``USR1``), a list of them,
    or false/null/[] for none.

    Raises:
        ConfigError: an unknown signal name, or SIGKILL/SIGSTOP (which no process can catch).
    """
    if names is None or names is False or names == "":
        return []
    if isinstance(names, (str, int)):
        names = [names]
    numbers = []
    for name in names:
        text = str(name).upper()
        key = text if text.startswith("SIG") else f"SIG{text}"
        sig = getattr(signal, key, None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"train.save_on_signal: {name!r} is not a signal a process can catch; use e.g. "
                              f"SIGTERM (what schedulers send before they kill a job) or SIGUSR1, or false for none")
        numbers.append(int(sig))
    return numbers


def catch_signals(numbers: list[int], on_signal: Callable[[str], None]) -> Callable[[], None]:
    """Call ``on_signal(name)`` when a signal in `numbers` arrives (it only sets a flag: the step's
    all-reduce carries it); returns a function that restores the previous handlers.  Outside the
    main thread (where Python cannot install handlers) nothing is installed, with a warning.

    The same signal again counts once; only SIGINT repeated more than :data:`REPEAT_WITHIN_S`
    after the first (a second Ctrl-C, not torchrun's copy of the first) raises
    ``KeyboardInterrupt``: quit now, without the save."""
    first: dict[int, float] = {}

    def handler(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if signum in first:
            if signum == signal.SIGINT and now - first[signum] > REPEAT_WITHIN_S:
                raise KeyboardInterrupt
            return
        first[signum] = now
        on_signal(signal.Signals(signum).name)

    previous: dict[int, Any] = {}
    for number in numbers:
        try:
            previous[number] = signal.signal(number, handler)
        except ValueError:  # not the main thread
            log.warning("train.save_on_signal: cannot catch signals outside the main thread; not installed")
            break

    def restore() -> None:
        for number, handler_before in previous.items():
            signal.signal(number, handler_before)
    return restore


PREEMPTED_RECORD = "preempted"  # <run_dir>/preempted: "preempted at step N: ..." while a relaunch is due
STATUS_FILE_ENV = "PIPEFLOW_STATUS_FILE"  # set by pipeflow's launcher: where rank 0 says how the job ended


def record_preemption(run_dir: str | None, step: int | None, checkpoint: str | None) -> str:
    """Rank 0: write ``<run_dir>/preempted`` (and the launcher's status file, where
    ``PIPEFLOW_STATUS_FILE`` names one) saying ``preempted at step N``, so that a launcher or a
    scheduler's script can tell a preemption (relaunch: exit 75, requeue) from a failure even
    where torchrun's own status is 1.  Returns the line written; a write that fails is logged.

    Args:
        run_dir: the run directory (None: not known yet, only the launcher's file is written).
        step: the step the job stopped at (a relaunch with ``train.resume=auto`` continues there);
            None: during start-up, before the step to resume from was known.
        checkpoint: the checkpoint folder that holds that step, or None (nothing trained yet).
    """
    held = f"checkpoint {checkpoint}" if checkpoint else "nothing saved: no step trained since the start"
    at = f"step {step}" if step is not None else "start-up"
    line = f"preempted at {at}: {held}; run directory {run_dir or 'not made yet'}\n"
    for path in (run_dir and os.path.join(run_dir, PREEMPTED_RECORD), os.environ.get(STATUS_FILE_ENV)):
        if not path:
            continue
        try:
            with open(path, "w") as f:
                f.write(line)
        except OSError as exc:
            log.warning("could not record the preemption in %s: %s", path, exc)
    return line


AGENT_STOP = "stopped by torchrun's agent"  # the launcher's mark in its status file while the agent stops its workers


def agent_stopping() -> bool:
    """Whether this worker's signal came from torchrun's own agent stopping its workers (to restart
    them for a node that joined or left, or after a worker failed), which ``python -m
    pipeflow.launch`` marks in its status file: no preemption, whatever the signal.  False under
    plain torchrun, which cannot tell."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return False
    try:
        with open(path) as f:
            return f.read(len(AGENT_STOP)) == AGENT_STOP
    except OSError:
        return False


def clear_preemption(run_dir: str) -> None:
    """Rank 0, when a run starts training: remove a ``<run_dir>/preempted`` left by the launch before."""
    try:
        os.remove(os.path.join(run_dir, PREEMPTED_RECORD))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove the old preemption record %s: %s", os.path.join(run_dir, PREEMPTED_RECORD), exc)


def preemption_recorded(status_file: str) -> str | None:
    """The line a launcher's status file (``PIPEFLOW_STATUS_FILE``) holds when the job was
    preempted (``preempted at step N: ...``), or None (no preemption recorded)."""
    try:
        with open(status_file) as f:
            text = f.read(4096)
    except OSError:
        return None
    return text.strip() if re.match(r"preempted at (step \d+|start-up)", text) else None


def leave_at_once_on(numbers: list[int], rank: int, leave: Callable[[int], None]) -> Callable[[], None]:
    """Until training starts: a ``train.save_on_signal`` signal ends this process at once with
    :data:`PREEMPTED_EXIT_CODE` (nothing was trained in this launch, so nothing is lost, and a
    long start-up phase, a compile or a profile, never outlives the launcher's grace); returns a
    function that restores the previous handlers.

    Args:
        numbers: the signals (:func:`signal_numbers`).
        rank: this process's global rank (each node's first rank records the preemption for
            its launcher).
        leave: ends the process with the given status (flushing the logs first).
    """
    def on_signal(name: str) -> None:
        if agent_stopping():
            log.warning("rank %d: %s during start-up from torchrun's agent, which stops its workers (a node joined "
                        "or left, or a worker failed): nothing to save; leaving", rank, name)
        else:
            log.warning("rank %d: %s during start-up, before the first step of this launch: nothing to save; "
                        "leaving with status %d (the same command with train.resume=auto starts again)", rank, name,
                        PREEMPTED_EXIT_CODE)
            if os.environ.get("LOCAL_RANK", str(rank)) == "0":
                record_preemption(None, None, None)
        leave(PREEMPTED_EXIT_CODE)
    return catch_signals(numbers, on_signal)
