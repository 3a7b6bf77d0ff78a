"""The launcher (python -m pipeflow.launch) and the hosts' checks, without launching: torchrun's
arguments it adds for each node, its status on a preemption, the address checks across hosts
and the host table that names peers' hosts in messages."""
from __future__ import annotations

import signal
import socket

import pytest

from pipeflow.errors import LaunchError
from pipeflow.commands import launch
from pipeflow.run.signals import (
    AGENT_STOP,
    PREEMPTED_EXIT_CODE,
    STATUS_FILE_ENV,
    leave_at_once_on,
    record_preemption,
)
from pipeflow.runtime.world import hosts
from pipeflow.runtime.world.hosts import HostInfo, HostTable

ELASTIC = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.9.0.1:29500",
           "train.py", "parallel.pp=2"]


@pytest.fixture
def node(monkeypatch):
    """This node as host 10.9.0.2 on eth0 (or the endpoint's host, 10.9.0.1, when asked)."""
    def make(address: str = "10.9.0.2") -> None:
        monkeypatch.setattr(launch, "local_addresses", lambda: {"127.0.0.1": "lo", address: "eth0"})
        monkeypatch.setattr(launch, "route_source", lambda ip, port: address if ip != "127.0.0.1" else "127.0.0.1")
    make()
    return make


def test_torchrun_options_are_read_in_either_spelling_before_the_script_only() -> None:
    argv = ["--standalone", "--nnodes=1:4", "--rdzv_endpoint", "h:1", "train.py", "--nnodes", "9"]
    assert launch.script_index(argv) == 4
    assert launch.option(argv, "nnodes") == "1:4" and launch.option(argv, "rdzv-endpoint") == "h:1"
    assert launch.max_nodes(argv) == 4 and launch.max_nodes(["train.py"]) == 1
    assert launch.split_endpoint("[::1]:7") == ("::1", 7) and launch.split_endpoint("node0") == ("node0", 29400)
    with pytest.raises(LaunchError, match="--nnodes 'x'"):
        launch.max_nodes(["--nnodes", "x", "train.py"])


def test_each_node_gets_its_address_interface_and_whether_it_hosts_the_rendezvous(node) -> None:
    argv, env, found = launch.with_node_address(ELASTIC, {})
    assert found == launch.NodeAddress("10.9.0.2", "eth0", hosts_endpoint=False)
    cut = argv.index("train.py")
    assert argv[cut:] == ["train.py", "parallel.pp=2"]  # the script's own arguments untouched
    assert argv[:cut][-4:] == ["--local-addr", "10.9.0.2", "--rdzv-conf",
                               "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,is_host=0"]
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                   "PIPEFLOW_RDZV_ENDPOINT": "10.9.0.1:29500"}  # the job's identity for its lock (issue 57, item 5)
    node("10.9.0.1")
    argv, env, found = launch.with_node_address([*ELASTIC[:-2], "--rdzv-conf", "join_timeout=60,last_call_timeout=9",
                                                 *ELASTIC[-2:]], {"GLOO_SOCKET_IFNAME": "ib0"})
    assert found.hosts_endpoint and "GLOO_SOCKET_IFNAME" not in env
    assert ("join_timeout=60,last_call_timeout=9,keep_alive_interval=1,keep_alive_max_attempt=3,is_host=1"
            in argv)  # the recovery defaults (issue 57, item 4) where not given
    argv, _, _ = launch.with_node_address([*ELASTIC[:-2], "--rdzv_conf=is_host=0", *ELASTIC[-2:]], {})
    assert "--rdzv_conf=is_host=0,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3" in argv


