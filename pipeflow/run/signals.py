"""``train.save_on_signal``: the signals on which a job saves at the next step boundary and ends
with :data:`PREEMPTED_EXIT_CODE` (what a cluster scheduler sends before it kills a job)."""
from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from pipeflow.errors import ConfigError

log = logging.getLogger("pipeflow")

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: the job saved and stopped on a signal; relaunch to continue


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
    main thread (where Python cannot install handlers) nothing is installed, with a warning."""
    def handler(signum: int, frame: Any) -> None:
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
