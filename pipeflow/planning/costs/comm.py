"""What one batched exchange between neighbouring stages costs here, for the planner's simulation.

Two local processes post a send and a recv to each other in one ``batch_isend_irecv`` (as the
pipeline does at every step) and time it: gloo on CPU tensors, or NCCL on ``cuda:0``/``cuda:1``
when the planner profiles on a GPU and the machine has two.  Spawning costs a few seconds, so
the planner measures once per payload size.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.runtime.transport import send_recv
from pipeflow.runtime.world.distributed import run_local_ranks

_WARMUP = 5


def measure_transfer_s(comm: Any, num_bytes: int, repeats: int = 10) -> float:
    """Seconds of one transfer of `num_bytes` between neighbouring pipeline ranks, measured on the
    run's own pipeline group (collective over the world: every rank gets the same figure): the
    slowest rank's median of both ring directions (:func:`measure_transfers` at that one size).
    Zero for a pipeline of one rank."""
    latency, per_byte, _ = measure_transfers(comm, [num_bytes], repeats)
    return latency + per_byte * num_bytes


def measure_transfers(comm: Any, sizes: list[int], repeats: int = 10, busy: bool = False) -> tuple[float, float, float]:
    """(latency s, s per byte, s to post) of a transfer between neighbouring pipeline ranks, at the
    sizes this model sends, both directions, on the run's own pipeline group (collective over the
    world: every rank gets the slowest rank's figures).

    Each size is timed as a ring to the next rank and as a ring to the previous one (activations
    go one way, gradients the other), posting and waiting timed apart as the runtime does them;
    the medians of the two directions are averaged, ``latency + bytes * per_byte`` is fitted
    through the sizes (one size: no per-byte term).  With `busy`, every rank computes in a thread
    of its own meanwhile (on the CPU: a delivery then waits for a core, as it does while the
    ranks of a host compute).  Zeros for a pipeline of one rank.
    """
    if comm.size == 1:
        return 0.0, 0.0, 0.0
    if busy and comm.device.type == "cpu":
        with _Busy():
            return measure_transfers(comm, sizes, repeats)
    points, posts = [], []
    for num_bytes in sorted(set(max(4, int(n)) for n in sizes)):
        both = []
        for step in (1, -1):
            nxt, prv = (comm.rank + step) % comm.size, (comm.rank - step) % comm.size
            out = torch.zeros(num_bytes // 4, dtype=torch.float32, device=comm.device)
            buf = torch.empty_like(out)
            times, posting = [], []
            for k in range(_WARMUP + repeats):
                start = time.perf_counter()
                works = comm.post([(nxt, out)], [(prv, buf)], "time a transfer for the step model")
                posted = time.perf_counter()
                comm.wait(works, "time a transfer for the step model")
                if comm.device.type == "cuda":
                    torch.cuda.synchronize(comm.device)
                if k >= _WARMUP:
                    times.append(time.perf_counter() - start)
                    posting.append(posted - start)
            both.append(statistics.median(times))
            posts.append(statistics.median(posting))
        points.append((float(num_bytes), sum(both) / 2))
    figures = torch.tensor([*fit_line(points), statistics.median(posts)], dtype=torch.float64, device=comm.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    latency, per_byte, post = figures.tolist()
    return latency, per_byte, post


def exchange_s(comm: Any, peer: int, num_bytes: int, repeats: int, warmup: int = 2,
               what: str = "time a link for the step model") -> float:
    """Median seconds of a send to and a receive from pipeline rank `peer` of `num_bytes` each, in
    one batched call (both directions at once, as a pipeline's steady state has them)."""
    def exchange(out: torch.Tensor, buf: torch.Tensor) -> None:
        comm.wait(comm.post([(peer, out)], [(peer, buf)], what), what)

    return _median_s(comm, num_bytes, repeats, warmup, exchange)


def stream_s(comm: Any, peer: int, num_bytes: int, repeats: int, warmup: int = 2,
             what: str = "time a link for the step model") -> float:
    """Median seconds of one direction's message of `num_bytes` to or from pipeline rank `peer`:
    the lower rank sends, then the higher one (a ping-pong, each direction alone on the link),
    the round halved.  A stream's rate: a full-duplex link gives each direction its own, which two
    directions timed at once on a shaped link (their acknowledgements queued behind the other's
    data) understate by half."""
    first = comm.rank < peer

    def ping_pong(out: torch.Tensor, buf: torch.Tensor) -> None:
        for sending in (first, not first):
            comm.wait(comm.post([(peer, out)], [], what) if sending else comm.post([], [(peer, buf)], what), what)

    return _median_s(comm, num_bytes, repeats, warmup, ping_pong) / 2


def _median_s(comm: Any, num_bytes: int, repeats: int, warmup: int,
              once: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
    """Median seconds of `once(out, buf)` (a message of `num_bytes` out, a buffer as large to
    receive into) after `warmup` untimed calls, the device synchronized within each."""
    out = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32, device=comm.device)
    buf = torch.empty_like(out)
    times = []
    for k in range(warmup + repeats):
        start = time.perf_counter()
        once(out, buf)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Busy:
    """A thread computing (matrix products, the GIL released) while the block runs."""

    def __enter__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, name="pipeflow-busy", daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        a = torch.ones(128, 128)
        while not self.stop.is_set():
            for _ in range(10):
                a @ a

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope >= 0) of the least-squares line through (bytes, seconds); points all at one
    size give their mean time and no slope."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    if all(x == mx for x, _ in points):  # one payload (one micro-batch size): no slope to fit
        return my, 0.0
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points))
    return max(0.0, my - slope * mx), slope