def test_one_node_or_a_loopback_endpoint_is_left_as_torchrun_has_it(node) -> None:
    """Agents on one machine keep their addresses, but get a fresh store per rendezvous round too:
    without it a node that joins hangs the restart in torchrun's store (issue 57, item 2)."""
    argv = ["--standalone", "--nproc-per-node", "2", "train.py"]
    assert launch.with_node_address(argv, {}) == (argv, {}, None)
    argv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29500", "train.py"]
    assert launch.with_node_address(argv, {}) == (argv, {"PIPEFLOW_RDZV_ENDPOINT": "127.0.0.1:29500",
                                                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, None)


def test_an_endpoint_this_node_cannot_use_stops_at_once_naming_the_fix(node, monkeypatch) -> None:
    with pytest.raises(LaunchError, match=r"names host 'nowhere\.invalid', which does not resolve.*IP address instead"):
        launch.with_node_address([*ELASTIC[:7], "nowhere.invalid:29500", *ELASTIC[8:]], {})
    monkeypatch.setattr(launch, "route_source", lambda ip, port: "127.0.0.1")
    with pytest.raises(LaunchError, match=r"over loopback \(127\.0\.0\.1\).*first node's address"):
        launch.with_node_address(ELASTIC, {})


def test_the_launchers_refusal_names_the_error_class_and_exits_2(node, monkeypatch, capsys) -> None:
    """Issue 57, item 8: it printed ``[pipeflow.launch] error: ...`` without the LaunchError the docs name."""
    monkeypatch.setattr(launch, "route_source", lambda ip, port: "127.0.0.1")
    assert launch.main(ELASTIC) == 2
    assert capsys.readouterr().err.startswith("[pipeflow.launch] error: LaunchError: this node would reach the endpoint")


def _torchrun_that(monkeypatch, outcome: BaseException | None, preempted: bool) -> None:
    from torch.distributed import run as torchrun

    def main(argv):
        if preempted:
            record_preemption(None, 7, "/runs/a/checkpoints/step_00000007")
        if outcome is not None:
            raise outcome
    monkeypatch.setattr(torchrun, "main", main)


def _child_failed(*codes: int) -> BaseException:
    """torchrun's ChildFailedError with workers that exited with `codes`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError("train.py", {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>")
                                         for rank, code in enumerate(codes)})


def _signal(sig: signal.Signals) -> BaseException:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException(f"Process 1 got signal: {sig}", sigval=sig)


@pytest.mark.parametrize(("outcome", "preempted", "status"), [
    (None, False, 0),
    (_child_failed(1, 0), False, 1),
    (_child_failed(75, 75), True, PREEMPTED_EXIT_CODE),  # the workers alone got the signal, and saved
    (_signal(signal.SIGTERM), True, PREEMPTED_EXIT_CODE),  # the scheduler's signal reached the launcher
    (_child_failed(1, 75), True, 1),  # issue 57: rank 1 crashed, torchrun stopped rank 0: a failure
    (SystemExit(3), False, 3),
], ids=["done", "failed", "workers_signalled", "launcher_signalled", "crash_then_stopped", "torchrun_exit"])
def test_the_launchers_status_tells_a_preemption_from_a_failure(monkeypatch, capsys, outcome, preempted, status) -> None:
    _torchrun_that(monkeypatch, outcome, preempted)
    monkeypatch.delenv(STATUS_FILE_ENV, raising=False)
    assert launch.main(["--standalone", "train.py"]) == status
    if preempted:
        assert "preempted at step 7: checkpoint /runs/a/checkpoints/step_00000007" in capsys.readouterr().err


@pytest.mark.parametrize(("before", "after"), [
    ("", "preempted at start-up: nothing saved"),
    (f"{AGENT_STOP}: a worker failed\n", AGENT_STOP),  # torchrun's agent stopped it: no preemption recorded
], ids=["signal_to_the_job", "agent_stop"])
def test_a_signal_during_start_up_leaves_at_once_with_75_and_says_so(monkeypatch, tmp_path, before, after) -> None:
    status = tmp_path / "status"
    status.write_text(before)
    monkeypatch.setenv(STATUS_FILE_ENV, str(status))
    left: list[int] = []
    restore = leave_at_once_on([signal.SIGUSR1], 0, left.append)
    try:
        signal.raise_signal(signal.SIGUSR1)
    finally:
        restore()
    assert left == [PREEMPTED_EXIT_CODE] and status.read_text().startswith(after)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_the_agents_own_stops_are_marked_for_the_workers_and_a_signal_to_the_job_is_not(tmp_path) -> None:
    """Issue 57, item 2: torchrun's agent SIGTERMs its workers when one failed or when a node joins
    or leaves; the launcher marks those stops in its status file while they last, so a worker
    neither says nor records a preemption (a requeue on 75 would restart a crashing job), and
    puts back what a worker recorded there.  A signal to the launcher itself is a preemption:
    its stop goes unmarked."""
    from torch.distributed.elastic.multiprocessing import api

    status = tmp_path / "status"
    status.write_text("preempted at step 4: checkpoint c\n")
    seen: list[str] = []

    class Context:  # what PContext.close needs of its processes
        _tail_logs, filtered_stdout, filtered_stderr = (), None, None

        def _close(self, death_sig, timeout) -> None:
            seen.append(status.read_text())

    with launch.marking_agent_stops(str(status)):
        api.PContext.close(Context())  # a worker failed: the agent stops the rest
        assert seen[-1].startswith(AGENT_STOP) and status.read_text() == "preempted at step 4: checkpoint c\n"
        with pytest.raises(api.SignalException):
            api._terminate_process_handler(signal.SIGTERM, None)  # the scheduler's signal reached the launcher
        api.PContext.close(Context(), signal.SIGTERM)
        assert not seen[-1].startswith(AGENT_STOP)
    assert api.PContext.close.__name__ == "close"  # torchrun's own again


def test_the_agents_own_stops_give_the_workers_the_shutdown_timeout(tmp_path) -> None:
    """torch 2.14's agent stops its workers for a restart (a node joined or left) with its default
    30 s before SIGKILL, whatever --shutdown-timeout says: a big model's save at the next step
    boundary could be killed half written.  The launcher gives them the timeout torchrun was given."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    asked: list[tuple] = []

    class Agent:  # what LocalElasticAgent._stop_workers needs of itself
        _shutdown_timeout = 120

        def _shutdown(self, *args, **kwargs) -> None:
            asked.append((args, kwargs))

    LocalElasticAgent._stop_workers(Agent(), None)
    assert asked == [((), {})], asked  # torch's own: no timeout passed, its default of 30 s applies
    waited: list[int] = []

    class Context:  # what PContext.close needs of its processes
        _tail_logs, filtered_stdout, filtered_stderr = (), None, None

        def _close(self, death_sig, timeout) -> None:
            waited.append(timeout)

    status = tmp_path / "status"
    status.write_text("")
    with launch.marking_agent_stops(str(status), grace_s=launch.shutdown_timeout_s("120")):
        api.PContext.close(Context())  # the agent's restart: torch's 30 s
        api.PContext.close(Context(), timeout=300)  # a longer one stays
    assert waited == [120, 300], waited
    assert [launch.shutdown_timeout_s(given, env) for given, env in
            [(None, {}), (None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}), ("90", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})]
            ] == [30, 45, 90]
    argv = ["--nproc-per-node", "2", "--shutdown_timeout=75", "train.py", "--shutdown-timeout=5"]
    assert launch.shutdown_timeout_s(launch.option(argv, "shutdown-timeout")) == 75  # torchrun's, not the script's


