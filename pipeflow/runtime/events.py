"""What the runtime records while it runs: timed events, handed to a recorder it is given.

The runtime knows only this interface; observability (per-stage figures, traces, TensorBoard)
and the benchmarks read what a recorder collected, so nothing below the run imports them.
"""
from __future__ import annotations

from typing import NamedTuple


class TimedEvent(NamedTuple):
    """One recorded interval on this rank: a batched call (kind ``comm``, post to completion)
    or a compute action (kind ``F``, ``B`` or ``W``; name such as ``1F0``); seconds from
    ``time.perf_counter``."""

    kind: str
    name: str
    start: float
    end: float


class EventRecorder:
    """Collects the events of a pass while it is on; off, recording costs one attribute test.

    The run builds one and hands it to the pipeline (which records) and to its metrics (which
    turn it on around a step and take what it collected).
    """

    def __init__(self) -> None:
        self.events: list[TimedEvent] | None = None

    @property
    def on(self) -> bool:
        """True while events are being collected."""
        return self.events is not None

    def start(self) -> None:
        """Start collecting (drops anything collected before)."""
        self.events = []

    def stop(self) -> list[TimedEvent]:
        """Stop collecting; returns what was collected since :meth:`start`."""
        events, self.events = self.events or [], None
        return events

    def record(self, kind: str, name: str, start: float, end: float) -> None:
        """Add one event, when on."""
        if self.events is not None:
            self.events.append(TimedEvent(kind, name, start, end))
