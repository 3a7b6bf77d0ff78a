"""Warm processes for the suite: every multi-process test forks from one server that imported
torch, Hydra, transformers and pipeflow once for the whole test run.

On 2 cores an interpreter that imports torch and pipeflow costs seconds; the suite used to pay
it for every rank of every world and every rank (and agent) of every ``torchrun train.py``.
Here a :mod:`multiprocessing` fork server (``forkserver`` start method, its modules preloaded
with ``set_forkserver_preload``, as PyTorch's own suites and DataLoader workers use it) is
started once per pytest process, and

- :func:`processes` starts the ranks of a gloo world (``mp_harness.run_cases``): each a fork;
- :func:`launch` runs an entry point (``train.py``, ``python -m pipeflow.plan``, a script) on
  ``nproc`` forked ranks with the environment torchrun gives its workers (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` ...), or as one plain ``python`` process (``nproc=None``),
  and returns what ``subprocess.run`` returns.

Each fork starts from the server's pristine state (nothing a test did leaks into the next),
with the caller's environment, working directory and ``sys.path``.  What :func:`launch` does
not do is torchrun's agent: no rendezvous, no restarts, no failure report of its own.  Tests
whose subject is the launcher (torchrun, ``python -m pipeflow.launch``, signals to the job,
emulated hosts, restarts) launch for real.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Imported once by the server; a module that fails to import is skipped (the fork imports it, or fails, itself).
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "torch.multiprocessing",
    "numpy", "hydra", "omegaconf", "pytest", "tensorboard.backend.event_processing.event_accumulator",
    "torch.utils.tensorboard", "transformers", "safetensors.torch", "pipeflow", "pipeflow.run.builder",
    "pipeflow.config.schema", "pipeflow.run.trainer", "pipeflow.commands.sweep", "pipeflow.commands.plan.command",
    "pipeflow.models", "pipeflow.runtime.pipeline", "pipeflow.schedules",
    # imported later by most forks, 1.2 s each: torch.optim's first optimizer imports dynamo
    # (and with it inductor and triton); the Hugging Face, LoRA and torchvision runs their models
    "torch._dynamo", "torch._inductor.compile_fx", "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama", "transformers.models.auto.tokenization_auto", "peft",
    "torchvision.models", "torchvision.datasets", "torchvision.transforms",
)
TERM_GRACE_S = 30.0  # as torchrun's agent: SIGTERM to the ranks left, SIGKILL this long after


def context() -> multiprocessing.context.BaseContext:
    """The fork server's context, started (with :data:`PRELOAD` imported) on first use."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_server() -> None:
    """Start the fork server now (its imports cost once, before the first test that forks)."""
    context()
    multiprocessing.forkserver.ensure_running()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 where /proc cannot say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the ephemeral range where one can be found: between
    this call and the store's bind, any outgoing connection of a concurrent test (gloo opens many)
    may take a port of the ephemeral range, which once reset a 4-rank job's store at start-up."""
    low = _ephemeral_low()
    rng = random.Random()  # not the tests' seeded global generator
    for _ in range(20):
        port = rng.randrange(10000, low) if low > 10000 else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def become(env: Mapping[str, str], stdout: str | None = None, stderr: str | None = None) -> None:
    """In a fork: take the caller's environment and send this process's output to files (appended)."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout), (2, stderr)):
        if path is not None:
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
    for stream in (sys.stdout, sys.stderr):  # a rank that leaves with os._exit keeps every line it printed
        stream.reconfigure(line_buffering=True)
    # Its own resource tracker, started if it makes a semaphore (tqdm's lock): the one inherited
    # from the server is pytest's, which would find them leaked only when the whole run ends.
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
    for name in ("ensure_running", "register", "unregister", "getfd"):  # the module's bound to the old one
        setattr(resource_tracker, name, getattr(tracker, name))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # torch read it when the server imported it; apply the caller's
        import torch

        torch.set_num_threads(int(threads))


def processes(target: Callable[..., None], args_of: Callable[[int], tuple], count: int) -> list[multiprocessing.Process]:
    """Start `count` forks running ``target(*args_of(i))``."""
    ctx = context()
    procs = [ctx.Process(target=target, args=args_of(i), daemon=False) for i in range(count)]
    for proc in procs:
        proc.start()
    return procs


def run_main(argv: Sequence[str], cwd: str, env: Mapping[str, str], stdout: str | None = None,
             stderr: str | None = None, unbuffered: bool = False) -> None:
    """Run ``python *argv`` in this fork as the interpreter would (a script, ``-m module`` or
    ``-c code``), then leave with its exit status."""
    os.chdir(cwd)
    become(env, stdout, stderr)
    # the interpreter reads PYTHONPATH at start; the server started with its own
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, os.path.abspath(entry))
    if unbuffered:  # python -u
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    # The interpreter's default handlers: a SIGINT is a KeyboardInterrupt, a SIGTERM ends the process.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-":
            sys.argv = ["-", *argv[1:]]
            sys.path.insert(0, "")
            exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()  # a fork's exit skips them; a real interpreter runs them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Launched(subprocess.CompletedProcess):
    """What ``subprocess.run`` returns, and the ranks the launch had to end (``terminated``): those
    still running `peers_ended_after_s` after another failed, as torchrun's agent ends them."""

    terminated: list[int]