def test_nodes_waiting_to_join_are_said_once_per_change(monkeypatch, capsys) -> None:
    """The agent logs the nodes that wait to join (and stops its workers for them) at INFO, below
    its default level: the launcher says it once, when the count becomes non-zero."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    counts = iter([0, 1, 1, 0, 2])
    monkeypatch.setattr(DynamicRendezvousHandler, "num_nodes_waiting", lambda self: next(counts))
    with launch.saying_joins():
        assert [DynamicRendezvousHandler.num_nodes_waiting(None) for _ in range(5)] == [0, 1, 1, 0, 2]
    said = capsys.readouterr().err.splitlines()
    assert said == ["[pipeflow.launch] 1 node waits to join the job: torchrun's agent stops the workers (they save at "
                    "the next step boundary) and the job re-forms with it",
                    "[pipeflow.launch] 2 nodes wait to join the job: torchrun's agent stops the workers (they save at "
                    "the next step boundary) and the job re-forms with them"], said


def _infos(*rows: tuple[str, str, str], master: str = "10.9.0.1") -> list[HostInfo]:
    return [HostInfo(name, machine, bind, master) for name, machine, bind in rows]


TWO_HOSTS = [("host0", "a", "10.9.0.1"), ("host0", "a", "10.9.0.1"), ("host1", "b", "10.9.0.2"), ("host1", "b", "10.9.0.2")]


def test_addresses_that_cannot_work_across_hosts_are_named_with_the_host_and_the_fix() -> None:
    hosts.check_addresses(_infos(*TWO_HOSTS))
    hosts.check_addresses(_infos(("a", "m", "127.0.0.1"), ("b", "m", "127.0.0.1"), master="127.0.0.1"))  # one host
    with pytest.raises(LaunchError, match=r"spans 2 hosts \(host0, host1\), but MASTER_ADDR=127\.0\.0\.1 is a loopback"):
        hosts.check_addresses(_infos(*TWO_HOSTS, master="127.0.0.1"))
    loopback = [*TWO_HOSTS[:2], ("host1", "b", "127.0.0.1"), ("host1", "b", "127.0.0.1")]
    with pytest.raises(LaunchError, match=r"ranks on host host1 \(global ranks 2-3\) would talk over loopback: its "
                                          r"host name 'host1' resolves to 127\.0\.0\.1.*GLOO_SOCKET_IFNAME"):
        hosts.check_addresses(_infos(*loopback))
    hosts.check_addresses(_infos(*loopback), gloo=False)  # NCCL picks its own interface
    shared = [*TWO_HOSTS[:2], ("node", "b", "10.9.0.1"), ("node", "b", "10.9.0.1")]
    with pytest.raises(LaunchError, match=r"hosts host0 \(global ranks 0-1\), node \(global ranks 2-3\) all bind "
                                          r"address 10\.9\.0\.1"):
        hosts.check_addresses(_infos(*shared))


def test_the_host_table_names_the_hosts_of_peers_and_of_addresses(monkeypatch) -> None:
    table = HostTable.of(_infos(*TWO_HOSTS))
    assert HostTable.from_json(table.to_json()) == table
    assert table.host_of(3) == ("host1", "10.9.0.2", (2, 3))
    monkeypatch.setattr(hosts, "_TABLE", table)
    assert hosts.of_ranks([2]) == " (on host host1 (10.9.0.2), which runs global ranks 2-3)"
    assert hosts.of_addresses("Read error [10.9.0.2]:6818: Connection reset by peer") == \
        " (10.9.0.2 is host host1, which runs global ranks 2-3)"
    monkeypatch.setattr(hosts, "_TABLE", HostTable.of(_infos(*TWO_HOSTS[:2])))
    assert hosts.of_ranks([1]) == "" and hosts.of_addresses("[10.9.0.1]:1") == ""  # one host: nothing to add
    assert HostInfo.from_json("node-3:4242") == HostInfo("node-3", "?", "?", "?")


def test_a_failing_rank_names_the_hosts_whose_heartbeat_stopped(monkeypatch) -> None:
    import torch.distributed as dist

    from pipeflow.run import guard

    monkeypatch.setattr(hosts, "_TABLE", HostTable.of(_infos(*TWO_HOSTS, ("host2", "c", "10.9.0.3"))))
    store = dist.HashStore()
    assert guard.heartbeat_key(0) == "pipeflow/alive/0" and guard.heartbeat_key(1) is None
    store.add("pipeflow/alive/4", 1)  # host2 beat once, before: it stopped too
    said = guard.lost_hosts(0, store, probe_s=0.1)  # host0's keeper beats while it probes; its own host is alive
    assert said == ("lost hosts host1 (10.9.0.2, global ranks 2-3); host2 (10.9.0.3, global ranks 4): no heartbeat "
                    "for 0.1 s (its processes died, or its network is cut off)")
    assert guard.lost_hosts(3, store, probe_s=0.1).startswith("lost hosts host0 (10.9.0.1, global ranks 0-1); host2")

    class Gone:
        def add(self, *args):
            raise RuntimeError("Connection refused")
    assert "cannot be reached from host host0 (RuntimeError): this host is cut off" in guard.lost_hosts(0, Gone(), 0.1)


def test_a_lost_rendezvous_host_is_named_with_the_way_out(monkeypatch, capsys) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    try:
        raise RendezvousConnectionError("The connection to the C10d store has failed.")
    except RendezvousConnectionError as cause:
        failure = RuntimeError("agent failed")
        failure.__cause__ = cause
    _torchrun_that(monkeypatch, failure, preempted=False)
    monkeypatch.delenv(STATUS_FILE_ENV, raising=False)
    assert launch.main(["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29500", "train.py"]) == 1
    assert ("lost the rendezvous at 127.0.0.1:29500 (RuntimeError): the node that hosts it is gone"
            in capsys.readouterr().err)


@pytest.mark.parametrize("shared", ["0", None])
def test_torchruns_shared_store_is_named_as_the_hang_of_a_node_that_joins(monkeypatch, capsys, shared) -> None:
    """A third host joining a running 2:3 job under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 waited
    120 s in torch's rank assignment and failed, silently (the CI run of ad1a193)."""
    _torchrun_that(monkeypatch, None, preempted=False)
    for name in (STATUS_FILE_ENV, "PIPEFLOW_RDZV_ENDPOINT", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(name, raising=False)  # restored after: main() sets what it adds
    if shared is not None:
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", shared)
    argv = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "train.py"]
    assert launch.main(argv) == 0
    said = capsys.readouterr().err
    assert ("warning: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 (torchrun's shared store): a node that joins the running "
            "job (--nnodes 2:3" in said) == (shared == "0"), said


