"""Checkpoints written in the background (``train.checkpoint_mode=async|async_process``), with every
promise of the synchronous save (:mod:`pipeflow.checkpoint.saving`) kept.

At the step boundary the save begins as a synchronous one does (the lock and the folder checked,
every rank agreeing), then DCP's ``async_save`` stages the state: copies it off the device (into
pinned buffers on a GPU, reused from save to save) so training may change the live tensors at
once, and writes the copy in the background: a thread of this process (``async``) or one writer
process per rank that DCP keeps for the run (``async_process``).  A thread of this rank then
waits for the write and runs the rest of the save exactly as the synchronous one does: the RNG
states taken at the boundary, the digests shared, ``meta.json`` last, the rename, ``latest``,
the retention; each step agreed by every rank.  All of it runs on process groups of its own
(gloo), so its collectives never interleave with training's.

At most one save is in flight.  At each step boundary the ranks learn together (one small
all-reduce on a group of its own) whether every rank's save is done: a finished save is
reported (``saved checkpoint of step N ...``, TensorBoard's ``checkpoint/write_s``), a failed
one raised on every rank at that same boundary, or with ``train.on_save_error=warn`` logged
and training goes on (the partial folder removed, ``latest`` untouched either way).  The next
save, a preemption and the end of the run wait for the one in flight, and say so when they do.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from pipeflow.errors import CheckpointError, CheckpointPeerLostError, PipeflowError
from pipeflow.checkpoint import saving as checkpoint, integrity
from pipeflow.checkpoint.storage import HostPart, host_part

log = logging.getLogger("pipeflow")

MODES = {"async": AsyncCheckpointerType.THREAD, "async_process": AsyncCheckpointerType.PROCESS}


@dataclass
class SaveInFlight:
    """One background save: its step, when it began, and, once its thread ends, its outcome."""

    step: int
    final: str
    staged_s: float
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    path: str | None = None
    error: BaseException | None = None
    write_s: float = 0.0
    write_failed: bool = False  # this rank's write failed (known before the ranks agree on it)
    writer_stopped: bool = False  # this rank's writer process was stopped because another rank's failed
    abandoned: bool = False  # given up (a preemption's grace): it must not commit, whenever it gets there


@dataclass
class SaveReport:
    """A background save that ended: its step, folder, staging and write seconds, or its error;
    `written_from`: when its write began (``time.perf_counter``, the end of its staging)."""

    step: int
    path: str | None
    staged_s: float
    write_s: float
    error: BaseException | None = None
    written_from: float = 0.0


class BackgroundSaver:
    """This rank's writer of checkpoints in the background (see the module docstring).

    Collective at construction (every rank makes the same process groups).

    Args:
        mode: ``async`` or ``async_process``.
        on_error: ``stop`` (a failed save is raised at the next step boundary) or ``warn``.
        device: the training device (on CUDA the state is staged into pinned host memory).
        storage: ``train.checkpoint_storage``; with ``local`` each host's part is written on a
            gloo group of the host's ranks.
    """

    def __init__(self, mode: str, on_error: str, device: torch.device, storage: str = "shared") -> None:
        if mode not in MODES:
            raise ValueError(f"checkpoint mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode, self.on_error, self.storage = mode, on_error, storage
        self.group = dist.new_group(backend="gloo")  # the save's own steps, in its thread
        self.poll_group = dist.new_group(backend="gloo")  # the step boundaries' "is every rank's save done?"
        self.part: HostPart | None = None
        if storage == "local":  # each host's DCP write on a gloo group of its ranks (async_save needs a CPU one)
            part = host_part()
            groups = {ranks: dist.new_group(list(ranks), backend="gloo") for _, ranks in part.hosts}
            leaders = dist.new_group([ranks[0] for _, ranks in part.hosts], backend="gloo")
            self.part = HostPart(part.host, part.ranks, part.index, groups[part.ranks], part.hosts, leaders)
        pinned = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=pinned))
        self.inflight: SaveInFlight | None = None
        self.rank = dist.get_rank()
        self._late = 0
        self._given_up: SaveInFlight | None = None  # an abandoned save, whose thread may still use the group

    def save(self, root: str, step: int, layers: dict[int, nn.Module], optimizer: torch.optim.Optimizer,
             meta: dict[str, Any], job: str = "", keep_last: int | None = None,
             replicas: int = 1) -> tuple[str, SaveReport | None]:
        """Begin the checkpoint of `step` (collective) and return once it is staged: its folder
        (complete only when reported) and the report of the save it waited for, if one was in
        flight (the caller reports it).

        Raises:
            RunDirLostError, CheckpointPeerLostError, CheckpointError: as the synchronous save's
                first step raises them (nothing was staged).
        """
        waited = self.wait(f"the checkpoint of step {step}")
        if self._given_up is not None:  # its thread refuses to commit soon; two on one group would mismatch
            self._given_up.done.wait()
            self._given_up = None
        started = time.perf_counter()
        saving = checkpoint.begin(root, step, job, self.storage, group=self.group, part=self.part, replicas=replicas)
        state = checkpoint.state_to_save(layers, optimizer)
        rng = checkpoint.rng_state()
        part = saving.part
        try:
            future: Any = dcp.async_save(state, checkpoint_id=saving.tmp if part is None else None,
                                         storage_writer=None if part is None else part.writer(saving.tmp),
                                         process_group=self.group if part is None else part.group,
                                         async_checkpointer_type=MODES[self.mode], async_stager=self.stager)
        except Exception as exc:  # noqa: BLE001 - staging failed: the save's agreed steps report it by rank
            future = _Failed(exc)
        inflight = SaveInFlight(step, saving.final, time.perf_counter() - started, time.perf_counter())
        thread = threading.Thread(target=self._finish, args=(inflight, saving, future, meta, rng, keep_last),
                                  name=f"pipeflow-checkpoint-{step}", daemon=True)
        self.inflight = inflight
        thread.start()
        return saving.final, waited

    def _finish(self, inflight: SaveInFlight, saving: Any, future: Any, meta: dict[str, Any], rng: dict[str, Any],
                keep_last: int | None) -> None:
        """The save's thread: wait for DCP's write, then the agreed steps of the synchronous save."""
        try:
            written = integrity.attempt(future.result, self.rank)
            if self.mode == "async_process":  # its own writer's death, not a lost peer: the ranks still agree
                written.peer_lost = False
                if written.errors and inflight.writer_stopped:
                    written.errors = [(self.rank, "its writer process was stopped: another rank's had failed")]
            inflight.write_failed = bool(written.errors)
            inflight.path = checkpoint.finish(saving, meta, written, rng, keep_last,
                                              proceed=lambda: not inflight.abandoned)
        except BaseException as exc:  # noqa: BLE001 - reported at a step boundary, on every rank
            inflight.error = exc
        finally:
            inflight.write_s = time.perf_counter() - inflight.started
            inflight.done.set()

    def poll(self) -> SaveReport | None:
        """At a step boundary (collective while a save is in flight): the save's report once every
        rank's is done, else None; the ranks learn it at the same boundary."""
        if self.inflight is None:
            return None
        return self._ended() if self._all_done() else None

    def wait(self, before: str, timeout_s: float | None = None) -> SaveReport | None:
        """Wait for the save in flight, if any (collective: every rank calls it at the same
        boundary), saying so when it has to; its report.  With `timeout_s`, once any rank has
        waited that long every rank gives the save up (:meth:`abandon`) and None is returned."""
        if self.inflight is None:
            return None
        if not self.inflight.done.is_set() and self.rank == 0:
            log.info("waiting for the checkpoint of step %d to be written before %s", self.inflight.step, before)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._all_done(late=deadline is not None and time.monotonic() > deadline):
            if self._late:
                self.abandon()
                return None
            self.inflight.done.wait(0.05)
        return self._ended()

    def abandon(self) -> None:
        """Give the save in flight up: its thread goes on, but refuses to commit (agreed, so on
        every rank) and removes its partial folder; ``latest`` stays where it was."""
        if self.inflight is not None:
            if self.rank == 0:
                log.warning("gave up the checkpoint of step %d, still being written: it will not be committed",
                            self.inflight.step)
            self.inflight.abandoned = True
            self._given_up, self.inflight = self.inflight, None

    def _all_done(self, late: bool = False) -> bool:
        """Whether every rank's save is done (one all-reduce on the poll group; `late`: this rank's
        wait is past its deadline, and after the call :attr:`_late` says whether any rank's is).
        Where a rank's writer process failed or died, every rank stops its own: the others' writes
        wait for the dead one's part of DCP's collectives, and would wait until gloo's timeout."""
        assert self.inflight is not None
        flags = torch.tensor([0 if self.inflight.done.is_set() else 1, int(self.inflight.write_failed), int(late)],
                             dtype=torch.int32)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.poll_group)
        except RuntimeError as exc:  # gloo/NCCL: a peer died or was stopped while the save was in flight
            raise CheckpointPeerLostError(
                f"checkpoint of step {self.inflight.step} not known to be written: a peer stopped taking part while "
                f"it was written in the background {checkpoint.PEER_GONE}: {integrity.describe(exc, self.rank)[0][1]}; "
                f"latest names the last complete checkpoint") from exc
        busy, failed, self._late = flags.tolist()
        if failed and busy and self.mode == "async_process" and not self.inflight.write_failed:
            self.inflight.writer_stopped = True
            stop_writer_process()
        return busy == 0

    def _ended(self) -> SaveReport:
        done, self.inflight = self.inflight, None
        assert done is not None
        if done.error is not None and self.mode == "async_process":
            stop_writer_process()  # every rank alike: the next save starts new writer processes together
        return SaveReport(done.step, done.path, done.staged_s, done.write_s, done.error, done.started)

    def close(self) -> None:
        """Release the staging buffers (after the last save was waited for)."""
        self.stager.close()


def stop_writer_process() -> None:
    """Kill this rank's DCP writer process, if any, so that a save waiting for it fails at once
    and the next save starts a new one.  DCP keeps the process in a module global of its process
    executor, with no public way to end it."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    writer = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if writer is None:
        return
    process = getattr(writer, "_save_process", None)
    if process is not None and process.is_alive():
        process.kill()
        process.join(timeout=5)
    executor._CHECKPOINT_PROCESS = None


class _Failed:
    """A write that failed before it began (staging): its error, raised where a future would."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> Any:
        """Raise the staging error."""
        raise self.error


def raise_or_warn(report: SaveReport, on_error: str) -> None:
    """A failed background save: raise its error (``stop``) or log it (``warn``); every rank does
    the same at the same step boundary.

    Raises:
        CheckpointError (or the save's own named error): with ``train.on_save_error=stop``.
    """
    error = report.error
    if error is None:
        return
    if on_error == "warn":
        if dist.get_rank() == 0:
            log.warning("the checkpoint of step %d was not written (train.on_save_error=warn: training goes on): %s",
                        report.step, error)
        return
    if isinstance(error, PipeflowError):
        raise error
    raise CheckpointError(f"checkpoint of step {report.step} not written in the background: {error}") from error
