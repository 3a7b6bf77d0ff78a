"""Warm workers under a real launcher: torchrun (or ``python -m pipeflow.launch``, or a script
that runs ``$PYTHON``) starts ``tests/warm_shim.py`` for ``python``, and the shim's worker runs on
a fork of the suite's warm server (:mod:`warm`) instead of a new interpreter.

The launcher, the rendezvous, the restarts, the signals and the emulated hosts stay real; what
is saved is each worker's 3-4 s of importing torch, Hydra and pipeflow on 2 cores.  The fork
becomes the worker the launcher started: it joins the shim's network, UTS and mount namespaces
(an emulated host's address, name, ``/etc/hosts`` and disks), takes its environment, working
directory and standard streams, sees the shim's parent as its own (``os.getppid``: the launcher
it would watch), and gets every signal the shim gets.  Its exit status is the shim's.

:func:`interpreters` starts the broker (a thread of the pytest process, once) and returns the
environment that makes a launcher's workers warm.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import multiprocessing.connection
import multiprocessing.reduction
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import warm
import warm_shim

JOINED = ("net", "uts", "ipc", "mnt")  # joined in this order: the mount namespace last (it resets the cwd)

_broker: dict[str, str] = {}
_lock = threading.Lock()


def interpreters(launchers: bool = False) -> dict[str, str]:
    """The environment under which torchrun's workers are warm forks (``PYTHON_EXEC``, the
    interpreter torchrun starts them with, names the shim, which finds the broker started here);
    with `launchers`, also every ``$PYTHON`` of the examples (``PYTHON``), the launchers included."""
    with _lock:
        if not _broker:
            _broker.update(_start())
    env = dict(_broker)
    if launchers:
        env["PYTHON"] = env["PYTHON_EXEC"]
    return env


def _start() -> dict[str, str]:
    """Listen on a unix socket (a thread per worker) and write the shim's executable."""
    warm.start_server()
    folder = tempfile.mkdtemp(prefix="pipeflow-warm-")
    atexit.register(shutil.rmtree, folder, True)  # the socket and the shim go with the test run
    path = os.path.join(folder, "broker.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    threading.Thread(target=_accept, args=(listener,), name="warm-broker", daemon=True).start()
    shim = Path(folder) / "python"
    # -S -E: the standard library only, started in milliseconds
    shim.write_text(f"#!{sys.executable} -SE\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    "import warm_shim\nwarm_shim.main()\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {"PYTHON_EXEC": str(shim), warm_shim.SOCKET_ENV: path,
            warm_shim.PYTHON_ENV: sys.executable, warm_shim.NAMESPACES_ENV: warm_shim.namespaces()}


def _accept(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve, args=(conn,), name="warm-worker", daemon=True).start()


class _Fd:
    """A file descriptor that travels to the fork (``multiprocessing``'s fd passing)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _detach, (multiprocessing.reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def _serve(conn: socket.socket) -> None:
    """One worker: read the shim's request, start the fork, pass signals on, report its status."""
    fds: list[int] = []
    with conn:
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the shim left before its request arrived")
                data += chunk
            request = json.loads(data[4:])
            proc = warm.context().Process(target=_interpret, daemon=False, args=(
                request["argv"], request["cwd"], request["env"], request["pid"], [_Fd(fd) for fd in fds]))
            proc.start()
        except Exception as exc:  # noqa: BLE001 - said on the worker's own stderr, as an interpreter would
            for fd in fds[2:3]:  # the stand-in's stderr
                os.write(fd, f"[warm broker] could not start the worker: {exc!r}\n".encode())
            conn.sendall(b"X" + struct.pack("!i", 1))
            return
        finally:
            for fd in fds:
                os.close(fd)
        while True:
            ready = multiprocessing.connection.wait([proc.sentinel, conn])
            if proc.sentinel in ready:
                proc.join()
                try:
                    conn.sendall(b"X" + struct.pack("!i", proc.exitcode))
                except OSError:
                    pass
                return
            signals = conn.recv(64)
            if not signals:  # the shim was killed: so is the fork
                proc.kill()
                proc.join()
                return
            for signum in signals:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass


def _join_namespaces(pid: int) -> None:
    """Enter `pid`'s network, UTS, IPC and mount namespaces where they differ from this process's."""
    libc = ctypes.CDLL(None, use_errno=True)
    for name in JOINED:
        theirs, mine = f"/proc/{pid}/ns/{name}", f"/proc/self/ns/{name}"
        if os.stat(theirs).st_ino == os.stat(mine).st_ino:
            continue
        fd = os.open(theirs, os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns({theirs}) failed")
        finally:
            os.close(fd)


def _parent_of(pid: int) -> int:
    """`pid`'s parent (1 once `pid` is gone): what the fork's ``os.getppid`` answers."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 1


def _interpret(argv: list[str], cwd: str, env: dict[str, str], shim_pid: int, fds: list[int]) -> None:
    """In the fork: become the shim's worker, then run ``python *argv``."""
    _join_namespaces(shim_pid)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - multiprocessing gave the fork /dev/null
    os.getppid = lambda: _parent_of(shim_pid)  # type: ignore[assignment]
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    import platform

    platform._uname_cache = None  # type: ignore[attr-defined] - the host's name, not the server's
    warm.run_main(argv, cwd, env, unbuffered=unbuffered)