def test_a_rendezvous_port_another_program_holds_is_named_before_torchrun_waits_on_it(node) -> None:
    """Issue 57, item 6: the launcher hung without a line when the endpoint's port was taken."""
    import socket

    node("10.9.0.1")  # this node hosts the endpoint
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        argv = [*ELASTIC[:7], f"10.9.0.1:{port}", *ELASTIC[8:]]
        with pytest.raises(LaunchError, match=rf"--rdzv-endpoint 10.9.0.1:{port}: this node hosts the rendezvous, "
                                              rf"but port {port} here is taken by another program .*--rdzv-endpoint "
                                              r"10.9.0.1:<port>"):
            launch.with_node_address(argv, {})
        node("10.9.0.2")  # another node only connects to it
        assert launch.with_node_address(argv, {})[2].hosts_endpoint is False
    node("10.9.0.1")
    assert launch.with_node_address(argv, {})[2].hosts_endpoint  # freed: the host may take it


def test_while_the_agent_waits_for_its_rendezvous_the_launcher_says_so_every_few_seconds() -> None:
    """Issue 57, items 4 and 6: nothing was printed for the ~42 s of a recovery, nor while a node
    waited for others that never came."""
    from pipeflow.commands.launch_wait import WaitReporter

    argv = [*ELASTIC[:-2], "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=60", *ELASTIC[-2:]]
    assert launch.rendezvous_wait(["--standalone", "--nproc-per-node", "2", "train.py"]) is None
    reporter = launch.rendezvous_wait(argv)
    assert reporter.what == "10.9.0.1:29500 (run id job7, --nnodes 1:2)" and reporter.deadline_s == 60
    assert reporter.probe is not None  # not the hosting node: it looks whether the endpoint answers
    assert launch.rendezvous_wait([*ELASTIC[:-2], "--rdzv-conf", "is_host=1", *ELASTIC[-2:]]).probe is None
    now, workers, said = [0.0], [0], []
    silence = ["No route to host"]
    waits = WaitReporter(reporter.what, 60, said.append, lambda: workers[0], lambda: now[0], probe=lambda: silence[0])
    # a child seen at one look only (a helper the agent ran, 7 s) is no worker: the wait goes on
    for t, running in ((2, 0), (5, 0), (7, 1), (8, 0), (10.4, 0), (11, 2), (12, 2), (30, 2), (31, 0), (34, 0),
                       (36.2, 0)):
        now[0], workers[0] = t, running
        silence[0] = None if t > 6 else silence[0]
        waits.tick()
    assert said == [
        "waiting for the rendezvous at 10.9.0.1:29500 (run id job7, --nnodes 1:2): 5 s of at most 60 "
        "(--rdzv-conf join_timeout); the endpoint does not answer: No route to host",
        "waiting for the rendezvous at 10.9.0.1:29500 (run id job7, --nnodes 1:2): 10 s of at most 60 "
        "(--rdzv-conf join_timeout)",
        "waiting for the rendezvous at 10.9.0.1:29500 (run id job7, --nnodes 1:2) again (the workers ended: a "
        "restart, or the job's end): 5 s of at most 60 (--rdzv-conf join_timeout)"]