def measure_exchange_s(payload_bytes: list[int], repeats: int = 30, use_cuda: bool = False,
                       timeout_s: float = 120.0, busy: bool = False) -> list[float]:
    """Median seconds of one exchange (send and recv of each payload, both ways) between 2 processes.

    Args:
        payload_bytes: the payload sizes to time, in bytes.
        repeats: timed exchanges per size.
        use_cuda: NCCL between two GPUs (needs two), else gloo on CPU.
        timeout_s: give up after this long.
        busy: each process computes in a thread of its own meanwhile (CPU only; see
            :func:`measure_transfers`).

    Returns:
        Seconds per exchange for each payload size, in order.

    Raises:
        RuntimeError: the measuring processes failed or timed out.
    """
    try:
        return run_local_ranks(_worker, 2, (payload_bytes, repeats, use_cuda, busy), timeout_s)
    except RuntimeError as exc:
        raise RuntimeError(f"measuring the exchange time: {exc}; set plan.comm_latency_ms=<ms> instead") from exc


def _worker(rank: int, port: int, results: Any, sizes: list[int], repeats: int, use_cuda: bool,
            busy: bool = False) -> None:
    """One side of the exchange: time `repeats` batched send+recv pairs per size; rank 0 reports."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    extra: dict[str, Any] = {}
    if use_cuda:  # this process's GPU is its current device before NCCL creates a context
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        extra["device_id"] = device
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2, **extra)
    try:
        if busy and not use_cuda:
            with _Busy():
                times = [_time_exchange(1 - rank, max(1, n // 4), repeats, device) for n in sizes]
        else:
            times = [_time_exchange(1 - rank, max(1, n // 4), repeats, device) for n in sizes]
        if rank == 0:
            results.put(times)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _time_exchange(peer: int, numel: int, repeats: int, device: torch.device) -> float:
    send = torch.zeros(numel, device=device)
    recv = torch.empty_like(send)
    samples = []
    for k in range(_WARMUP + repeats):
        start = time.perf_counter()
        send_recv(send, peer, peer, out=recv)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k >= _WARMUP:
            samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]
