"""Point-to-point exchange between pipeline ranks: one `dist.batch_isend_irecv` per step.

Every transfer goes through `torch.distributed.P2POp` handed to `dist.batch_isend_irecv`, and
every returned Work is waited on (gloo returns several; dropping one hung CPU runs,
pytorch/pytorch#132644).  Ranks are *pipeline* ranks (0..p-1 inside the pipeline group) and are
translated to global ranks here.  Shapes and dtypes travel as small fixed-size int64 metadata
messages (see :func:`encode_metas`), exchanged once by the pipeline and then cached.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeflow.errors import CommError, PipelineTimeoutError, UnsendableDtypeError
from pipeflow.runtime.world import hosts, timeouts

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
# dtypes that metadata can describe but no rank may send: NCCL has no 16-bit integer type
# (refused on every backend, so that a CPU run finds what would fail on GPUs)
UNSENDABLE: dict[torch.dtype, str] = {torch.int16: "int32"}
_MAX_DIMS = 8
_FIELDS = 3 + _MAX_DIMS  # dtype code, requires_grad, ndim, dims...
META_LEN = 1 + 24 * _FIELDS  # up to 24 tensors per transfer


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and grad requirement of one tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """The metadata of `tensor`."""
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def __str__(self) -> str:
        grad = ", grad" if self.requires_grad else ""
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}{grad}"


def encode_metas(metas: Sequence[TensorMeta]) -> torch.Tensor:
    """Pack tensor metadata into one int64 tensor of length META_LEN.

    Raises:
        CommError: if there are too many tensors, too many dims, or an unsupported dtype.
    """
    if len(metas) > (META_LEN - 1) // _FIELDS:
        raise CommError(f"a stage passes {len(metas)} tensors; at most {(META_LEN - 1) // _FIELDS} supported")
    out = torch.zeros(META_LEN, dtype=torch.int64)
    out[0] = len(metas)
    for k, meta in enumerate(metas):
        if meta.dtype not in _DTYPES or len(meta.shape) > _MAX_DIMS:
            raise CommError(f"cannot send tensor {meta}: dtype or rank (> {_MAX_DIMS} dims) unsupported")
        base = 1 + k * _FIELDS
        out[base] = _DTYPES.index(meta.dtype)
        out[base + 1] = int(meta.requires_grad)
        out[base + 2] = len(meta.shape)
        out[base + 3 : base + 3 + len(meta.shape)] = torch.tensor(meta.shape, dtype=torch.int64)
    return out


def decode_metas(packed: torch.Tensor) -> tuple[TensorMeta, ...]:
    """Inverse of :func:`encode_metas`."""
    values = packed.tolist()
    metas = []
    for k in range(values[0]):
        base = 1 + k * _FIELDS
        ndim = values[base + 2]
        shape = tuple(values[base + 3 : base + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[values[base]], bool(values[base + 1])))
    return tuple(metas)


class DeadlineWatchdog:
    """A thread that holds waits which do not block the host to their deadline.

    On CUDA, waiting for a batched call only makes the compute stream wait for the comm stream;
    the host runs on and would only block later, deep inside an unrelated sync.  Each such wait
    is registered here with its deadline and description; the thread polls
    ``Work.is_completed()`` (an event query, never a block) and, when one is overdue, hands a
    :class:`PipelineTimeoutError` naming the transfer to `on_timeout` (which ends the process:
    the main thread may be stuck in a CUDA sync it cannot leave).

    The thread makes `device` its current CUDA device before its first query, so querying the
    events of rank r's GPU creates no context on GPU 0.  It holds only `on_timeout` and the
    works being watched; :meth:`stop` ends and joins it (at the end of every run and sweep job).

    Args:
        on_timeout: called once, from the watchdog thread, with the error.
        poll_s: how often the pending waits are checked.
        device: the rank's device; a CUDA device becomes the thread's current device.
    """

    def __init__(
        self, on_timeout: Callable[[PipelineTimeoutError], None], poll_s: float = 0.2,
        device: torch.device | str | None = None,
    ) -> None:
        self.on_timeout = on_timeout
        self.poll_s = poll_s
        self.device = None if device is None else torch.device(device)
        self._pending: list[tuple[float, float, Sequence[dist.Work], str, str | Callable[[], str]]] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeflow-p2p-watchdog", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def watch(self, works: Sequence[dist.Work], deadline_s: float, where: str, what: str | Callable[[], str]) -> None:
        """Hold `works` to `deadline_s` seconds from now; `where` and `what` name the rank and the
        transfer in the error (`what` may be a function, called only then)."""
        with self._lock:
            self._pending.append((time.monotonic() + deadline_s, deadline_s, works, where, what))

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread and join it; forget the pending waits (idempotent)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        with self._lock:
            self._pending.clear()

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the thread's current device starts as GPU 0
        while not self._stopped.wait(self.poll_s):
            now = time.monotonic()
            with self._lock:
                self._pending = [p for p in self._pending if not all(w.is_completed() for w in p[2])]
                overdue = next((p for p in self._pending if p[0] < now), None)
            if overdue is not None:
                self._stopped.set()
                _, deadline_s, _, where, what = overdue
                self.on_timeout(PipelineTimeoutError(
                    f"{where}: no progress within {deadline_s} s (comm.timeout_s; comm.first_step_timeout_s in the first "
                    f"step) while waiting to {what() if callable(what) else what}; noticed by the P2P watchdog "
                    f"(this wait does not block the host). A peer is stuck, dead or running a different program; "
                    f"raise comm.timeout_s if the step is just slow."
                ))


class Deadlines:
    """The deadline of every wait of a run: `first_step_s` until the first training step is done
    (lazy start-up, shape negotiation, ranks still building), `steady_s` after; one switch for
    the P2P waits and the timeouts of the process groups the run owns.

    A group handed to :meth:`own` gets the collective timeout that goes with the current
    deadline (the deadline plus a margin, :mod:`pipeflow.runtime.world.timeouts`), now and again at
    the switch, so a P2P wait always reaches pipeflow's deadline (and its named error) before
    the backend gives up on the group (NCCL aborts without naming a transfer).

    Args:
        first_step_s: the deadline until :meth:`first_step_done` (None: wait forever, and the
            groups keep the timeouts they were created with).
        steady_s: the deadline after it (default: `first_step_s`).
        collectives: own the default process group from the start.
    """

    def __init__(self, first_step_s: float | None, steady_s: float | None = None, collectives: bool = False) -> None:
        self.first_step_s = first_step_s
        self.steady_s = first_step_s if steady_s is None else steady_s
        self.collectives = collectives
        self.current = first_step_s
        self._groups: list[dist.ProcessGroup | None] = []
        if collectives:
            self.own(None)

    @property
    def collective_s(self) -> float | None:
        """The timeout the owned groups have now (None: left as created)."""
        return timeouts.collective_timeout_s(self.current)

    def own(self, group: dist.ProcessGroup | None) -> None:
        """Give `group` (None: the default group) the current collective timeout, and switch it
        with the deadlines from now on (a group owned twice is set once)."""
        if any(g is group for g in self._groups):
            return
        self._groups.append(group)
        if self.collective_s is not None:
            timeouts.set_group_timeout(group, self.collective_s)

    def first_step_done(self) -> None:
        """Switch to the steady deadline, and every owned group to its timeout (idempotent)."""
        if self.current == self.steady_s:
            return
        self.current = self.steady_s
        if self.collective_s is not None:
            for group in self._groups:
                timeouts.set_group_timeout(group, self.collective_s)


class P2PComm:
    """Batched point-to-point exchange inside one pipeline process group.

    Args:
        group: the pipeline process group (None = the default group).
        device: where receive buffers live (``cuda:LOCAL_RANK`` with NCCL, CPU with gloo).
        timeout_s: a fixed deadline for each batched call's completion (None: wait forever);
            ignored when `deadlines` is given.
        host_blocking: whether :meth:`wait` blocks the host with the deadline (gloo, CPU);
            default: everywhere but CUDA, where a wait only orders the streams and the deadline
            is kept by `watchdog` when one is given.
        deadlines: deadlines that switch after the first training step (the run's).
        watchdog: keeps the deadline of waits that do not block the host (CUDA).
    """

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None = None,
        host_blocking: bool | None = None, deadlines: Deadlines | None = None, watchdog: DeadlineWatchdog | None = None,
    ) -> None:
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.deadlines = deadlines if deadlines is not None else Deadlines(timeout_s)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]
        self.independent_ops = not _coalesces(group, self.device)
        self.host_blocking = self.device.type != "cuda" if host_blocking is None else host_blocking
        self.watchdog = watchdog

    @property
    def timeout_s(self) -> float | None:
        """The deadline a wait gets now (see :class:`Deadlines`)."""
        return self.deadlines.current

    def close(self) -> None:
        """Stop the watchdog, if any (its thread ends and is joined); the group stays usable."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def post(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
        what: str | Callable[[], str] = "",
    ) -> list[dist.Work]:
        """Post `sends` and `recvs` as one batched call without waiting; returns one Work per
        transfer, sends first.

        Every transfer goes through ``dist.batch_isend_irecv``, whatever the backend.  With a
        backend whose ops complete one by one (gloo: one Work per op) each can be waited on
        alone.  With a coalescing backend (NCCL) the batch is one group on the communicator's
        own stream that completes as a whole: its single Work stands for every transfer, and
        waiting on it makes the current stream wait for the group (an event, not a device-wide
        sync).  A backend failure while posting (a peer already gone) is a named CommError, as
        in :meth:`exchange`; `what` describes the ops (or a function making the text on failure).
        """
        ops = [dist.P2POp(dist.isend, t, self._global[peer], self.group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global[peer], self.group) for peer, t in recvs]
        if not ops:
            return []
        for _, t in recvs:  # a pooled buffer refilled in place: what was derived from its old values
            torch.autograd.graph.increment_version(t)  # (cached on its version) must see it changed
        try:
            works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
        except RuntimeError as exc:
            raise self._failure(exc, what() if callable(what) else what, self.timeout_s) from exc
        return works if len(works) == len(ops) else works[:1] * len(ops)

    def wait(
        self, works: Sequence[dist.Work], what: str | Callable[[], str] = "", timeout_s: float | None = None
    ) -> None:
        """Wait for `works` posted by :meth:`post`.

        Args:
            works: the works to complete (a work listed twice, one group's, is waited once).
            what: description for error messages, or a function making it (built on failure only).
            timeout_s: overrides the communicator's deadline.  On CUDA the wait only orders the
                current stream after the comm stream (a host-side timed wait would block the CPU
                each step); the deadline there is kept by :attr:`watchdog` when one is set, and
                by the process group's own timeout (NCCL watchdog) in any case.

        Raises:
            PipelineTimeoutError, CommError: as for :meth:`exchange`.
        """
        deadline = timeout_s if timeout_s is not None else self.timeout_s
        works = _unique(works)
        if self.host_blocking:
            self._wait_all(works, deadline, what)
            return
        if self.watchdog is not None and deadline is not None:
            self.watchdog.watch(works, deadline, self._where(), what)
        self._wait_all(works, None, what)

    def _wait_all(self, works: Sequence[dist.Work], deadline: float | None, what: str | Callable[[], str]) -> None:
        """Wait for every work (gloo returns several per batched call: dropping one hangs,
        pytorch/pytorch#132644); a failure becomes a named CommError."""
        try:
            for work in works:
                if deadline is None:
                    work.wait()
                else:
                    work.wait(datetime.timedelta(seconds=deadline))
        except RuntimeError as exc:
            raise self._failure(exc, what() if callable(what) else what, deadline) from exc

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank`."""
        return self._global[pp_rank]

    def warmup(self) -> None:
        """One collective batched ring exchange, so NCCL's first batched call involves every rank.

        NCCL requires the first `batch_isend_irecv` on a group to include all its ranks
        (pytorch/pytorch#74701); later calls may involve any subset.
        """
        if self.size == 1:
            return
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        out = torch.full((1,), float(self.rank), device=self.device)
        buf = torch.empty(1, device=self.device)
        self.exchange([(nxt, out)], [(prv, buf)], what="warm-up ring exchange")
        if int(buf.item()) != prv:
            raise CommError(f"rank {self.rank}: warm-up received {buf.item()} from rank {prv}")

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        what: str = "",
        timeout_s: float | None = None,
    ) -> None:
        """Post all `sends` and `recvs` as one batched call and wait for every op to complete.

        Args:
            sends: (peer pipeline rank, tensor) pairs, in per-peer order.
            recvs: (peer pipeline rank, buffer) pairs; buffers are filled in place.
            what: description of the ops for error messages (action, micro-batch, step).
            timeout_s: overrides the communicator's deadline for this call.

        Raises:
            PipelineTimeoutError: the call did not complete in time.
            CommError: the backend reported a failure (e.g. a dead peer).
        """
        deadline = timeout_s if timeout_s is not None else self.timeout_s
        works = self.post(sends, recvs, what)
        self._wait_all(_unique(works), deadline, what)

    def _where(self) -> str:
        return f"pipeline rank {self.rank} (global rank {self._global[self.rank]})"

    def _failure(self, exc: RuntimeError, what: str, deadline: float | None) -> CommError:
        text = str(exc)
        where = self._where()
        if "timed out" in text.lower() or "timeout" in text.lower():
            return PipelineTimeoutError(
                f"{where}: no progress within {deadline} s (comm.timeout_s; comm.first_step_timeout_s in the first step) while waiting to {what}. "
                f"A peer is stuck, dead or running a different program; raise comm.timeout_s if "
                f"the step is just slow. Backend said: {text.splitlines()[0] if text else ''}"
            )
        return CommError(f"{where}: batched P2P call failed while trying to {what}: {text}{hosts.of_addresses(text)}")

    def send_metas(self, peer: int, plan: Sequence[Sequence[TensorMeta]], what: str = "") -> None:
        """Send the tensor metadata of one or more micro-batches to `peer` (one small batched send
        of ``len(plan) x META_LEN`` int64).

        Raises:
            UnsendableDtypeError: a tensor of a dtype NCCL cannot send would follow (before
                anything is sent).
        """
        for meta in (m for metas in plan for m in metas):
            if meta.dtype in UNSENDABLE:
                raise UnsendableDtypeError(
                    f"{self._where()}: the tensor {meta} {what} would be sent to pipeline rank {peer}, but NCCL "
                    f"cannot send {str(meta.dtype).removeprefix('torch.')} (refused on every backend); cast it to "
                    f"{UNSENDABLE[meta.dtype]} in the stage that makes it, or keep both stages on one rank"
                )
        packed = torch.stack([encode_metas(metas) for metas in plan]).to(self.device)
        self.exchange([(peer, packed)], [], what=f"send shapes {what}")

    def recv_metas(self, peer: int, count: int = 1, what: str = "") -> list[tuple[TensorMeta, ...]]:
        """Receive the tensor metadata of `count` micro-batches from `peer` (see :meth:`send_metas`)."""
        buf = torch.empty(count, META_LEN, dtype=torch.int64, device=self.device)
        self.exchange([], [(peer, buf)], what=f"recv shapes {what}")
        return [decode_metas(row) for row in buf.cpu()]


def _unique(works: Sequence[dist.Work]) -> list[dist.Work]:
    """`works` with each Work once, in order (a coalesced group's Work stands for several ops)."""
    return list({id(w): w for w in works}.values())


def _coalesces(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True if `batch_isend_irecv` on `group` makes one coalesced group (NCCL), not one op each."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return bool(getattr(pg._get_backend(device), "supports_coalescing", False))
    except RuntimeError:  # no backend for this device type
        return False


def send_recv(
    tensor: torch.Tensor,
    dst: int,
    src: int,
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Send `tensor` to global rank `dst` and receive a tensor from `src`, in one batched call.

    torch.distributed has no simultaneous send-and-receive; posting both ops in one
    `batch_isend_irecv` avoids the deadlock of a blocking send followed by a blocking recv.

    Args:
        tensor: what to send.
        dst: global rank to send to.
        src: global rank to receive from.
        group: process group (None = default group).
        out: receive buffer; defaults to ``torch.empty_like(tensor)`` (same shape and dtype).

    Returns:
        The received tensor.
    """
    buf = torch.empty_like(tensor) if out is None else out
    ops = [dist.P2POp(dist.isend, tensor, dst, group), dist.P2POp(dist.irecv, buf, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return buf
