"""The benchmarks' one runner: gloo ranks spawned on this machine, each rank's group set up and torn
down, steps timed on the slowest rank in alternating rounds, medians and per-round ratios, and the
table printed and appended to benchmarks/RESULTS.md with how, where and when it was made.

Every script of ``benchmarks/<group>/`` imports it as ``benchmarks.runner`` (the script puts the
tree's root first on ``sys.path``, so that ``python benchmarks/ab.py`` measures each tree's own code).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

T = TypeVar("T")
W = TypeVar("W", bound=Callable[..., None])


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean square error, the loss of every benchmark model; computed in float32 at least (a
    bf16/fp16 output is upcast, a float64 one is kept)."""
    return (output.to(torch.promote_types(output.dtype, torch.float32)) - target).pow(2).mean()


def microbatches(
    x: torch.Tensor, y: torch.Tensor, m: int, stages: Any, num_stages: int
) -> tuple[list[tuple[torch.Tensor]] | None, list[torch.Tensor] | None]:
    """`Pipeline.run`'s inputs and targets from one batch split into `m` micro-batches: the
    inputs where this rank holds stage 0, the targets where it holds the last stage."""
    inputs = [(mb,) for mb in x.chunk(m)] if 0 in stages else None
    targets = list(y.chunk(m)) if num_stages - 1 in stages else None
    return inputs, targets


def benchmark_parser(script: str, doc: str | None, out: bool = True) -> argparse.ArgumentParser:
    """The command line of the benchmark `script` (its ``__file__``, in ``benchmarks/<group>/``):
    usage ``python benchmarks/<group>/<name>.py``, the first line of its docstring `doc` as the
    description, and with `out` an ``--out FILE`` option (:func:`report` appends the table there)."""
    path = Path(script).resolve()
    description = doc.strip().splitlines()[0] if doc else None
    parser = argparse.ArgumentParser(prog=f"python {path.relative_to(path.parents[2]).as_posix()}",
                                     description=description)
    if out:
        parser.add_argument("--out", default=None, metavar="FILE",
                            help="also append the table to FILE (markdown, e.g. benchmarks/RESULTS.md)")
    return parser


def spawn_ranks(worker: Callable[..., None], args: argparse.Namespace) -> Any:
    """Run ``worker(rank, args.ranks, port, args, queue)`` in `args.ranks` spawned processes on a
    free local port; returns the one object rank 0 puts on the queue."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(args.ranks, port, args, queue), nprocs=args.ranks, start_method="spawn")
    return queue.get()


def gloo_worker(threads: int = 1, timeout: datetime.timedelta | None = None) -> Callable[[W], W]:
    """A :func:`spawn_ranks` worker, ``worker(rank, world, port, args, queue)``, run as rank `rank`
    of a gloo group of `world` ranks on the local `port`, torch on `threads` threads; after it
    returns, a barrier (rank 0 has put its result) and the group destroyed."""
    def wrap(worker: W) -> W:
        @functools.wraps(worker)
        def run(rank: int, world: int, port: int, *rest: Any) -> None:
            torch.set_num_threads(threads)
            options = {} if timeout is None else {"timeout": timeout}
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    **options)
            try:
                worker(rank, world, port, *rest)
                dist.barrier()
            finally:
                dist.destroy_process_group()
        return run  # type: ignore[return-value]
    return wrap


def timed_train_steps(trainer: Any, steps: int, untimed: int = 2) -> list[float]:
    """Train `untimed` + `steps` steps barrier to barrier (collective); the seconds of the timed
    ones (step 0 builds shapes and optimizer state, step 1 is the one memory is measured at)."""
    import torch.distributed as dist

    times: list[float] = []
    for step in range(steps + untimed):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(step)
        dist.barrier()
        if step >= untimed:
            times.append(time.perf_counter() - start)
    return times


def slowest_seconds(step: Callable[[], T], device: torch.device | None = None) -> tuple[float, T]:
    """(the slowest rank's seconds, what `step()` returned) of one call, every rank starting
    together: a barrier, the call, the max over the ranks (one all-reduce).

    On CUDA the device is drained before the clock starts and again before it stops (a step's
    host code returns once its kernels are queued), and the time travels in a tensor on the
    device (NCCL reduces only CUDA tensors)."""
    dist.barrier()
    _synchronize(device)
    start = time.perf_counter()
    result = step()
    _synchronize(device)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), result


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate_rounds(contestants: Mapping[str, Callable[[int], Callable[[], Any]]], rounds: int,
                     warmup: int = 0) -> dict[str, list[float]]:
    """The slowest rank's seconds of every contestant's step over `warmup` + `rounds` rounds,
    each round running every contestant once, in turn (a machine that slows down or speeds up
    weighs on all alike); the warm-up rounds dropped.

    Args:
        contestants: name -> a function that, given the round, makes what its step needs and
            returns the step to time (:func:`slowest_seconds`).
    """
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for n in range(warmup + rounds):
        for name, prepare in contestants.items():
            took, _ = slowest_seconds(prepare(n))
            if n >= warmup:
                times[name].append(took)
    return times


def medians(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of every contestant's times."""
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the per-round ratios a / b (each round's two steps ran side by side)."""
    return statistics.median(x / y for x, y in zip(a, b))


def spawn_per_degree(worker: Callable[..., None], args: argparse.Namespace, degrees: list[int], name: str
                     ) -> dict[int, Any]:
    """:func:`spawn_ranks` once per degree (``args.pp`` x degree processes, a shared
    ``args.tmp`` directory): ``{degree: rank 0's result}``, a ``<name>=<degree> done`` line each."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for degree in degrees:
            args.ranks = degree * args.pp
            results[degree] = spawn_ranks(worker, args)
            print(f"{name}={degree} done", flush=True)
    return results


def failure_line(log: str) -> str:
    """The line of a failed run's output that names its error (the last with ``Error``,
    ``error:`` or ``terminate called``), else its last line; at most 160 characters."""
    lines = log.strip().splitlines() or ["no output"]
    named = [line for line in lines if re.search(r"Error|error:|terminate called", line)]
    return (named or lines)[-1][:160]


def append_result(path: str, title: str, command: str, text: str, backend: str = "gloo", device_name: str = "") -> None:
    """Append `text` under a heading `title (date UTC)` and a line with the command and machine."""
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores" + (f", {device_name}" if device_name else "")
    header = (
        f"\n### {title} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n\n"
        f"`{command}` on {machine}, torch {torch.__version__}, {backend}, "
        f"load average {os.getloadavg()[0]:.1f} at the end\n\n"
    )
    with open(path, "a") as f:
        f.write(header + text + "\n")


def report(title: str, text: str, out: str | None) -> None:
    """Print the table `text`; with `out`, also append it there under `title` with this command."""
    print(text)
    if out:
        append_result(out, title, f"python {' '.join(sys.argv)}", text)
