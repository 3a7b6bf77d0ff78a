"""``python -m pipeflow.launch [torchrun options] train.py [overrides]``: torchrun, and two things
torchrun does not do.

**A preemption is not a failure.**  The workers of a job stopped by a ``train.save_on_signal``
signal save and exit 75, but torchrun itself reports a failed child (status 1): a relaunch
script or a scheduler's requeue cannot tell.  This launcher runs torchrun in its own process
(so a signal reaches torchrun once, whoever sends it), gives the workers a status file
(``PIPEFLOW_STATUS_FILE``) in which rank 0 records ``preempted at step N``, and exits with
:data:`~pipeflow.run.signals.PREEMPTED_EXIT_CODE` when it does and the job was asked to stop: a
signal reached this launcher, or every worker that ended early ended with 75.  A worker that
failed, whose peers torchrun then stopped (and who recorded their stop), is a failure: status 1.

**Each node finds its own address** (``--nnodes`` above 1 with a c10d ``--rdzv-endpoint``).
torchrun publishes the rank-0 node's ``socket.getfqdn()`` as ``MASTER_ADDR`` and gloo binds
what the hostname resolves to, falling back to loopback; on hosts whose names do not resolve
to each other, or resolve to 127.0.0.1, the job stops in the rendezvous or silently talks to
itself.  The launcher asks the kernel which local address routes to the endpoint, passes it as
``--local-addr``, sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to its interface (unless
set), and hosts the rendezvous (``--rdzv-conf is_host=1``) exactly when the endpoint is one of
this node's own addresses.  Where it cannot, it stops at once with a :class:`LaunchError` that
says what to set.  It also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun's workers
otherwise share the agent's store across restarts under a prefix made of each agent's own
restart count, which differs between agents, and a restart reuses stale addresses
(pytorch#135712); with it, each round's rank 0 hosts a fresh store on a fresh port.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from pipeflow.errors import LaunchError
from pipeflow.commands.launch_wait import (FRESH_STORE_ENV, TORCH_SHUTDOWN_TIMEOUT_S, WaitReporter, endpoint_silence,
                                           shared_store_warning, shutdown_timeout_s)
from pipeflow.checkpoint.lock import RDZV_ENDPOINT_ENV
from pipeflow.run.signals import AGENT_STOP, PREEMPTED_EXIT_CODE, STATUS_FILE_ENV, preemption_recorded
from pipeflow.runtime.world.hosts import interface_addresses

USAGE = """usage: python -m pipeflow.launch [torchrun options] train.py [overrides ...]

