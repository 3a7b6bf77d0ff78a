"""Shared by the benchmark scripts: spawning gloo ranks on this machine, and appending a table to
benchmarks/RESULTS.md with how, where and when it was made."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


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


def spawn_ranks(worker: Callable[..., None], args: argparse.Namespace) -> Any:
    """Run ``worker(rank, args.ranks, port, args, queue)`` in `args.ranks` spawned processes on a
    free local port; returns the one object rank 0 puts on the queue."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(args.ranks, port, args, queue), nprocs=args.ranks, start_method="spawn")
    return queue.get()


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
