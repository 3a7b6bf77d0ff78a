"""A host is more than its name; clocks across hosts.

The run directory's lock judges a holder by its machine (boot id, network and pid namespace), not
by its host name alone; clock offsets group ranks by their clock's identity; the hosts' wall
clocks are compared at start and a skew beyond 2 s is named.  One launch on two emulated hosts
that share one host name, the second with its own monotonic clock (``unshare --time``) and a wall
clock 5 s ahead (the drill variable ``PIPEFLOW_CLOCK_SKEW_S``)."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosts import SMALL64, emulated_hosts, launch_on_hosts, outputs  # noqa: F401 - a fixture
from test_runs import renewing
from pipeflow.errors import ConfigError, LaunchError, RunDirLockedError
from pipeflow.checkpoint import lock
from pipeflow.runtime.world import clocks
from pipeflow.runtime.world.hosts import HostInfo, HostTable, check_addresses, host_labels, machine_id

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write_lock(run: Path, age_s: float = 0.0, **fields: object) -> Path:
    path = run / lock.LOCK_FILE
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "token": "other", **fields}))
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


# ------------------------------------------------------------------------------------- the lock
@pytest.mark.parametrize("fields", [{"machine": "0f1e-other-boot/net:4026531840"},  # a cloned image, same name
                                    {"pid_ns": "pid:1"}])  # this machine, another container's pids
def test_a_live_lease_on_another_machine_of_our_name_is_not_judged_by_a_pid_here(tmp_path, fields) -> None:
    fields = {"machine": machine_id(), **fields}
    path = _write_lock(tmp_path, **fields)  # its pid does not exist here, its lease is renewed
    with renewing(path, 0.05), pytest.raises(RunDirLockedError, match="in use by another live job: pid") as err:
        lock.RunLock(str(tmp_path), lease_s=0.8).acquire()
    if fields["machine"] != machine_id():
        assert f"(machine {fields['machine']}: another machine than this one, which has the same name" in str(err.value)
    _write_lock(tmp_path, age_s=2 * lock.LEASE_S, **fields)  # its lease ran out: taken over
    taker = lock.RunLock(str(tmp_path))
    taker.acquire()
    assert taker.taken_over is not None and taker.taken_over.machine == fields["machine"]
    taker.release()


def test_a_lock_records_its_machine_and_an_older_lock_without_one_is_judged_by_name(tmp_path) -> None:
    held = lock.RunLock(str(tmp_path))
    held.acquire()
    data = json.loads((tmp_path / lock.LOCK_FILE).read_text())
    assert data["machine"] == machine_id() and data["pid_ns"] == lock.pid_namespace() and data["pid"] == os.getpid()
    held.release()
    _write_lock(tmp_path)  # an older lock: our name, a dead pid, a fresh lease: dead (the pid decides)
    taker = lock.RunLock(str(tmp_path))
    taker.acquire()
    assert taker.taken_over is not None and taker.taken_over.machine == ""
    taker.release()


# ------------------------------------------------------------------------------------- clocks
def test_hosts_that_share_a_name_are_told_apart_by_their_machine() -> None:
    infos = [HostInfo("node", "m1", "10.0.0.1", ""), HostInfo("node", "m2", "10.0.0.2", ""),
             HostInfo("gpu7", "m3", "10.0.0.3", "")]
    assert list(host_labels(infos).values()) == ["node (machine m1)", "node (machine m2)", "gpu7"]
    table = HostTable.of(infos)  # what every message naming a peer's host reads
    assert [name for name, _, _ in table.hosts] == ["node (machine m1)", "node (machine m2)", "gpu7"]
    assert HostTable.from_json(table.to_json()) == table
    loopback = [infos[0], HostInfo("node", "m2", "127.0.0.1", "")]
    said = r"spans 2 hosts \(node \(machine m1\), node \(machine m2\)\), but the ranks on host node \(machine m2\) "
    with pytest.raises(LaunchError, match=said + r"\(global ranks 1\) would talk over loopback"):
        check_addresses([HostInfo(i.name, i.machine, i.bind, "10.0.0.1") for i in loopback])
    skews = clocks.wall_skews([("node", "m1", 100.0, 0.01), ("node", "m1", 100.1, 0.02), ("node", "m2", 105.0, 0.01)])
    assert [(s.host, s.ranks, round(s.offset_s, 6)) for s in skews] == [
        ("node (machine m1)", (0, 1), 0.0), ("node (machine m2)", (2,), 5.0)]
    said = clocks.skew_warning(skews)
    assert said is not None and said.startswith(
        "the hosts' wall clocks disagree by more than 2 s: host node (machine m2) (global ranks 2) is 5.0 s ahead of "
        "host node (machine m1) (rank 0's) (measured at start to within ±20 ms)")
    assert "NTP" in said and "exit barrier" in said
    near = clocks.wall_skews([("a", "m1", 100.0, 0.5), ("b", "m2", 97.6, 0.5)])  # 2.4 s, but only ± 0.5 s sure
    assert near[1].offset_s == pytest.approx(-2.4) and clocks.skew_warning(near) is None


def test_the_drill_variable_moves_the_wall_clock_and_a_bad_value_is_named(monkeypatch) -> None:
    monkeypatch.setenv(clocks.SKEW_ENV, "-60")
    assert clocks.wall_now() == pytest.approx(time.time() - 60, abs=1.0)
    monkeypatch.setenv(clocks.SKEW_ENV, "soon")
    with pytest.raises(ConfigError, match="PIPEFLOW_CLOCK_SKEW_S='soon'"):
        clocks.wall_now()


def test_a_process_with_its_own_monotonic_clock_has_another_clock_identity() -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--time", "true"]).returncode != 0:
        pytest.skip("time namespaces (unshare --time) are not available here")
    code = "from pipeflow.runtime.world.clocks import clock_identity; print(clock_identity())"
    other = subprocess.run(["unshare", "--time", "--monotonic", "1000", sys.executable, "-c", code], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    here = clocks.clock_identity()
    assert other.split(" time:")[0] == here.split(" time:")[0] and other != here  # same name and machine


# ------------------------------------------------------------------------------------- two hosts
def test_two_hosts_of_one_name_with_apart_clocks_are_named_and_the_trace_stays_aligned(
        emulated_hosts, tmp_path) -> None:
    """Both hosts are called ``node``; host 1 counts its monotonic clock from 1000 s later and its
    wall clock (as pipeflow compares it) runs 5 s ahead: rank 0 warns naming both machines and the
    5 s, and the trace of a step still shows stage 1's forwards after stage 0's."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL64, "parallel.pp=2", "train.max_steps=3", "pipeline.num_microbatches=2",
                 "metrics.trace_steps=[2]", f"train.run_dir={run_dir}"]
    with emulated_hosts(2, names="missing") as hosts:
        hosts.hostnames = ["node", "node"]
        procs = launch_on_hosts(hosts, overrides, nproc=1, on=[0])
        base = {"NNODES": "2", "NPROC": "1", "ENDPOINT": hosts.endpoint(), "RUN_ID": f"t{os.getpid()}",
                "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", clocks.SKEW_ENV: "5"}
        procs.append(hosts.run(1, ["unshare", "--time", "--monotonic", "1000", str(ROOT / "examples" / "multinode.sh"),
                                   *overrides], base, 120))
        texts = outputs(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(t[-3000:] for t in texts)
    said = re.search(r"rank 0: the hosts' wall clocks disagree by more than 2 s: host node \(machine (\S+)\) "
                     r"\(global ranks 1\) is ([\d.]+) s ahead of host node \(machine (\S+)\) \(rank 0's\)", texts[0])
    assert said is not None, texts[0][-3000:]
    assert said.group(1) != said.group(3) and abs(float(said.group(2)) - 5.0) < 0.5
    assert "rank 1: the hosts' wall clocks disagree" in texts[1]  # the skewed host's own log says it too
    trace = json.loads((run_dir / "trace.json").read_text())
    forward = {(e["pid"], e["args"]["microbatch"]): e
               for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "F"}
    for i in range(2):  # on rank 0's time axis: stage 1's F of micro-batch i starts soon after stage 0's ended
        gap_us = forward[1, i]["ts"] - (forward[0, i]["ts"] + forward[0, i]["dur"])
        assert -20_000 <= gap_us <= 5_000_000, (i, forward)
