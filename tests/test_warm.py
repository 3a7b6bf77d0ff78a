"""The suite's warm processes stand for the processes they replace: ``warm.launch`` returns what
``subprocess.run`` and torchrun return, and ``tests/warm_shim.py`` (torchrun's ``PYTHON_EXEC``)
is, to whoever started it, the worker: its output, environment, directory, exit status, signals
and parent; where a fork cannot be that process (another time namespace) it becomes a real one."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm
from warm_exec import interpreters

ROOT = Path(__file__).resolve().parents[1]


def _shim(code: str, *, input: str | None = None, cwd: Path = ROOT, env: dict[str, str] | None = None,
          argv: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    warm_env = interpreters()
    return subprocess.run([warm_env["PYTHON_EXEC"], *(argv or ("-c", code))], input=input, cwd=cwd, text=True,
                          capture_output=True, timeout=60, env={**os.environ, **warm_env, **(env or {})})


def test_a_warm_worker_has_the_callers_output_environment_directory_and_exit_status(tmp_path: Path) -> None:
    done = _shim("import os, sys, torch; print('out', os.getcwd(), os.environ['ASKED'], sys.argv[1:]); "
                 "print('err', file=sys.stderr); sys.exit(3)", cwd=tmp_path, env={"ASKED": "yes"})
    assert (done.returncode, done.stdout, done.stderr) == (3, f"out {tmp_path} yes []\n", "err\n")
    script = _shim("", argv=("-u", "-", "a", "b"), input="import sys\nprint(sys.argv)\nraise SystemExit('bye')\n")
    assert (script.returncode, script.stdout, script.stderr) == (1, "['-', 'a', 'b']\n", "bye\n")
    module = _shim("", argv=("-m", "pipeflow.plan", "--help"))
    assert module.returncode == 0 and "usage" in module.stdout.lower(), module.stderr[-2000:]


def test_a_warm_worker_is_a_fork_that_sees_its_stand_ins_parent_as_its_own() -> None:
    done = _shim("import os, sys; print(os.getppid(), 'torch' in sys.modules)")
    parent, preloaded = done.stdout.split()
    assert int(parent) == os.getpid() and preloaded == "True", done  # no import: the server's torch


def test_signals_reach_the_fork_and_its_death_is_its_stand_ins() -> None:
    env = {**os.environ, **interpreters()}
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (print('term', flush=True), sys.exit(75)))\n"
            "print('ready', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([env["PYTHON_EXEC"], "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 75 and proc.stdout.read() == "term\n"
    killed = _shim("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL  # what torchrun reports as 'exitcode: -9'


def test_a_killed_stand_in_takes_its_fork_with_it(tmp_path: Path) -> None:
    env = {**os.environ, **interpreters()}
    mark = tmp_path / "pid"
    code = f"import os, time; open({str(mark)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = subprocess.Popen([env["PYTHON_EXEC"], "-c", code], env=env)
    deadline = time.monotonic() + 30
    while not mark.exists() or not mark.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    fork = int(mark.read_text())
    assert fork != proc.pid
    proc.kill()
    proc.wait()
    while time.monotonic() < deadline:
        try:
            os.kill(fork, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"the fork {fork} outlived its killed stand-in")


def test_where_a_fork_cannot_stand_in_the_shim_becomes_a_real_interpreter() -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--time", "true"]).returncode != 0:
        pytest.skip("time namespaces (unshare --time) are not available here")
    env = {**os.environ, **interpreters()}
    done = subprocess.run(["unshare", "--time", "--monotonic", "1000", env["PYTHON_EXEC"], "-c",
                           "import sys, time; print('torch' in sys.modules, time.monotonic() > 1000)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done  # a fresh interpreter, in its own clock
    flags = _shim("", argv=("-B", "-c", "import sys; print('torch' in sys.modules)"))
    assert flags.stdout == "False\n"  # a flag a fork cannot honour


def test_warm_launch_returns_what_torchrun_returns_and_names_the_ranks_it_ended() -> None:
    code = ("import os, sys, time\nrank = int(os.environ['RANK'])\nprint(f'rank {rank} of {os.environ[\"WORLD_SIZE\"]}')\n"
            "if rank == 1: sys.exit(2)\ntime.sleep(60)\n")
    started = time.monotonic()
    done = warm.launch(["-c", code], 3, peers_ended_after_s=0.1, timeout=60)
    assert done.returncode == 1 and sorted(done.terminated) == [0, 2], done
    assert sorted(done.stdout.splitlines()) == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"]
    assert time.monotonic() - started < 30
    one = warm.run_python(["-c", "import sys; print(sys.argv[1:]); sys.exit(4)", "x"])
    assert (one.returncode, one.stdout, one.terminated) == (4, "['x']\n", [])


def test_a_selection_runs_only_the_cases_its_tests_read() -> None:
    from types import SimpleNamespace

    import mp_harness

    cases = [("zbv_exact", None), ("gpipe_exact", None), ("zbv_memory", None)]
    module = SimpleNamespace(__name__="test_selection_demo")

    def item(**params: object) -> SimpleNamespace:
        return SimpleNamespace(module=module, fixturenames=["world"], callspec=SimpleNamespace(params=params))

    def request(*items: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(module=module, fixturename="world", session=SimpleNamespace(items=list(items)))

    assert mp_harness.selected_cases(request(item(name="zbv")), cases) == cases  # nothing deselected: every case
    mp_harness.DESELECTED_MODULES.add(module.__name__)
    try:
        assert [n for n, _ in mp_harness.selected_cases(request(item(name="zbv", kind="exact")), cases)] == ["zbv_exact"]
        assert [n for n, _ in mp_harness.selected_cases(request(item(name="zbv")), cases)] == ["zbv_exact", "zbv_memory"]
        assert mp_harness.selected_cases(request(item(name="zbv"), item(steps=3)), cases) == cases  # one names none
    finally:
        mp_harness.DESELECTED_MODULES.discard(module.__name__)


def test_the_shim_starts_without_site_packages() -> None:
    first = Path(interpreters()["PYTHON_EXEC"]).read_text().splitlines()[0]
    assert first == f"#!{sys.executable} -SE"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _rank_1_dies() -> int:
    if _rank() == 1:
        os._exit(7)
    return 0


def _rank_0_times_out() -> int:
    if _rank() == 0:
        raise TimeoutError("a collective timed out")
    return 1


def test_a_case_that_breaks_its_world_is_named_and_the_next_cases_run_in_a_new_world() -> None:
    """A rank that dies in a case, and a timeout met in one, end their world; the harness records
    how, and the cases after each still run, each rank answering, in a new world."""
    import mp_harness

    cases = [("before", _rank), ("dies", _rank_1_dies), ("after", _rank), ("times-out", _rank_0_times_out),
             ("last", _rank)]
    with pytest.warns(mp_harness.WorldRestarted) as restarts:
        results = mp_harness.run_cases(2, cases)
    assert [str(w.message).split(" broke")[0] for w in restarts if w.category is mp_harness.WorldRestarted] == [
        "2-process world: case 'dies'", "2-process world: case 'times-out'"]
    for name in ("before", "after", "last"):
        assert [r.value for r in results[name]] == [0, 1] and not any(r.broke_world for r in results[name])
    died = results["dies"]
    assert died[0].value == 0 and died[1].error_type == "WorldBroken" and "exited 7" in died[1].error
    assert died[0].broke_world == died[1].broke_world == "rank 1 exited 7 during it"
    timed = results["times-out"]
    assert timed[0].error_type == "TimeoutError" and timed[1].value == 1
    assert "met a timeout" in timed[0].broke_world and timed[0].broke_world == timed[1].broke_world
