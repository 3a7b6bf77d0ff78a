"""One job per run directory: ``<run_dir>/pipeflow.lock``, taken by rank 0 at start.

The lock file holds the holder's host name, machine (boot id and network namespace:
:func:`~pipeflow.runtime.world.hosts.machine_id`), pid namespace, pid and job token; its modification
time is a lease that a thread renews every ``lease_s / 4`` seconds while the job lives.  A second
job is refused with a :class:`~pipeflow.errors.RunDirLockedError` naming the holder while the
holder is live: on this machine (and pid namespace), while its pid exists; anywhere else, while its
lease is fresher than ``lease_s``.  A host name is not enough to tell: containers and cloned images
often share one, and a live job on another machine of our name must not be judged by a pid here.
A lock written before the machine was recorded is judged by its host name, as it was then.
A stale lock (its job died, on any host) is taken over.  A lock on another machine whose lease is
still fresh is judged by more than its age, so that a restart after a lost host (the rendezvous
host's included) is never refused by its own dead lock: a lock of the same rendezvous (endpoint
and run id, which ``python -m pipeflow.launch`` gives the workers) is this job's before its
restart; a lock whose rendezvous endpoint answers no more belongs to a job that cannot go on
(torchrun cannot move a rendezvous); any other is watched for one renewal period
(:func:`renewal_window_s`, about 20 s), and taken over if it is not renewed.  Taking the lock is atomic
(``O_CREAT | O_EXCL``); a take-over first renames the stale file away, which only one
contender can do.  The same process may take its own lock again (a sweep's jobs, tests).

The lock is checked again before every checkpoint is written (:func:`verify_held`): a run
directory removed during training, a lock file that vanished or that now names another job
stops the job with a :class:`~pipeflow.errors.RunDirLostError` instead of a write that would
mix two runs' checkpoints in one folder.  Between saves the lease thread looks every
:data:`WATCH_S` seconds (a stat and a read of the small lock file, on rank 0 only) and sets
:attr:`RunLock.lost`; the Trainer carries that flag in the step's all-reduce, so every rank stops
at the same step boundary with that error within seconds instead of training on until its next save.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from pipeflow.errors import RunDirLockedError, RunDirLostError
from pipeflow.runtime.world.hosts import connect_failure, machine_id

log = logging.getLogger("pipeflow")

LOCK_FILE = "pipeflow.lock"
LEASE_S = 60.0
WATCH_S = 2.0  # how often the lease thread checks that the run directory and the lock are still this job's
RDZV_ENDPOINT_ENV = "PIPEFLOW_RDZV_ENDPOINT"  # set by pipeflow's launcher: the job's c10d rendezvous endpoint
PROBE_S = 5.0  # how long a look at a lock holder's rendezvous endpoint may take (a dead host: ARP gives up in ~3 s)
_HELD: dict[str, RunLock] = {}  # the locks this process holds, by job token


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, and how long ago it was last renewed."""

    host: str
    pid: int
    token: str
    age_s: float
    machine: str = ""  # boot id and network namespace; "" in a lock written before it was recorded
    pid_ns: str = ""  # the pid namespace its pid counts in; "" where unknown
    rdzv: str = ""  # its job's rendezvous, ``endpoint run-id`` (:func:`job_rendezvous`); "" where unknown

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.where()} (lease renewed {self.age_s:.0f} s ago)"

    def where(self) -> str:
        """``host H``, with its machine where that has this host's name but is not this one (or its
        pid namespace, where only that differs)."""
        if not self.machine or self.host != socket.gethostname() or self.local():
            return f"host {self.host}"
        if self.machine != machine_id():
            return (f"host {self.host} (machine {self.machine}: another machine than this one, which has the same "
                    f"name; judged by its lease)")
        return (f"host {self.host} (this machine, but pid namespace {self.pid_ns}: another container; "
                f"judged by its lease)")

    def local(self) -> bool:
        """Whether its pid is one this process can look up: same machine and pid namespace (by name
        alone for a lock that does not record them)."""
        if self.host != socket.gethostname():
            return False
        if not self.machine:
            return True
        return self.machine == machine_id() and self.pid_ns in ("", pid_namespace())


def pid_namespace() -> str:
    """This process's pid namespace (``pid:<inode>``; ``?`` where it cannot be read)."""
    try:
        return f"pid:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return "?"


