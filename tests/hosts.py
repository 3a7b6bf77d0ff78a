"""Emulated hosts for the multi-host tests (:class:`examples.emulated_hosts.EmulatedHosts`):
network namespaces with their own addresses, names and links on one machine.  Every test that
uses them skips with the reason where they cannot be made (not root, namespaces refused)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from examples.emulated_hosts import EmulatedHosts, unavailable  # noqa: E402
from warm_exec import interpreters  # noqa: E402

__all__ = ["EmulatedHosts", "emulated_hosts", "launch_on_hosts", "outputs", "SMALL64"]

# a tiny float64 GPT: per-step losses across hosts must equal one process's to rounding
SMALL64 = ["model.n_layer=4", "model.n_embd=16", "model.n_head=2", "data.batch_size=8", "data.num_tokens=4000",
           "data.seq_len=16", "model.block_size=16", "train.dtype=float64", "train.eval_every=0", "train.eval_batches=1",
           "train.log_every=1", "pipeline.profile=false", "metrics.tensorboard=false", "comm.timeout_s=5",
           "comm.first_step_timeout_s=60", "comm.join_timeout_s=60"]
# a test that holds a job (the `hold` fault: a host joins, a link is throttled) holds it this long at
# most; the held rank's peers wait as long (SMALL64's 5 s ran out on a loaded CI machine: a peer's
# timeout restarted the job)
HELD_FOR_S = 300
SMALL64_HELD = [*(o for o in SMALL64 if not o.startswith(("comm.timeout_s=", "comm.first_step_timeout_s="))),
                f"comm.timeout_s={HELD_FOR_S}", f"comm.first_step_timeout_s={HELD_FOR_S}"]


@pytest.fixture
def emulated_hosts() -> Iterator[type[EmulatedHosts]]:
    """:class:`EmulatedHosts`, or a skip saying why they cannot be made here; use it as a context
    manager (every process, namespace and file is removed when it closes)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    yield EmulatedHosts


# The rendezvous's heartbeats under the suite's load: every 4 s, an agent dead after 5 missed (20
# s), not the launcher's 1 s for 3.  Emulated hosts share 2 cores with the rest of the suite:
# agents writing the rendezvous state each second lose its compare-and-set to each other until one
# is taken for dead and dropped from a round it had joined (a "2-node" job formed of one host's
# ranks; a rank assignment waiting 60 s for the dropped agent; with 4 beats, at a load of 7, the
# joining host of the growing job, whose round then never completed); every 2 s, a starved agent
# of three still lost every compare-and-set for 30 s, and the round closed without it.
# PIPEFLOW_LAUNCH_VERBOSE=1 shows those steps.
# A round of an elastic range (--nnodes 2:3) closes 30 s (torch's own default), not the launcher's
# 2 s, after its minimum is there: a third agent polling the state once a second under that load
# missed 2 s, and once 10 s, so the job went on with 2 hosts and grew a restart later (at start,
# the third host came a round late).  The rendezvous store's reads wait 120 s, not torch's 60 s
# (a re-formed round's read timed out).
UNDER_LOAD_RDZV = {"keep_alive_interval": 4, "keep_alive_max_attempt": 5, "last_call_timeout": 30, "read_timeout": 120}


def rdzv_conf(**changes: int) -> str:
    """``--rdzv-conf`` of :data:`UNDER_LOAD_RDZV` with `changes`."""
    return ",".join(f"{key}={value}" for key, value in {**UNDER_LOAD_RDZV, **changes}.items())


UNDER_LOAD_RDZV_CONF = rdzv_conf()


