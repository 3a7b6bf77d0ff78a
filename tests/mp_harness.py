"""Run many test cases inside one gloo process group (start-up costs once per world, not per case).

`run_cases(world_size, cases)` starts `world_size` processes, each a fork of the suite's warm
server (tests/warm.py: torch, Hydra and pipeflow already imported), with this process's
environment; each joins one gloo group and runs every case (a picklable callable taking no
arguments) in order, recording its return value or its exception text per rank.  Cases that
may break the group (time-outs) must come last.  Each rank's output is printed after the world
ends (pytest shows it with a failing test).
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

import warm

COLLECTIVE_TIMEOUT_S = 60  # a case that fails on one rank must not hang the others for long
WORLD_DEADLINE_S = 420  # the whole world is killed after this
CASE_TIMES_ENV = "PIPEFLOW_CASE_TIMES"  # set to N: each world prints its N slowest cases


@dataclass
class CaseResult:
    """What one rank saw for one case: a value, or the error it raised."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None
    seconds: float = 0.0  # the case's wall time on this rank


_free_port = warm.free_port
DESELECTED_MODULES: set[str] = set()  # modules some of whose tests this run's selection left out (conftest)


class WorldResults(dict):
    """``results[name][rank]``; a case the selection did not run is named as such."""

    def __missing__(self, name: str) -> list[CaseResult]:
        raise KeyError(f"case {name!r} did not run in this world: the selection (-k, -m) kept only the cases "
                       f"named by the selected tests' parameters ({', '.join(sorted(self))}); run the whole module")


def selected_cases(request: pytest.FixtureRequest,
                   cases: Sequence[tuple[str, Callable[[], Any]]]) -> list[tuple[str, Callable[[], Any]]]:
    """The cases a module fixture's world must run for the tests selected in this run: every one,
    unless the selection (``-k``, ``-m "not slow"``) left out some of the module's tests; then the
    cases whose names contain every string parameter of a selected test (its case), and every
    case as soon as one selected test names none."""
    if request.module.__name__ not in DESELECTED_MODULES:
        return list(cases)
    keep: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or request.fixturename not in item.fixturenames:
            continue
        values = [v for v in getattr(getattr(item, "callspec", None), "params", {}).values() if isinstance(v, str)]
        hits = [name for name, _ in cases if values and all(v in name for v in values)]
        if not hits:
            return list(cases)
        keep.update(hits)
    return [(name, case) for name, case in cases if name in keep]


def _worker(rank: int, world_size: int, port: int, cases: Sequence[tuple[str, Callable[[], Any]]], out_dir: str,
            env: Mapping[str, str]) -> None:
    log = os.path.join(out_dir, f"rank{rank}.log")
    warm.become({**env, "OMP_NUM_THREADS": "1"}, log, log)  # one intra-op thread per rank
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results: dict[str, CaseResult] = {}
    for name, case in cases:
        started = time.perf_counter()
        try:
            results[name] = CaseResult(value=case())
        except Exception as exc:  # recorded, asserted by the test that owns the case
            results[name] = CaseResult(error=f"{exc}\n{traceback.format_exc()}", error_type=type(exc).__name__)
        results[name].seconds = time.perf_counter() - started
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # A case may have left a peer's op unmatched (fault tests); do not wait on the group.
    os._exit(0)


def run_cases(world_size: int, cases: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, list[CaseResult]]:
    """Run `cases` on `world_size` gloo processes.

    Returns:
        ``results[name][rank]`` for every case.

    Raises:
        TimeoutError: the world still ran after :data:`WORLD_DEADLINE_S` (every rank killed).
        RuntimeError: a rank died before it wrote its results (its output is in the message).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        port, env = _free_port(), dict(os.environ)
        procs = warm.processes(_worker, lambda rank: (rank, world_size, port, list(cases), out_dir, env), world_size)
        deadline = time.monotonic() + WORLD_DEADLINE_S
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        late = [rank for rank, proc in enumerate(procs) if proc.exitcode is None]
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        logs = {}
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.log")
            logs[rank] = open(path, errors="replace").read() if os.path.exists(path) else ""
            if logs[rank]:
                print(f"---- rank {rank} of the {world_size}-process world ----\n{logs[rank]}")
        if late:
            raise TimeoutError(f"{world_size}-process test world still running after {WORLD_DEADLINE_S} s "
                               f"(ranks {late} killed)")
        per_rank = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of the {world_size}-process world exited {procs[rank].exitcode} "
                                   f"before writing its results:\n{logs[rank][-4000:]}")
            with open(path, "rb") as f:
                per_rank.append(pickle.load(f))
    results = WorldResults({name: [per_rank[r][name] for r in range(world_size)] for name, _ in cases})
    if os.environ.get(CASE_TIMES_ENV):
        _print_case_times(world_size, results, int(os.environ[CASE_TIMES_ENV]))
    return results


def _print_case_times(world_size: int, results: dict[str, list[CaseResult]], count: int) -> None:
    """The world's `count` slowest cases (the slowest rank's time), to the terminal."""
    slowest = sorted(((max(r.seconds for r in ranks), name) for name, ranks in results.items()), reverse=True)
    total = sum(s for s, _ in slowest)
    lines = [f"{s:7.2f}s {name}" for s, name in slowest[:count]]
    sys.__stderr__.write(f"\n[{world_size}-process world: {len(results)} cases, {total:.1f} s; the slowest]\n"
                         + "\n".join(lines) + "\n")
