"""Overlapped pairs: the forward of one micro-batch and the backward of another run interleaved on
one rank (DualPipeV, ``pipeline.overlap_pairs``), so each one's communication proceeds while the
other computes, as DeepSeek's DualPipe overlaps its chunks.

The forward runs on the calling thread and the backward on a worker thread, and a *baton* lets
one of them compute at a time: the pair stays the serial math of one process (only the order of
two independent computations changes), every tensor of each is touched by one thread at a time,
and the collectives are issued in the same order on every rank.  A *communication point* is where
an action would wait for a collective it started (an MoE layer's ``all_to_all``,
:mod:`pipeflow.runtime.parallel.expert_parallel`): inside a pair, :func:`wait` hands the baton to the other
action, which computes until its own next point (or its end), and takes it back before waiting for
the collective, by then done or nearer done (the side computing holds the baton, whichever thread
it runs on: on a GPU autograd runs a backward on its own device thread).  The handovers are fixed by the program (the forward
first, then strictly alternating while both have points left), so every rank of a group issues
its collectives in the same order.  The simulator times the same thing
(:func:`~pipeflow.schedules.sim_engine.overlapped_pair`).

On a GPU the host hands over as soon as a collective is queued, so the other action's kernels
are launched while the exchange runs on its own stream.  The worker thread is told the device
(CUDA's current device is per thread) and computes with grad mode on; the calling thread's
autocast and saved-tensor hooks (offloading, memory tracking) apply to the forward, which saves
tensors; the backward only unpacks them.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


class Baton:
    """Which of a pair's two actions (side 0: the forward, 1: the backward) may compute now."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = 0
        self._done = [False, False]

    @property
    def holder(self) -> int:
        """The side computing now."""
        return self._holder

    def take(self, side: int) -> None:
        """Block until `side` holds the baton."""
        with self._cond:
            self._cond.wait_for(lambda: self._holder == side)

    def hand_over(self, side: int) -> None:
        """`side` lets the other compute, unless the other has finished (then `side` keeps it)."""
        with self._cond:
            if not self._done[1 - side]:
                self._holder = 1 - side
                self._cond.notify_all()

    def finish(self, side: int) -> None:
        """`side` is done: the other holds the baton from now on."""
        with self._cond:
            self._done[side] = True
            self._holder = 1 - side
            self._cond.notify_all()


_active: Baton | None = None  # the pair running now (one at a time per process: one per rank)
_COMMUNICATES = "_pipeflow_communicates"  # set on a module with a communication point


def wait(work: Any) -> None:
    """Wait for a collective's `work` (``async_op=True``): inside an overlapped pair, let the other
    action compute meanwhile (a communication point); elsewhere, just wait."""
    baton = _active
    if baton is not None:  # called by the side computing (on a GPU maybe from autograd's device thread)
        side = baton.holder
        baton.hand_over(side)
        baton.take(side)
    work.wait()


def mark_communicating(module: torch.nn.Module) -> None:
    """Say that `module` has a communication point (it calls :func:`wait`): a pair over stages
    holding one runs interleaved (split_experts marks every MoE layer it splits)."""
    setattr(module, _COMMUNICATES, True)


def communicates(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether any of `modules` (or a module inside one) has a communication point."""
    return any(getattr(m, _COMMUNICATES, False) for module in modules for m in module.modules())


class PairRunner:
    """Runs overlapped pairs for one pipeline: a forward here, a backward on one worker thread that
    lives as long as the runner (started at the first pair)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._worker: ThreadPoolExecutor | None = None

    def run(self, forward: Callable[[], None], backward: Callable[[], None], interleave: bool = True) -> None:
        """Run `forward` (on this thread) and `backward` (on the worker) interleaved at their
        communication points, `forward` first; returns when both are done.  An exception of
        either is raised here once both have stopped (the forward's first).  With `interleave`
        False (stages without a communication point, where nothing could hand over) both run
        here, one after the other: the same order without a thread's wake-ups."""
        global _active
        if not interleave:
            forward()
            backward()
            return
        baton, errors = Baton(), [None, None]

        def side(index: int, fn: Callable[[], None]) -> None:
            try:
                baton.take(index)
                fn()
            except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
                errors[index] = exc
            finally:
                baton.finish(index)

        _active = baton
        try:
            done = self._pool().submit(side, 1, backward)
            side(0, forward)
            done.result()
        finally:
            _active = None
        for exc in errors:
            if exc is not None:
                raise exc

    def _pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            initializer = (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="pipeflow-pair", initializer=initializer)
        return self._worker