def test_an_endpoint_that_does_not_answer_is_named_with_the_reason() -> None:
    from pipeflow.commands.launch_wait import endpoint_silence

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        assert endpoint_silence("127.0.0.1", port) == (f"nothing listens on port {port} there (not started yet, or "
                                                       f"another port)")
        free.listen(1)
        assert endpoint_silence("127.0.0.1", port) is None


def test_the_launcher_counts_its_running_workers_from_proc() -> None:
    import subprocess
    import sys

    from pipeflow.commands.launch_wait import live_children

    before = live_children()
    if before is None:
        pytest.skip("/proc does not list children here")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert live_children() == before + 1
    finally:
        child.kill()
        child.wait()
    assert live_children() == before


def test_a_signal_under_another_error_of_the_agent_is_a_preemption():
    """SIGTERM landing as torch's metrics wrapper enters its ``try`` leaves its ``finally`` an
    UnboundLocalError over the SignalException (seen once in CI: that node's launcher exited 1,
    a failure, and Slurm's requeue read the job as crashed); the launcher finds the signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def agent() -> None:
        try:
            raise SignalException("Process 1038 got signal: 15", sigval=signal.SIGTERM)
            start = 0.0  # noqa: F841 - never reached, as in torch's wrapper
        finally:
            start + 1  # noqa: F821 - unbound: the wrapper's elapsed time

    with pytest.raises(UnboundLocalError) as raised:
        agent()
    assert launch.death_signal(raised.value) == signal.SIGTERM
    assert launch.death_signal(RuntimeError("a worker failed")) is None
