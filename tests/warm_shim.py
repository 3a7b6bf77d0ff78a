"""A stand-in for ``python`` that a real launcher starts as its worker (``PYTHON_EXEC``, which
torchrun reads): it hands its arguments, environment, working directory and standard streams to
the suite's warm fork server (``tests/warm_exec.py``) and stands for the fork that runs them.

To the launcher it is the worker: its pid gets the launcher's signals (passed on to the fork),
its exit status is the fork's (a fork killed by a signal makes it die of the same signal), and
when it is killed the fork is killed.  It starts in milliseconds (``python -SE``, the standard
library only).  Where a fork could not be the same process — another pid, user or time
namespace than the server's, a python flag other than ``-u``, ``-m``, ``-c``, no server — it
becomes a real interpreter (``exec``) instead.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "PIPEFLOW_WARM_SOCKET"  # the broker's unix socket
PYTHON_ENV = "PIPEFLOW_WARM_REAL_PYTHON"  # the interpreter to become where a fork cannot stand in
NAMESPACES_ENV = "PIPEFLOW_WARM_NAMESPACES"  # "pid:<ino> user:<ino> time:<ino>" of the server
UNSHARED = ("pid", "user", "time")  # namespaces a fork cannot join after it started
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def namespaces() -> str:
    """This process's pid, user and time namespaces, as :data:`NAMESPACES_ENV` writes them."""
    found = []
    for name in UNSHARED:
        try:
            found.append(f"{name}:{os.stat(f'/proc/self/ns/{name}').st_ino}")
        except OSError:
            found.append(f"{name}:?")
    return " ".join(found)


def forkable(argv: list[str]) -> bool:
    """Whether a warm fork can run ``python *argv``: only ``-u`` before a script, ``-m``, ``-c`` or
    ``-`` (the script on standard input)."""
    for arg in argv:
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            return True
        if arg != "-u":
            return False
    return False  # no script: an interactive interpreter


def become_real(argv: list[str]) -> None:
    """Replace this process with a real interpreter running `argv`."""
    python = os.environ.get(PYTHON_ENV) or sys.executable
    os.execv(python, [python, *argv])


def main() -> None:
    """Run ``python *sys.argv[1:]`` on a warm fork, standing for it until it ends."""
    argv = sys.argv[1:]
    path = os.environ.get(SOCKET_ENV)
    if not path or not forkable(argv) or os.environ.get(NAMESPACES_ENV) != namespaces():
        become_real(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        become_real(argv)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid()}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2])

    def forward(signum: int, _frame: object) -> None:
        try:
            sock.sendall(bytes([signum]))
        except OSError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    reply = b""
    while len(reply) < 5:
        chunk = sock.recv(5 - len(reply))
        if not chunk:  # the server is gone: the fork with it
            os._exit(1)
        reply += chunk
    (code,) = struct.unpack("!i", reply[1:5])
    if code < 0:  # the fork died of a signal: so does its stand-in
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main()