def torchrun_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun's agent sets for local rank `rank` of `nproc` on one node."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def launch(argv: Sequence[str], nproc: int | None = None, *, cwd: str | Path = ROOT,
           env: Mapping[str, str] | None = None, timeout: float = 300, per_rank: Mapping[int, Sequence[str]] | None = None,
           peers_ended_after_s: float = 0.1) -> Launched:
    """``python *argv`` (``nproc=None``) or ``torchrun --nproc-per-node nproc --standalone *argv``,
    each process a fork of the warm server.

    Args:
        argv: a script and its arguments, ``["-m", module, ...]`` or ``["-c", code, ...]``.
        nproc: ranks (torchrun's environment), or None for one plain process.
        cwd, env: the working directory and environment (default: this process's).
        timeout: every process is killed after this many seconds (then ``subprocess.TimeoutExpired``).
        per_rank: arguments appended on some ranks (a rank started with other overrides).
        peers_ended_after_s: once a rank failed, the others still running are sent SIGTERM after
            this long (torchrun's agent looks every 0.1 s), SIGKILL :data:`TERM_GRACE_S` later.

    Returns:
        The exit status (torchrun's: 0 when every rank exited 0, else 1), every rank's standard
        output and error (each stream the ranks' lines as they wrote them), and the ranks ended.
    """
    env = dict(os.environ if env is None else env)
    count = 1 if nproc is None else nproc
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")

        def args_of(rank: int) -> tuple:
            rank_env = env if nproc is None else {**env, **torchrun_env(rank, count, port, run_id)}
            return ([*argv, *(per_rank or {}).get(rank, ())], str(cwd), rank_env, out, err)

        procs = processes(run_main, args_of, count)
        terminated = _supervise(procs, timeout, peers_ended_after_s)
        stdout, stderr = Path(out).read_text() if os.path.exists(out) else "", Path(err).read_text() if os.path.exists(err) else ""
    if terminated is None:
        raise subprocess.TimeoutExpired(list(argv), timeout, stdout, stderr)
    codes = [proc.exitcode for proc in procs]
    code = codes[0] if nproc is None else int(any(codes))
    done = Launched([sys.executable, *argv], code, stdout, stderr)
    done.terminated = terminated
    return done


def _supervise(procs: list[multiprocessing.Process], timeout: float, peers_ended_after_s: float) -> list[int] | None:
    """Wait for every process; end the rest once one failed (as torchrun does).  Returns the
    ranks sent a signal, or None when the timeout struck (every process killed)."""
    deadline, failed_at, terminated = time.monotonic() + timeout, None, None
    while any(proc.exitcode is None for proc in procs):
        now = time.monotonic()
        if now > deadline:
            for proc in procs:
                proc.kill()
                proc.join()
            return None
        if failed_at is None and any(proc.exitcode not in (None, 0) for proc in procs):
            failed_at = now
        if failed_at is not None and terminated is None and now - failed_at >= peers_ended_after_s:
            terminated = [rank for rank, proc in enumerate(procs) if proc.exitcode is None]
            for rank in terminated:
                procs[rank].terminate()
        if terminated and now - failed_at >= peers_ended_after_s + TERM_GRACE_S:
            for rank in terminated:
                if procs[rank].exitcode is None:
                    procs[rank].kill()
        multiprocessing.connection.wait([proc.sentinel for proc in procs if proc.exitcode is None], timeout=0.05)
    for proc in procs:
        proc.join()
    return terminated or []


def run_python(argv: Sequence[str], **kwargs: Any) -> Launched:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True)`` on a warm fork."""
    return launch(argv, None, **kwargs)