def launch_on_hosts(hosts: EmulatedHosts, overrides: list[str], nproc: int = 2, torchrun_args: str = "",
                    nnodes: str | None = None, timeout_s: float = 120, env: dict[str, str] | None = None,
                    on: list[int] | None = None, warm_workers: bool = True,
                    rdzv_conf: str | None = UNDER_LOAD_RDZV_CONF) -> list[subprocess.Popen]:
    """``examples/multinode.sh`` with `overrides` on every host (or those in `on`), the endpoint on
    host 0: the launcher (``python -m pipeflow.launch``, torchrun's agent inside it) and its
    workers warm forks joined to the host (``tests/warm_exec.py``: the same code, signals and exit
    statuses, no interpreter start), or every one a fresh interpreter when `warm_workers` is false.
    `rdzv_conf` joins `torchrun_args` unless they set ``--rdzv-conf`` (None: the launcher's own)."""
    if rdzv_conf and "--rdzv-conf" not in torchrun_args and "--rdzv_conf" not in torchrun_args:
        torchrun_args = f"{torchrun_args} --rdzv-conf {rdzv_conf}".strip()
    base = {"NNODES": nnodes or str(hosts.count), "NPROC": str(nproc), "ENDPOINT": hosts.endpoint(),
            "RUN_ID": f"t{os.getpid()}", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "TORCHRUN_ARGS": torchrun_args, **(interpreters(launchers=True) if warm_workers else {}), **(env or {})}
    return [hosts.run(i, [str(ROOT / "examples" / "multinode.sh"), *overrides], base, timeout_s)
            for i in (on if on is not None else range(hosts.count))]


def outputs(procs: list[subprocess.Popen], timeout_s: float = 150) -> list[str]:
    """Each process's output once it ended (killed at `timeout_s`)."""
    texts = []
    for proc in procs:
        try:
            texts.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            texts.append(proc.communicate()[0] + "\n[test: killed at the timeout]")
    return texts


def step_losses(text: str) -> dict[int, float]:
    """``step N/M | loss L`` lines as {N: L}."""
    return {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)/\d+ \| loss ([\d.]+)", text)}


def watch_lines(procs: list[subprocess.Popen]) -> tuple[list[list[tuple[float, str]]], list[threading.Thread]]:
    """Each process's output lines with the time each arrived, collected by a thread per process."""
    lines: list[list[tuple[float, str]]] = [[] for _ in procs]
    threads = [threading.Thread(target=lambda p=p, out=out: out.extend((time.monotonic(), line) for line in p.stdout))
               for p, out in zip(procs, lines)]
    for thread in threads:
        thread.start()
    return lines, threads


def tails(outputs: list[list[tuple[float, str]]], first: int = 1) -> str:
    """The end of each host's output, numbered from `first`: what the other hosts said."""
    return "".join(f"\nhost {i}:\n" + "".join(line for _, line in out)[-2500:] for i, out in enumerate(outputs, first))


EVENTS = re.compile(r"stopped at|preempted|resumed from|re-planned|waits to join|closing signal|restart|rendezvous|"
                    r"[Ee]rror|hold at|step\s+\d+/")


# torch's rendezvous debug lines that repeat every few seconds on every host, the launcher's wait,
# and the step lines but every tenth
CHATTER = re.compile(r"keep-alive|successfully synced|can't complete rendezvous|s of at most \d+ \(--rdzv-conf|"
                     r"INFO step\s+\d*[1-9]/")


def what_hosts_said(outputs: list[list[tuple[float, str]]], limit: int = 12000) -> str:
    """Every host's lines of its job's life (stops, resumes, plans, rendezvous, errors, steps) in
    the order they came, each marked with its host, torch's heartbeat chatter left out: where an
    elastic job went wrong (the last `limit` characters)."""
    said = sorted((at, h, line) for h, out in enumerate(outputs) for at, line in out
                  if EVENTS.search(line) and not CHATTER.search(line))
    return "".join(f"[host {h}] {line}" for _, h, line in said)[-limit:]


def first_line_at(lines: list[tuple[float, str]], pattern: str, timeout_s: float, after: float = 0.0) -> float:
    """The time the first line matching `pattern` arrived (of those arriving at `after` or later),
    waiting up to `timeout_s`."""
    regex, deadline = re.compile(pattern), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for at, line in list(lines):
            if at >= after and regex.search(line):
                return at
        time.sleep(0.02)
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n" + "".join(l for _, l in lines)[-3000:])
