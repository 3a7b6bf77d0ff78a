"""Run many test cases inside one gloo process group (start-up costs once per world, not per case).

`run_cases(world_size, cases)` spawns `world_size` processes; each joins one gloo group and runs
every case (a picklable callable taking no arguments) in order, recording its return value or
its exception text per rank.  Cases that may break the group (time-outs) must come last.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60  # a case that fails on one rank must not hang the others for long
WORLD_DEADLINE_S = 420  # the whole world is killed after this


@dataclass
class CaseResult:
    """What one rank saw for one case: a value, or the error it raised."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, cases: Sequence[tuple[str, Callable[[], Any]]], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results: dict[str, CaseResult] = {}
    for name, case in cases:
        try:
            results[name] = CaseResult(value=case())
        except Exception as exc:  # recorded, asserted by the test that owns the case
            results[name] = CaseResult(error=f"{exc}\n{traceback.format_exc()}", error_type=type(exc).__name__)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    # A case may have left a peer's op unmatched (fault tests); do not wait on the group.
    os._exit(0)


def run_cases(world_size: int, cases: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, list[CaseResult]]:
    """Run `cases` on `world_size` gloo processes.

    Returns:
        ``results[name][rank]`` for every case.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker, args=(world_size, _free_port(), list(cases), out_dir), nprocs=world_size,
            start_method="spawn", join=False,
        )
        deadline = time.monotonic() + WORLD_DEADLINE_S
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for proc in context.processes:
                    proc.kill()
                raise TimeoutError(f"{world_size}-process test world still running after {WORLD_DEADLINE_S} s")
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    return {name: [per_rank[r][name] for r in range(world_size)] for name, _ in cases}