def read_holder(path: str) -> Holder | None:
    """The holder recorded in lock file `path`; None if there is none.  An unreadable file counts
    as held by nobody known (host ``?``), live only while its lease is fresh."""
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as f:
            data = json.load(f)
        return Holder(str(data["host"]), int(data["pid"]), str(data["token"]), age,
                      str(data.get("machine", "")), str(data.get("pid_ns", "")), str(data.get("rdzv", "")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            return Holder("?", -1, "", time.time() - os.stat(path).st_mtime)
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_live(holder: Holder, lease_s: float = LEASE_S) -> bool:
    """Whether `holder`'s job still runs: on this machine, its pid exists; elsewhere, a fresh lease."""
    if holder.local():
        return _pid_alive(holder.pid)
    return holder.age_s < lease_s


def live_holder(run_dir: str, lease_s: float = LEASE_S) -> Holder | None:
    """The live job holding `run_dir`, if any (this process does not count)."""
    holder = read_holder(os.path.join(run_dir, LOCK_FILE))
    if holder is None or _is_me(holder) or not is_live(holder, lease_s):
        return None
    return holder


def _is_me(holder: Holder) -> bool:
    return holder.local() and holder.pid == os.getpid()


def job_rendezvous() -> str:
    """This job's c10d rendezvous as ``endpoint run-id`` ("" where the launcher did not say it):
    two jobs of one rendezvous are one job, since torchrun makes them one (a node that joins a
    live job's rendezvous restarts its workers first)."""
    endpoint = os.environ.get(RDZV_ENDPOINT_ENV, "")
    return f"{endpoint} {os.environ.get('TORCHELASTIC_RUN_ID', 'none')}" if endpoint else ""


def renewal_window_s(lease_s: float) -> float:
    """The longest a live holder goes without renewing its lease (it renews every ``lease_s / 4``
    seconds, looking every :data:`WATCH_S`), with a margin for a slow file system."""
    period = lease_s / 4
    return period + min(WATCH_S, period) + min(3.0, period)


def rendezvous_gone(rdzv: str, timeout_s: float = PROBE_S) -> str | None:
    """Why the rendezvous endpoint of ``rdzv`` (``host:port run-id``) is certainly gone (its host
    unknown or unreachable, nothing listening on its port), or None where it answers or the look
    was inconclusive (a timeout)."""
    endpoint = rdzv.split(" ", 1)[0]
    host, _, port = endpoint.rpartition(":")
    try:
        failure = connect_failure(host.strip("[]"), int(port), timeout_s)
    except ValueError as exc:
        failure = socket.gaierror(str(exc))
    if isinstance(failure, socket.gaierror):
        return f"its rendezvous endpoint {endpoint} does not resolve ({failure})"
    if failure is not None and failure.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                                                 errno.EHOSTDOWN):
        return f"its rendezvous endpoint {endpoint} answers no more ({os.strerror(failure.errno)})"
    return None  # it answers, or the look was inconclusive (a timeout)


def _same_lease(path: str, holder: Holder, mtime_ns: int) -> bool:
    """Whether `path` is still `holder`'s lock with modification time `mtime_ns` (not renewed)."""
    now = read_holder(path)
    try:
        return now is not None and now.token == holder.token and os.stat(path).st_mtime_ns == mtime_ns
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class Loss:
    """How a job lost its run directory: `found` says what was seen; `dir_gone` when the
    directory itself is."""

    run_dir: str
    found: str
    dir_gone: bool = False
    holder: Holder | None = None  # who the lock names now, if anyone


def find_loss(run_dir: str, token: str) -> Loss | None:
    """What shows that job `token` no longer holds `run_dir` (the directory gone, its lock gone,
    unreadable or naming another job); None while it does."""
    path = os.path.join(run_dir, LOCK_FILE)
    if not os.path.isdir(run_dir):
        return Loss(run_dir, f"run directory {run_dir} no longer exists (removed while this job ran)", dir_gone=True)
    holder = read_holder(path)
    if holder is not None and holder.token == token:
        return None
    if holder is None:
        return Loss(run_dir, f"this job's lock {path} is gone (deleted, or the run directory was emptied)")
    if holder.host == "?":
        return Loss(run_dir, f"this job's lock {path} now holds something unreadable", holder=holder)
    return Loss(run_dir, f"{path} now names another job: {holder}", holder=holder)


def lost_error(lead: str, loss: Loss) -> RunDirLostError:
    """The error for `loss`, its message opening with `lead` (``checkpoint of step 4 refused``)."""
    run_dir = loss.run_dir
    if loss.dir_gone:
        return RunDirLostError(
            f"{lead}: {loss.found}; the job stops rather than make it again, since another job may be using that "
            f"path by now. To go on, restore the directory with its checkpoints and resume (train.resume=auto "
            f"train.run_dir={run_dir})"
        )
    return RunDirLostError(
        f"{lead}: {loss.found}, so another job may be writing into {run_dir} and the two runs' checkpoints "
        f"would mix; this job stops. Let the other job (if any) finish or stop it, then resume this run from "
        f"its last checkpoint (train.resume=auto train.run_dir={run_dir}), or give it another train.run_dir"
    )


class RunLock:
    """The lock of one run directory, held by this process until :meth:`release`.

    Args:
        run_dir: the run directory (it must exist).
        lease_s: how long a lock on another host stays live without renewal.
    """

    def __init__(self, run_dir: str, lease_s: float = LEASE_S) -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.lease_s = lease_s
        self.token = uuid.uuid4().hex[:12]
        self.taken_over: Holder | None = None  # the dead job whose stale lock was taken over
        self.lost: Loss | None = None  # what the lease thread found: the run directory or the lock gone or taken
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str:
        """Take the lock (taking over a stale one); returns this job's token.

        Raises:
            RunDirLockedError: a live job holds it (naming its host and pid).
        """
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._clear_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": socket.gethostname(), "machine": machine_id(), "pid_ns": pid_namespace(),
                           "pid": os.getpid(), "token": self.token, "started": time.time(),
                           "rdzv": job_rendezvous()}, f)
            self._thread = threading.Thread(target=self._watch, name="pipeflow-lock-lease", daemon=True)
            self._thread.start()
            _HELD[self.token] = self
            return self.token
        raise RunDirLockedError(f"{self.path}: could not take the lock (other jobs keep taking it); try again")

    def _clear_stale(self) -> None:
        """Move a stale lock away (or raise if its holder is live)."""
        holder = read_holder(self.path)
        if holder is None:
            return
        verdict = "gone" if _is_me(holder) or not is_live(holder, self.lease_s) else self._judge(holder)
        if verdict == "changed":
            return  # released or taken meanwhile: the caller tries again
        if verdict == "live":
            raise RunDirLockedError(
                f"run directory {os.path.dirname(self.path)} is in use by another live job: {holder} "
                f"({self.path}). Wait for it to end, stop it, or give this job another train.run_dir; "
                f"a lock left by a job that died is taken over by itself (at once on the same machine or for the "
                f"same rendezvous, else when its lease goes unrenewed for {renewal_window_s(self.lease_s):.0f} s)"
            )
        stale = f"{self.path}.stale.{self.token}"
        try:
            os.rename(self.path, stale)  # only one contender wins the rename
        except FileNotFoundError:
            return
        os.remove(stale)
        if not _is_me(holder):
            self.taken_over = holder
            log.warning("took over the stale lock of a process that is gone (this job before a restart, or an "
                        "earlier job): %s", holder)

    def _judge(self, holder: Holder) -> str:
        """``gone`` where `holder`, live by its lease, is a job that is gone: this job before its
        restart (the same rendezvous), a job whose rendezvous answers no more, or one that does not
        renew its lease in :func:`renewal_window_s` (watched here, from now: the holder's clock and
        this one's may differ, a change of the lock file's time does not lie); ``changed`` where the
        lock was released or replaced meanwhile; ``live`` otherwise."""
        if holder.local() or holder.host == "?":
            return "live"
        mine = job_rendezvous()
        if holder.rdzv and holder.rdzv == mine:
            log.warning("the lock of %s is this job's before its restart (the same rendezvous %s): taken over",
                        holder, mine)
            return "gone"
        why = rendezvous_gone(holder.rdzv) if holder.rdzv else None
        if why is not None:
            log.warning("the lock of %s belongs to a job that cannot go on: %s; taken over", holder, why)
            return "gone"
        try:
            mtime_ns = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return "changed"
        window = renewal_window_s(self.lease_s)
        log.warning("run directory %s is locked by %s: waiting up to %.0f s to see whether that job still renews "
                    "its lease (a job that is gone, such as this one before a lost host, does not)",
                    os.path.dirname(self.path), holder, window)
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            time.sleep(min(0.5, self.lease_s / 16))
            if not _same_lease(self.path, holder, mtime_ns):
                now = read_holder(self.path)
                return "live" if now is not None and now.token == holder.token else "changed"
        log.warning("the lock of %s was not renewed in %.0f s: its job is gone; taken over", holder, window)
        return "gone"

    def _watch(self) -> None:
        """Every :data:`WATCH_S` s: check the run directory and the lock are still this job's (else
        set :attr:`lost` and stop); renew the lease every ``lease_s / 4`` s."""
        renewed = time.monotonic()
        while not self._stop.wait(min(WATCH_S, self.lease_s / 4)):
            loss = find_loss(os.path.dirname(self.path), self.token)
            if loss is not None:
                if loss.holder is not None and _is_me(loss.holder):
                    return  # this process took its own run directory again (a sweep, tests): the new lock renews
                if not self._stop.is_set():  # not a release racing this look
                    self.lost = loss
                    log.warning("%s; every rank stops at the next step boundary", loss.found)
                return
            if time.monotonic() - renewed >= self.lease_s / 4:
                with contextlib.suppress(OSError):
                    os.utime(self.path)
                renewed = time.monotonic()

    def verify(self, what: str) -> None:
        """Check that this job still holds its run directory before `what` (e.g. ``checkpoint of step 4``) writes.

        Raises:
            RunDirLostError: the run directory is gone, or the lock file is, or it names another
                job (naming the directory, what was found and what to do).
        """
        loss = find_loss(os.path.dirname(self.path), self.token)
        if loss is not None:
            raise lost_error(f"{what} refused", loss)

    def release(self) -> None:
        """Stop renewing and remove the lock file if it is still this job's."""
        _HELD.pop(self.token, None)
        self._stop.set()
        holder = read_holder(self.path)
        if holder is not None and holder.token == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


def verify_held(token: str, what: str) -> None:
    """If this process holds the run directory lock of job `token` (rank 0 of a job with a
    workspace), check that it still does (:meth:`RunLock.verify`); a no-op otherwise.

    Raises:
        RunDirLostError: the run directory or the lock vanished, or the lock names another job.
    """
    held = _HELD.get(token)
    if held is not None:
        held.verify(what)