torchrun (python -m torch.distributed.run) with two additions:
  * exit status 75 when the job was preempted (a train.save_on_signal signal: saved, relaunch
    with train.resume=auto to continue), where torchrun alone reports 1 as for a failure;
    1 when a worker failed (the others torchrun stopped are no preemption: the launcher marks
    the agent's own stops, so those workers record none); a restart for a node that joined or
    left the job saves, restarts the workers and goes on, without an exit;
    0 when the job finished, torchrun's own status otherwise;
  * on several nodes (--nnodes N or MIN:MAX with N, MAX > 1, --rdzv-backend c10d,
    --rdzv-endpoint HOST:PORT) it finds this node's address on the route to the endpoint and
    passes --local-addr, sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to that interface
    (unless already set) and --rdzv-conf is_host=1 on the node that owns the endpoint's
    address (is_host=0 elsewhere), and sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (also on one
    machine; unless set: each restart's workers get a fresh store, so no address of the attempt
    before is reused, pytorch#135712; set to 0, it warns: a node that joins the running job
    would hang in torchrun's rank assignment); it refuses an endpoint port another program
    holds on the hosting node;
  * a lost node recovered in seconds: --rdzv-conf last_call_timeout=2 (a re-rendezvous closes
    2 s after the minimum of nodes is there; torchrun's 30 s), keep_alive_interval=1 and
    keep_alive_max_attempt=3 (a node is lost after 3 s of silence; torchrun's 15 s);
  * while the agent waits for its rendezvous across nodes (at start, after a restart), a line
    every 5 s: what it waits for, for how long, and the deadline;
  * --shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) also bounds the workers' save when the
    agent stops them itself (a node joined or left): torch 2.14 gives them 30 s whatever it says.
Options and --rdzv-conf keys given explicitly are left as they are.

Every torchrun option is accepted (python -m torch.distributed.run --help lists them).
Environment: PIPEFLOW_LAUNCH_VERBOSE=1 prints the address decisions and the rendezvous's steps.
"""

# torchrun's c10d rendezvous, where the job spans nodes (each overridable in --rdzv-conf): a
# node's loss is seen after 3 missed 1 s keep-alives (torchrun: 3 of 5 s), and a re-rendezvous
# closes 2 s after the minimum of nodes is there (torchrun: 30 s); benchmarks/fault_drills/node_loss.py
RDZV_DEFAULTS = {"last_call_timeout": "2", "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
TORCHRUN_JOIN_TIMEOUT_S = 600  # torchrun's c10d join_timeout where --rdzv-conf gives none


@dataclass(frozen=True)
class NodeAddress:
    """Where this node talks to the others.

    Attributes:
        address: the local IP the kernel routes to the endpoint from.
        interface: the network interface that holds `address`.
        hosts_endpoint: the endpoint's address is one of this node's own.
    """

    address: str
    interface: str
    hosts_endpoint: bool


def option(argv: list[str], name: str) -> str | None:
    """The value of torchrun option ``--name`` in `argv` (either spelling: dashes or underscores,
    ``--opt value`` or ``--opt=value``), looking only before the training script; None if absent."""
    spellings = {f"--{name}", f"--{name.replace('-', '_')}"}
    for i, arg in enumerate(argv[:script_index(argv)]):
        key, eq, value = arg.partition("=")
        if key in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


# torchrun's options that take no value (torch.distributed.run.get_args_parser(), torch 2.11-2.14)
_FLAGS = {"-h", "--help", "--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
          "--virtual-local-rank", "--virtual_local_rank"}


def script_index(argv: list[str]) -> int:
    """The index of the training script in `argv` (the first word that is neither an option nor
    an option's value); len(argv) when there is none."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return i
        if "=" not in arg and arg not in _FLAGS:
            i += 1  # the option's value
        i += 1
    return len(argv)


def max_nodes(argv: list[str]) -> int:
    """The largest node count ``--nnodes`` allows (``N`` or ``MIN:MAX``; 1 when absent)."""
    text = option(argv, "nnodes") or "1"
    try:
        return int(text.rpartition(":")[2])
    except ValueError:
        raise LaunchError(f"--nnodes {text!r} is not N or MIN:MAX (e.g. --nnodes 2 or --nnodes 1:2)") from None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too; port 29400 when absent, as torchrun) as (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port:
        host, port = endpoint, "29400"
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: the port {port!r} is not a number") from None


def resolve(host: str, what: str) -> str:
    """`host`'s IPv4 address (an IP passes through).

    Raises:
        LaunchError: the name does not resolve on this node.
    """
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise LaunchError(
            f"{what} names host {host!r}, which does not resolve on this node ({socket.gethostname()}): {exc}; "
            f"give the first node's IP address instead (ENDPOINT=10.0.0.1:29500), or add the name to /etc/hosts here"
        ) from None


def local_addresses() -> dict[str, str]:
    """This node's IPv4 addresses, each with its interface (``{"10.0.0.2": "eth0", ...}``)."""
    return {address: name for name, address in interface_addresses().items()}


def route_source(ip: str, port: int) -> str:
    """The local address the kernel would send from to reach `ip` (a UDP connect sends nothing).

    Raises:
        LaunchError: no route from this node to `ip`.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ip, port))
        except OSError as exc:
            raise LaunchError(
                f"no route from this node ({socket.gethostname()}) to the rendezvous endpoint {ip}:{port}: {exc}; "
                f"give ENDPOINT an address of the first node that this node can reach (check `ip route get {ip}`)"
            ) from None
        return probe.getsockname()[0]


def find_address(endpoint: str) -> NodeAddress:
    """This node's address and interface on the route to `endpoint`, and whether it hosts it.

    Raises:
        LaunchError: the endpoint does not resolve, cannot be reached, or this node's address
            for it is loopback while the endpoint is not.
    """
    host, port = split_endpoint(endpoint)
    ip = resolve(host, f"--rdzv-endpoint {endpoint!r}")
    mine = local_addresses()
    source = route_source(ip, port)
    interface = mine.get(source)
    if interface is None:
        raise LaunchError(f"this node routes to the endpoint {ip} from {source}, which no interface here holds "
                          f"(seen: {mine}); pass --local-addr and set GLOO_SOCKET_IFNAME yourself")
    if ipaddress.ip_address(source).is_loopback and not ipaddress.ip_address(ip).is_loopback:
        raise LaunchError(f"this node would reach the endpoint {ip} over loopback ({source}); other nodes cannot "
                          f"reach that address: give ENDPOINT the first node's address on the network between them")
    return NodeAddress(source, interface, hosts_endpoint=ip in mine)


def check_port_free(endpoint: str) -> None:
    """On the node that hosts the rendezvous: refuse an endpoint port another program holds
    (torchrun's agent would take that program for its store and wait on it without a word).

    Raises:
        LaunchError: naming the port and the fix.
    """
    host, port = split_endpoint(endpoint)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed job's TIME_WAIT is no owner
        try:
            probe.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"--rdzv-endpoint {endpoint}: this node hosts the rendezvous, but port {port} here is "
                                  f"taken by another program (a job still running?); stop it or choose a free port: "
                                  f"--rdzv-endpoint {host}:<port>") from None


def with_node_address(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str], NodeAddress | None]:
    """`argv` and `env` with this node's address added (see the module's docstring), or as they
    are on one node, without a c10d endpoint, or with a loopback endpoint (agents on one machine).

    Returns:
        (torchrun's arguments, the environment variables to add, the address found or None).
    """
    endpoint = option(argv, "rdzv-endpoint")
    backend = option(argv, "rdzv-backend") or "static"
    if max_nodes(argv) <= 1 or not endpoint or backend != "c10d":
        return argv, {}, None
    host, port = split_endpoint(endpoint)
    address = resolve(host, f"--rdzv-endpoint {endpoint!r}")
    # the job's identity for its run directory's lock: a restart on the same rendezvous is this job
    rendezvous = {RDZV_ENDPOINT_ENV: f"[{address}]:{port}" if ":" in address else f"{address}:{port}"}
    if FRESH_STORE_ENV not in env:  # a fresh store per rendezvous round (pytorch#135712)
        rendezvous[FRESH_STORE_ENV] = "1"
    if ipaddress.ip_address(address).is_loopback:
        return argv, rendezvous, None  # several agents on one machine: loopback is right
    node = find_address(endpoint)
    if node.hosts_endpoint:
        check_port_free(endpoint)
    cut = script_index(argv)
    head, tail = list(argv[:cut]), argv[cut:]
    if option(argv, "local-addr") is None:
        head += ["--local-addr", node.address]
    head = _with_rendezvous_conf(head, {**RDZV_DEFAULTS, "is_host": str(int(node.hosts_endpoint))})
    added = {name: node.interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(name)}
    added.update(rendezvous)
    return head + tail, added, node


def rdzv_conf_items(value: str | None) -> dict[str, str]:
    """``--rdzv-conf``'s ``key=value,key=value`` as a dict (a key without a value maps to "")."""
    return {key.strip(): rest for key, _, rest in (item.partition("=") for item in (value or "").split(","))
            if key.strip()}


def _with_rendezvous_conf(options: list[str], extra: dict[str, str]) -> list[str]:
    """torchrun's `options` with each key of `extra` that their ``--rdzv-conf`` lacks appended to it
    (an ``--rdzv-conf`` added when there is none); a key given keeps its value."""
    def joined(given: str) -> str:
        have = rdzv_conf_items(given)
        return ",".join([*([given] if given else []), *(f"{k}={v}" for k, v in extra.items() if k not in have)])

    out = list(options)
    for i, arg in enumerate(out):
        if arg in ("--rdzv-conf", "--rdzv_conf") and i + 1 < len(out):
            out[i + 1] = joined(out[i + 1])
            return out
        if arg.startswith(("--rdzv-conf=", "--rdzv_conf=")):
            name, value = arg.split("=", 1)
            out[i] = f"{name}={joined(value)}"
            return out
    return [*out, "--rdzv-conf", joined("")]


@contextlib.contextmanager
def status_file() -> Iterator[str]:
    """A fresh file the workers' rank 0 writes its ending into (``PIPEFLOW_STATUS_FILE``)."""
    handle, path = tempfile.mkstemp(prefix="pipeflow-status-", suffix=".txt")
    os.close(handle)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


@contextlib.contextmanager
def marking_agent_stops(path: str, grace_s: int = TORCH_SHUTDOWN_TIMEOUT_S) -> Iterator[None]:
    """While torchrun's agent stops its own workers unasked (a worker failed, or a node joined or
    left and it restarts them), `path` says so (:data:`~pipeflow.run.signals.AGENT_STOP`): the
    workers' SIGTERM is then no preemption, they neither say nor record one, and they get
    `grace_s` seconds (at least) before SIGKILL.  A signal sent to this launcher (a scheduler's,
    Ctrl-C) is passed on unmarked: that is a preemption."""
    from torch.distributed.elastic.multiprocessing import api

    signalled = threading.Event()
    handler, close = api._terminate_process_handler, api.PContext.close

    def on_signal(signum: int, frame: object) -> None:
        signalled.set()
        handler(signum, frame)

    def marked_close(context: api.PContext, death_sig: object = None, timeout: int = 30) -> None:
        if signalled.is_set():
            return close(context, death_sig, timeout)
        try:
            with open(path) as f:
                before = f.read()  # a preemption a worker recorded stays
            with open(path, "w") as f:
                f.write(f"{AGENT_STOP}: a worker failed, or a node joined or left and the workers restart\n")
        except OSError:
            return close(context, death_sig, timeout)
        try:  # the agent's restart passes torch's default, not --shutdown-timeout (torch 2.14)
            return close(context, death_sig, max(timeout, grace_s))
        finally:
            with contextlib.suppress(OSError), open(path, "w") as f:
                f.write(before)

    api._terminate_process_handler, api.PContext.close = on_signal, marked_close  # type: ignore[method-assign]
    try:
        yield
    finally:
        api._terminate_process_handler, api.PContext.close = handler, close  # type: ignore[method-assign]


@contextlib.contextmanager
def saying_joins() -> Iterator[None]:
    """While torchrun's agent runs, say once per membership change that nodes wait to join (the
    agent then stops its workers, which save at the next step boundary, and the job re-forms with
    them): the agent logs it at INFO only, below its default level, so a grown job restarted
    unexplained."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    count = DynamicRendezvousHandler.num_nodes_waiting
    before = 0

    def counted(handler: DynamicRendezvousHandler) -> int:
        nonlocal before
        waiting = count(handler)
        if waiting > 0 and before == 0:
            _say(f"{waiting} node{'s' if waiting > 1 else ''} wait{'' if waiting > 1 else 's'} to join the job: "
                 f"torchrun's agent stops the workers (they save at the next step boundary) and the job re-forms "
                 f"with {'them' if waiting > 1 else 'it'}")
        before = waiting
        return waiting

    DynamicRendezvousHandler.num_nodes_waiting = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        DynamicRendezvousHandler.num_nodes_waiting = count  # type: ignore[method-assign]


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _rendezvous_lost(exc: BaseException) -> bool:
    """Whether torchrun failed because its rendezvous (its endpoint's host) went away."""
    return any(type(e).__name__ in ("RendezvousConnectionError", "RendezvousClosedError") for e in _chain(exc))


def death_signal(exc: BaseException) -> int | None:
    """The signal torchrun's agent stopped on (its ``SignalException``), found on `exc` or on an
    exception `exc` was raised while handling: a SIGTERM landing as torch's metrics wrapper enters
    its ``try`` leaves its ``finally`` an ``UnboundLocalError`` over the SignalException."""
    return next((int(e.sigval) for e in _chain(exc) if getattr(e, "sigval", None) is not None), None)


def rendezvous_wait(argv: list[str]) -> WaitReporter | None:
    """What reports the agent's waits for its c10d rendezvous across nodes (None: one node, or
    another rendezvous backend)."""
    if max_nodes(argv) <= 1 or (option(argv, "rdzv-backend") or "static") != "c10d":
        return None
    conf = rdzv_conf_items(option(argv, "rdzv-conf"))
    endpoint = option(argv, "rdzv-endpoint") or ""
    what = f"{endpoint} (run id {option(argv, 'rdzv-id') or 'none'}, --nnodes {option(argv, 'nnodes')})"
    probe = None
    if conf.get("is_host") != "1" and endpoint:  # the hosting node's own store answers once it is up
        probe = functools.partial(endpoint_silence, *split_endpoint(endpoint))
    return WaitReporter(what, float(conf.get("join_timeout", TORCHRUN_JOIN_TIMEOUT_S)), _say, probe=probe)


@contextlib.contextmanager
def _set_on_exit(event: threading.Event) -> Iterator[None]:
    try:
        yield
    finally:
        event.set()


@contextlib.contextmanager
def _agent_cpp_log_level(level: str) -> Iterator[None]:
    """torch's C++ log level for this process only (read once, when torch loads): the agent's store
    client logs each failed connection to the endpoint as a warning with ~20 C++ frames, which the
    launcher's own wait line says in one; the workers keep the level the user set (or torch's)."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ or "torch" in sys.modules:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = level
    try:
        yield
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _show_rendezvous_steps() -> None:
    """torchrun's rendezvous and agent log every step they take (joined, waits, a node found dead,
    a round complete) to stderr: what decides which nodes form each round of an elastic job."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[pipeflow.launch] %(asctime)s %(name)s: %(message)s"))
    for name in ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "torch.distributed.elastic.agent.server.api"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
        logger.propagate = False


def _say(text: str) -> None:
    print(f"[pipeflow.launch] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv`; returns 0 (finished), 75 (preempted and saved) or torchrun's status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        argv, added, node = with_node_address(argv, dict(os.environ))
    except LaunchError as exc:
        _say(f"error: {type(exc).__name__}: {exc}")  # the class the docs' fault table names
        return 2
    warning = shared_store_warning(dict(os.environ), option(argv, "nnodes")) if RDZV_ENDPOINT_ENV in added else None
    if warning:
        _say(f"warning: {warning}")
    if node is not None and os.environ.get("PIPEFLOW_LAUNCH_VERBOSE"):
        _say(f"this node: {node.address} on {node.interface}"
             f"{', hosting the rendezvous' if node.hosts_endpoint else ''}; {added or 'socket interfaces as set'}")
    os.environ.update(added)
    if os.environ.get("PIPEFLOW_LAUNCH_VERBOSE"):
        _show_rendezvous_steps()
    with _agent_cpp_log_level("ERROR"):
        from torch.distributed import run as torchrun  # late: --help and address errors need no torch

    signalled, failed_codes, stop_watch = False, [], threading.Event()
    waiting = rendezvous_wait(argv)
    if waiting is not None:  # the agent says nothing while it waits for the other nodes
        waiting.watch(stop_watch)
    grace_s = shutdown_timeout_s(option(argv, "shutdown-timeout"))
    with status_file() as path, _set_on_exit(stop_watch), marking_agent_stops(path, grace_s), saying_joins():
        os.environ[STATUS_FILE_ENV] = path
        try:
            torchrun.main(argv)
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException as exc:  # noqa: BLE001 - torchrun's ChildFailedError, its SignalException
            sigval = death_signal(exc)
            signalled = sigval is not None
            failed_codes = [failure.exitcode for failure in getattr(exc, "failures", {}).values()]
            status = 128 + int(sigval) if sigval is not None else 1
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)  # torchrun's report (exitcode lines)
            if _rendezvous_lost(exc):
                _say(f"lost the rendezvous at {option(argv, 'rdzv-endpoint')} ({type(exc).__name__}): the node that "
                     f"hosts it is gone, and with it this elastic job (torchrun cannot move a rendezvous); start the "
                     f"job again on the nodes left, with ENDPOINT on one of them and train.resume=auto (the newest "
                     f"verified checkpoint is taken)")
        preempted = preemption_recorded(path)
    if preempted is None or status == 0:
        return status
    if signalled or (failed_codes and all(code == PREEMPTED_EXIT_CODE for code in failed_codes)):
        _say(f"{preempted}; exiting with status {PREEMPTED_EXIT_CODE} (relaunch with train.resume=auto to continue)")
        return PREEMPTED_EXIT_CODE
    # torchrun's agent stopped the workers because one failed: those it stopped say "preempted",
    # but a requeue on 75 would restart a crashing job forever
    _say(f"a worker failed (exit statuses {sorted(set(failed_codes))}) and torchrun stopped the others, which "
         f"recorded '{preempted}'; exiting with status {status}: a failure, not a preemption (status "
         f"{PREEMPTED_EXIT_CODE} would have a requeue restart a crashing job)")
    return status
