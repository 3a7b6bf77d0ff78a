"""Run many test cases inside one gloo process group (start-up costs once per world, not per case).

`run_cases(world_size, cases)` starts `world_size` processes, each a fork of the suite's warm
server (tests/warm.py: torch, Hydra and pipeflow already imported), with this process's
environment; each joins one gloo group and runs every case (a picklable callable taking no
arguments) in order, recording its return value or its exception text per rank.  After each
case the ranks meet; a case that breaks the world (a rank dies or hangs in it, or meets a
timeout) is named, and the cases after it run in a new world.  Each rank's output is printed
after the world ends (pytest shows it with a failing test).
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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
    broke_world: str | None = None  # why its world could not go on after it (the next cases ran in a new one)


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


class WorldRestarted(UserWarning):
    """A case broke its world and the cases after it ran in a new one (pytest's warnings summary)."""


BROKEN_EXIT = 3  # a rank's exit status when its world cannot run the next case
CHECK_TIMEOUT_S = 30  # every rank meets after each case within this
MAX_WORLDS = 4  # worlds one run_cases may start (a world broken by a case is restarted for the rest)
_BROKEN = "__world_broken__"  # the record a rank writes before it leaves a broken world


def _unusable_after_case(timed_out: bool) -> str | None:
    """Why the group cannot run the next case: a rank did not meet the others, or one met a
    timeout (it leaves unmatched operations in the group, which a later case would receive);
    None where it can.  Collective: every rank that meets gets the same answer."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(timed_out)])
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=CHECK_TIMEOUT_S))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    except Exception as exc:  # noqa: BLE001 - a peer gone or stuck: the world is over
        return f"the ranks did not meet after it ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
    return "a rank met a timeout in it, which may leave unmatched operations in the group" if flag.item() else None


def _worker(rank: int, world_size: int, port: int, cases: Sequence[tuple[str, Callable[[], Any]]], out_dir: str,
            env: Mapping[str, str]) -> None:
    log = os.path.join(out_dir, f"rank{rank}.log")
    warm.become({**env, "OMP_NUM_THREADS": "1"}, log, log)  # one intra-op thread per rank
    import torch.distributed as dist

    from pipeflow.errors import JoinTimeoutError, PipelineTimeoutError

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    timeouts = (TimeoutError, dist.DistError, PipelineTimeoutError, JoinTimeoutError)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as out:
        for name, case in cases:  # each result written as it comes: a rank that dies keeps the ones before
            started = time.perf_counter()
            timed_out = False
            try:
                result = CaseResult(value=case())
            except Exception as exc:  # recorded, asserted by the test that owns the case
                result = CaseResult(error=f"{exc}\n{traceback.format_exc()}", error_type=type(exc).__name__)
                timed_out = isinstance(exc, timeouts)
            result.seconds = time.perf_counter() - started
            pickle.dump((name, result), out)
            out.flush()
            why = _unusable_after_case(timed_out)
            if why is not None:
                pickle.dump((_BROKEN, why), out)
                out.flush()
                print(f"[harness] the world cannot go on after case {name!r}: {why}", flush=True)
                os._exit(BROKEN_EXIT)
    sys.stdout.flush()
    sys.stderr.flush()
    # A case may have left a peer's op unmatched (fault tests); do not wait on the group.
    os._exit(0)


def _read_results(path: str) -> tuple[dict[str, CaseResult], str | None]:
    """A rank's results in case order, and why it left its world broken (None: it did not)."""
    results: dict[str, CaseResult] = {}
    why = None
    if os.path.exists(path):
        with open(path, "rb") as f:
            while True:
                try:
                    name, value = pickle.load(f)
                except (EOFError, pickle.UnpicklingError):  # the end, or a rank killed mid-write
                    break
                if name == _BROKEN:
                    why = value
                else:
                    results[name] = value
    return results, why


def _run_world(world_size: int, cases: Sequence[tuple[str, Callable[[], Any]]]
               ) -> tuple[list[dict[str, CaseResult]], list[int | None], list[str | None], dict[int, str]]:
    """One world running `cases` until they end or it breaks: per rank its results, exit status
    (None: killed at the deadline), why it left broken, and its output."""
    with tempfile.TemporaryDirectory() as out_dir:
        port, env = _free_port(), dict(os.environ)
        procs = warm.processes(_worker, lambda rank: (rank, world_size, port, list(cases), out_dir, env), world_size)
        deadline = time.monotonic() + WORLD_DEADLINE_S
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        codes = [proc.exitcode for proc in procs]
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        logs, per_rank, whys = {}, [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.log")
            logs[rank] = Path(path).read_text(errors="replace") if os.path.exists(path) else ""
            if logs[rank]:
                print(f"---- rank {rank} of the {world_size}-process world ----\n{logs[rank]}")
            results, why = _read_results(os.path.join(out_dir, f"rank{rank}.pkl"))
            per_rank.append(results)
            whys.append(why)
    return per_rank, codes, whys, logs


def _left(code: int | None) -> str:
    if code is None:
        return f"was still running at the world's deadline ({WORLD_DEADLINE_S} s) and was killed"
    return f"died of signal {-code}" if code < 0 else f"exited {code}"


def run_cases(world_size: int, cases: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, list[CaseResult]]:
    """Run `cases` on `world_size` gloo processes, in order.

    A case that breaks its world (a rank dies or hangs in it, the ranks cannot meet after it, or
    one meets a timeout in it) is recorded as such (``broke_world``; a rank that did not finish
    it gets an error saying how it left), named in a :class:`WorldRestarted` warning, and the
    cases after it run in a new world: up to :data:`MAX_WORLDS` worlds, then the rest are recorded as not run.

    Returns:
        ``results[name][rank]`` for every case.

    Raises:
        RuntimeError: the first world ran no case at all (its ranks' output is in the message).
    """
    results = WorldResults()
    remaining = list(cases)
    for world in range(MAX_WORLDS):
        per_rank, codes, whys, logs = _run_world(world_size, remaining)
        counts = [len(done) for done in per_rank]
        if world == 0 and not any(counts):
            raise RuntimeError(f"the {world_size}-process world ran no case (exit statuses {codes}):\n"
                               + "\n".join(f"rank {r}: {logs[r][-3000:]}" for r in range(world_size)))
        finished = min(counts)
        for name, _ in remaining[:finished]:
            results[name] = [per_rank[r][name] for r in range(world_size)]
        if finished == len(remaining):
            break
        # every rank ran the same cases and one stopped at the check after the last: that case broke it
        stopped_after = len(set(counts)) == 1 and BROKEN_EXIT in codes
        breaker = finished - 1 if stopped_after else finished
        name = remaining[breaker][0]
        if stopped_after:
            why = "; ".join([next(w for w in whys if w)] + [f"rank {r} {_left(code)}" for r, code in enumerate(codes)
                                                           if code not in (0, BROKEN_EXIT)])
        else:
            gone = [r for r in range(world_size) if name not in per_rank[r]]
            why = "; ".join(f"rank {r} {_left(codes[r])} during it" for r in gone)
            results[name] = [per_rank[r].get(name) or CaseResult(error=f"rank {r} {_left(codes[r])} during this case",
                                                                 error_type="WorldBroken")
                             for r in range(world_size)]
        for result in results[name]:
            result.broke_world = why
        after = len(remaining) - breaker - 1
        warnings.warn(WorldRestarted(f"{world_size}-process world: case {name!r} broke it ({why}); the {after} "
                                     f"case{'' if after == 1 else 's'} after it ran in a new world"))
        remaining = remaining[breaker + 1:]
    else:
        for name, _ in remaining:
            results[name] = [CaseResult(error=f"not run: {MAX_WORLDS} worlds broke before this case",
                                        error_type="WorldBroken") for _ in range(world_size)]
    results = WorldResults({name: results[name] for name, _ in cases})
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
