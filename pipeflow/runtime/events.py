"""What the runtime records while it runs: timed events, handed to a recorder it is given.

The runtime knows only this interface; observability (per-stage figures, traces, TensorBoard)
and the benchmarks read what a recorder collected, so nothing below the run imports them.

Timing goes through a clock that hands out *marks* and turns them into seconds when the step is
over.  On the CPU (:class:`HostClock`) a mark is a ``time.perf_counter()`` reading: the work is
done when the host returns.  On CUDA (:class:`CudaEventClock`) the host only queues kernels, so a
host reading would time their launch; a mark there is a CUDA event recorded on the current
(compute) stream, and the seconds are each event's GPU time after a step-start event, read back
once the step is over.  Such a *timed* step drains the device at its start and end, so a run
times only some steps that way (``metrics.timed_every``); the others read only the host clock
(:meth:`EventRecorder.start` with ``timed=False``) and never make the host wait.  Both put their seconds on the host's ``perf_counter`` axis, so step times,
figures, traces and timeline pictures read one kind of event whatever the device.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import torch

SHARD = "shard"  # the kind of a sharded stage's gather (unshard) or reduction (reshard) event
D2H, H2D = "d2h", "h2d"  # an offloaded group's copy to the host (offload 0:3) and back (reload 0:3) issued
COPY_KINDS = (D2H, H2D)
A2A = "a2a"  # an MoE layer's token exchange over its ep group (inside an F, B or W: parallel.ep)


class TimedEvent(NamedTuple):
    """One recorded interval on this rank: a batched call (kind ``comm``, post to completion),
    a compute action (kind ``F``, ``B`` or ``W``; name such as ``1F0``), a sharded stage's
    gather or reduction (kind ``shard``; name such as ``unshard 0``) or an MoE layer's
    ``all_to_all`` within an action (kind ``a2a``; name such as ``dispatch``); seconds on the host's
    ``time.perf_counter`` axis (while recording, `start` and `end` are the clock's marks)."""

    kind: str
    name: str
    start: Any
    end: Any


class Clock(Protocol):
    """Hands out marks during a step and resolves them to seconds after it."""

    def begin(self) -> float:
        """Start a step; returns its start on the host's perf_counter axis."""

    def mark(self) -> Any:
        """A mark of now, as the device sees it."""

    def end(self) -> float:
        """End a step (its work complete); returns its end on the host's perf_counter axis."""

    def seconds(self, marks: list[Any]) -> list[float]:
        """The marks of this step as perf_counter seconds (after :meth:`end`)."""


class HostClock:
    """CPU timing: a mark is a ``time.perf_counter()`` reading."""

    def begin(self) -> float:
        """The host's now."""
        return time.perf_counter()

    def mark(self) -> float:
        """The host's now."""
        return time.perf_counter()

    def end(self) -> float:
        """The host's now."""
        return time.perf_counter()

    def seconds(self, marks: list[Any]) -> list[float]:
        """The readings themselves."""
        return [float(m) for m in marks]


class CudaEventClock:
    """CUDA timing: a mark is a ``torch.cuda.Event`` recorded on the current stream of `device`.

    :meth:`begin` drains the device, records the step-start event and reads the host clock, so
    that event stands at the host's step start; a mark resolves to that start plus its GPU time
    after the step-start event.  :meth:`end` drains the device too, so the step's time includes
    the kernels (the optimizer's) queued after the last mark.

    Args:
        device: the rank's CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._origin: Any = None
        self._origin_s = 0.0
        self._pool: list[Any] = []  # events are reused step after step: creating one costs a driver call
        self._used = 0

    def begin(self) -> float:
        """Drain the device, record the step-start event; the host's now."""
        torch.cuda.synchronize(self.device)
        self._used = 0  # every event of the last step was read back by its end()
        self._origin = self.mark()
        self._origin_s = time.perf_counter()
        return self._origin_s

    def mark(self) -> Any:
        """An event (from the pool) recorded on the current stream."""
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        event.record()
        return event

    def end(self) -> float:
        """Drain the device; the host's now."""
        torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def seconds(self, marks: list[Any]) -> list[float]:
        """Each event's GPU milliseconds after the step-start event, as host seconds."""
        if marks:
            marks[-1].synchronize()  # events on one stream complete in order; a no-op after end()
        return [self._origin_s + self._origin.elapsed_time(m) / 1e3 for m in marks]


def clock_for(device: torch.device | str | None) -> Clock:
    """CUDA events on a CUDA device, the host clock elsewhere."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaEventClock(torch.device(device))
    return HostClock()


class Transfer(NamedTuple):
    """One point-to-point transfer of a recorded pass, as this rank saw it: its op's text
    (``send:act0[0>1]->r1``, ``recv:act0[0>1]<-r0``), bytes, when it was posted, when this rank
    began waiting for it and when that wait ended (perf_counter seconds once resolved)."""

    name: str
    nbytes: int
    posted: Any
    waited: Any
    done: Any


class EventRecorder:
    """Collects the events of a pass while it is on; off, recording costs one attribute test.

    The run builds one and hands it to the pipeline (which records) and to its metrics (which
    turn it on around a step and take what it collected).

    Args:
        clock: how intervals are timed (default: the host clock; :func:`clock_for` picks one).
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else HostClock()
        self.events: list[TimedEvent] | None = None
        self.transfers: list[Transfer] = []  # the last pass's, resolved (timed passes only)
        self._transfers: list[Transfer] = []
        self.started_at = 0.0
        self.stopped_at = 0.0
        self.timed = False  # whether the pass since start() records events (else only its host time)

    @property
    def on(self) -> bool:
        """True while events are being collected."""
        return self.events is not None

    @property
    def free(self) -> bool:
        """True when timing every action costs nothing beside the work (the host clock): every step
        can be recorded.  On CUDA a recorded step drains the device at its start and end."""
        return isinstance(self.clock, HostClock)

    def start(self, timed: bool = True) -> float:
        """Start a pass (drops anything collected before); returns its start (perf_counter s).

        Args:
            timed: collect the pass's events; False: only the host's start and stop are read
                (no event, no device drain: the steady steps of a CUDA run).
        """
        self.timed = timed
        if not timed:
            self.events = None
            self.started_at = time.perf_counter()
            return self.started_at
        self.started_at = self.clock.begin()
        self.events, self._transfers = [], []
        return self.started_at

    def mark(self) -> Any:
        """A mark of now, to pass to :meth:`record`."""
        return self.clock.mark()

    def stop(self) -> list[TimedEvent]:
        """Stop collecting; returns what was collected since :meth:`start`, in perf_counter
        seconds (:attr:`stopped_at` is the end)."""
        events, self.events = self.events or [], None
        transfers, self._transfers = self._transfers, []
        if not self.timed:
            self.stopped_at = time.perf_counter()
            self.transfers = []
            return []
        self.stopped_at = self.clock.end()
        seconds = self.clock.seconds([m for e in events for m in (e.start, e.end)]
                                     + [m for t in transfers for m in (t.posted, t.waited, t.done)])
        n = 2 * len(events)
        self.transfers = [Transfer(t.name, t.nbytes, *seconds[n + 3 * k:n + 3 * k + 3]) for k, t in enumerate(transfers)]
        return [TimedEvent(e.kind, e.name, seconds[2 * k], seconds[2 * k + 1]) for k, e in enumerate(events)]

    def record_transfer(self, name: str, nbytes: int, posted: Any, waited: Any, done: Any) -> None:
        """Add one transfer (marks of its posting, its wait's start and end), when on."""
        if self.events is not None:
            self._transfers.append(Transfer(name, nbytes, posted, waited, done))

    def record(self, kind: str, name: str, start: Any, end: Any) -> None:
        """Add one event between two marks, when on."""
        if self.events is not None:
            self.events.append(TimedEvent(kind, name, start, end))


class _Span:
    """Records one event of `recorder` from entry to a normal exit."""

    __slots__ = ("recorder", "kind", "name", "start")

    def __init__(self, recorder: EventRecorder, kind: str, name: str) -> None:
        self.recorder, self.kind, self.name = recorder, kind, name

    def __enter__(self) -> _Span:
        self.start = self.recorder.mark()
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> bool:
        if kind is None:
            self.recorder.record(self.kind, self.name, self.start, self.recorder.mark())
        return False


class _NoSpan:
    """What :func:`span` gives while nothing records: entering and leaving it do nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> bool:
        return False


_NO_SPAN = _NoSpan()


def span(recorder: EventRecorder | None, kind: str, name: str) -> _Span | _NoSpan:
    """``with span(recorder, kind, name): ...`` records that interval as one event while `recorder`
    is on; otherwise it is one shared object that does nothing (no mark, no allocation)."""
    return _NO_SPAN if recorder is None or recorder.events is None else _Span(recorder, kind, name)
