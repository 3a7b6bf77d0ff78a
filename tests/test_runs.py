"""Long runs lose nothing: resume=auto finds the run to continue, one job per run directory,
bounded joins, no orphans, validation of what a run is given.  Pure or single-process tests;
the multi-process cases are in test_faults.py (checkpoints) and test_scale.py (non-finite)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeflow.errors import ConfigError, JoinTimeoutError, RunDirLockedError
from pipeflow.run import discover
from pipeflow.checkpoint import lock
from pipeflow.run.builder import build_spec
from pipeflow.config.schema import check_config
from pipeflow.run.faults import ATTEMPT_VAR, ENV_VAR, FaultSpec, install_from_env
from pipeflow.run.workspace import check_usable
from pipeflow.runtime.world.distributed import join_store
from test_cli import compose_config

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ resume=auto
def _run(root: Path, name: str, cfg, checkpoint: bool = True, age_s: float = 0.0) -> Path:
    """A finished run directory: config.yaml and (with `checkpoint`) one complete checkpoint."""
    run = root / name
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if checkpoint:
        (run / "checkpoints" / "step_00000004" / "meta.json").write_text(json.dumps({"step": 4}))
        (run / "checkpoints" / "latest").write_text("step_00000004")
    stamp = time.time() - age_s
    for path in [run / "config.yaml", run / "checkpoints", *(run / "checkpoints").iterdir()]:
        os.utime(path, (stamp, stamp))
    return run


def test_resume_auto_continues_the_newest_matching_run_and_logs_what_differs(tmp_path: Path, caplog) -> None:
    now = compose_config("train.resume=auto", "train.max_steps=20", "parallel.dp=2")
    _run(tmp_path, "a_old_match", compose_config("train.max_steps=10"), age_s=300)
    match = _run(tmp_path, "b_match", compose_config("train.max_steps=10", "metrics.tensorboard=false"), age_s=200)
    _run(tmp_path, "c_other_model", compose_config("model.n_layer=2"), age_s=100)
    _run(tmp_path, "d_no_checkpoint", compose_config(), checkpoint=False, age_s=0)
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        assert discover.find_run(str(tmp_path), now) == str(match)
    text = caplog.text
    assert f"train.resume=auto: continuing {match}" in text
    assert "differs (allowed): train.max_steps 10 -> 20 - the learning-rate schedule's horizon moves" in text
    assert "differs (allowed): parallel.dp 1 -> 2" in text and "metrics.tensorboard false -> true" in text


def test_resume_auto_starts_fresh_and_says_why(tmp_path: Path, caplog) -> None:
    _run(tmp_path, "other", compose_config("model.n_layer=2", "optim.lr=0.1"))
    _run(tmp_path, "empty", compose_config(), checkpoint=False)
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        assert discover.find_run(str(tmp_path), compose_config("train.resume=auto")) is None
    assert f"starting fresh: none of the 2 runs under {tmp_path}/ can be continued" in caplog.text
    assert f"{tmp_path}/other: model.n_layer 2 -> 6, optim.lr 0.1 -> 0.003" in caplog.text, caplog.text
    assert f"{tmp_path}/empty: same config, no complete checkpoint" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        assert discover.find_run(str(tmp_path / "nothing"), compose_config()) is None
    assert "starting fresh: no run under" in caplog.text


def test_resume_auto_never_picks_a_run_a_live_job_holds(tmp_path: Path, caplog, sleeper) -> None:
    run = _run(tmp_path, "busy", compose_config())
    _write_lock(run, socket.gethostname(), sleeper.pid)
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        assert discover.find_run(str(tmp_path), compose_config("train.resume=auto")) is None
    assert f"but a live job holds it (pid {sleeper.pid} on host {socket.gethostname()}" in caplog.text


def test_what_may_differ_is_how_long_how_loud_and_the_layout() -> None:
    for key in ("train.max_steps", "train.log_every", "metrics.trace_steps", "parallel.pp", "schedule.stage_to_rank",
                "schedule.placement", "pipeline.split_points", "schedule.name", "comm.timeout_s"):
        assert discover.ignored(key), key
    for key in ("model.n_layer", "data.seed", "optim.lr", "train.param_dtype", "train.precision"):
        assert not discover.ignored(key), key


# ------------------------------------------------------------------------------------- lock
@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _write_lock(run: Path, host: str, pid: int, age_s: float = 0.0, rdzv: str = "") -> Path:
    path = run / lock.LOCK_FILE
    path.write_text(json.dumps({"host": host, "pid": pid, "token": "theirs", "rdzv": rdzv}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@contextlib.contextmanager
def renewing(path: Path, every_s: float) -> Iterator[None]:
    """A live holder on another host: its lease renewed every `every_s` seconds."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(OSError):
                os.utime(path)
    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_second_live_job_is_refused_naming_host_and_pid(tmp_path: Path, sleeper) -> None:
    _write_lock(tmp_path, socket.gethostname(), sleeper.pid, age_s=3600)  # same host: the pid decides
    with pytest.raises(RunDirLockedError, match=rf"in use by another live job: pid {sleeper.pid} on host {socket.gethostname()}"):
        lock.RunLock(str(tmp_path)).acquire()
    path = _write_lock(tmp_path, "node-7", 1234)  # another host, renewing its lease: watched, then refused
    with renewing(path, 0.05), pytest.raises(RunDirLockedError, match=r"pid 1234 on host node-7 \(lease renewed 0 s ago\)"):
        lock.RunLock(str(tmp_path), lease_s=0.8).acquire()


def test_a_restart_is_never_refused_by_its_own_dead_lock_on_a_lost_host(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57, item 5: the job's rank 0 died with its host (the rendezvous host), its lease is
    fresh, and the survivors start again at once: taken over at the first try, for the same
    rendezvous at once, for a rendezvous that answers no more at once, and otherwise after one
    renewal period unrenewed (before: refused until the 60 s lease ran out)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]  # nothing listens here once the socket is closed
    monkeypatch.setenv(lock.RDZV_ENDPOINT_ENV, "10.9.0.2:29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    for rdzv, says, lease_s in (("10.9.0.2:29500 job7", "this job's before its restart (the same rendezvous", 60.0),
                                (f"127.0.0.1:{closed} job7", f"endpoint 127.0.0.1:{closed} answers no more", 60.0),
                                ("", "was not renewed in 3 s: its job is gone", 4.0)):
        _write_lock(tmp_path, "node1", 1234, age_s=1, rdzv=rdzv)
        taker = lock.RunLock(str(tmp_path), lease_s=lease_s)
        began = time.monotonic()
        with caplog.at_level("WARNING"):
            token = taker.acquire()
        assert taker.taken_over is not None and taker.taken_over.host == "node1"
        assert says in caplog.text
        assert time.monotonic() - began < lock.renewal_window_s(lease_s) + 2
        held = json.loads((tmp_path / lock.LOCK_FILE).read_text())
        assert held["token"] == token and held["rdzv"] == "10.9.0.2:29500 job7"
        taker.release()
        caplog.clear()


def test_a_stale_lock_of_a_dead_job_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for host, pid, age in ((socket.gethostname(), _dead_pid(), 0.0), ("node-7", 1234, 2 * lock.LEASE_S)):
        _write_lock(tmp_path, host, pid, age_s=age)
        taker = lock.RunLock(str(tmp_path))
        with caplog.at_level("WARNING"):
            token = taker.acquire()
        assert taker.taken_over is not None and taker.taken_over.pid == pid
        # the dead holder may be this very job before a restart (issue 57, item 15: "a job that is gone")
        assert f"stale lock of a process that is gone (this job before a restart, or an earlier job): pid {pid}" \
            in caplog.text
        assert lock.read_holder(str(tmp_path / lock.LOCK_FILE)).token == token
        taker.release()
        assert not (tmp_path / lock.LOCK_FILE).exists()


def test_the_lease_is_renewed_while_the_job_lives(tmp_path: Path) -> None:
    held = lock.RunLock(str(tmp_path), lease_s=0.4)
    held.acquire()
    path = tmp_path / lock.LOCK_FILE
    os.utime(path, (0, 0))
    deadline = time.time() + 10
    while os.stat(path).st_mtime == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert os.stat(path).st_mtime > 0
    held.release()


# ---------------------------------------------------------------------------- validation
def test_train_max_steps_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"train.max_steps=-5 must be at least 1"):
        check_config(compose_config("train.max_steps=-5"), world_size=2)
    with pytest.raises(ConfigError, match=r"comm.join_timeout_s=0.0 must be > 0"):
        check_config(compose_config("comm.join_timeout_s=0"), world_size=2)


def not_a_spec() -> str:
    """A model builder that returns the wrong thing."""
    return "gpt"


def test_a_model_builder_must_return_a_model_spec() -> None:
    with pytest.raises(ConfigError, match=r"model._target_='test_runs.not_a_spec' returned a str, not a pipeflow ModelSpec"):
        build_spec(OmegaConf.create({"_target_": "test_runs.not_a_spec"}))


def test_an_unusable_run_dir_names_the_key(tmp_path: Path) -> None:
    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(ConfigError, match=rf"train.run_dir='{file}' is a file, not a directory"):
        check_usable(str(file), "train.run_dir")
    with pytest.raises(ConfigError, match=rf"train.run_dir='{file}/run' cannot be made"):
        check_usable(str(file / "run"), "train.run_dir")
    check_usable(str(tmp_path / "new" / "run"), "train.run_dir")
    assert (tmp_path / "new" / "run").is_dir()


def test_fault_injection_must_name_an_existing_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "kill:rank=5:step=2")
    with pytest.raises(ConfigError, match=r"names rank 5, but this job has ranks 0..1"):
        install_from_env({}, 0, 2)
    monkeypatch.setenv(ENV_VAR, "kill:rank=0:step=2:attempt=1")  # only in the second launch of a relaunch loop
    assert FaultSpec.parse(os.environ[ENV_VAR]).attempt == 1
    assert install_from_env({0: _Stage()}, 0, 2) is None
    monkeypatch.setenv(ATTEMPT_VAR, "1")
    assert install_from_env({0: _Stage()}, 0, 2) is not None


class _Stage:
    def __init__(self) -> None:
        self.pre_forward_hooks: list = []
        self.forward_hooks: list = []


# ------------------------------------------------------------------------ joins, orphans
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_that_never_joins_is_named_within_the_join_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    started = time.monotonic()
    with pytest.raises(JoinTimeoutError, match=r"rank 0: ranks 1, 2 of 3 never joined the process group within "
                                                r"comm.join_timeout_s=1 s"):
        join_store(0, 3, 1.0)
    with pytest.raises(JoinTimeoutError, match=r"rank 1: could not reach the rendezvous store .* rank 0, which hosts "
                                                r"it, never arrived"):
        join_store(1, 3, 1.0)
    assert time.monotonic() - started < 60  # not the 900 s process-group deadline


ORPHAN = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, {root!r}); "
                              "from pipeflow.runtime.world.distributed import watch_parent; "
                              "watch_parent(0.2); print('watching', flush=True); time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
""")


def test_a_worker_exits_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", ORPHAN.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    assert launcher.stdout.readline().strip() == "watching"  # the child has started its watch
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{child}") and "Z" not in _state(child):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}") or "Z" in _state(child), "the worker outlived its launcher by 10 s"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except OSError:
        return "Z"


WATCHED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import torch.distributed as dist
    from pipeflow.run import guard
    store = dist.HashStore()
    guard.watch_for_failures(1, poll_s=0.1, store=store)
    store.set(guard.FIRST_FAILURE_KEY, "rank 0: StageError: boom")  # rank 0 failed; this rank is busy
    time.sleep(60)
""")


def test_a_busy_rank_leaves_once_another_rank_has_failed() -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WATCHED.format(root=str(ROOT))], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 30, proc.stderr[-2000:]
    assert "rank 1: leaving because the job failed elsewhere; the first failure in this job was rank 0: StageError: boom" \
        in proc.stderr, proc.stderr[-2000:]


def test_explicit_resume_paths_name_a_step_a_checkpoints_folder_or_a_run_dir(tmp_path: Path) -> None:
    from pipeflow.checkpoint.saving import checkpoints_of, resolve

    run = _run(tmp_path, "run", compose_config())
    step = str(run / "checkpoints" / "step_00000004")
    for path in (run, run / "checkpoints", step):
        assert checkpoints_of(str(path)) == [step]
        assert resolve(str(path), "unused") == step


SECOND_JOB = textwrap.dedent("""
    import os, socket, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
    from test_cli import compose_config
    from pipeflow.run.workspace import prepare
    try:
        prepare(compose_config("train.run_dir={run}"))
    except Exception as exc:
        print(type(exc).__name__, exc)
""")


def test_a_second_job_is_refused_before_it_writes_anything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("the first job's config\n")
    (run / "checkpoints" / "step_00000002.theirs.tmp").mkdir(parents=True)  # the first job's save in progress
    _write_lock(run, socket.gethostname(), os.getpid())  # the first job: this (live) process
    code = SECOND_JOB.format(root=str(ROOT), tests=str(ROOT / "tests"), run=str(run))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"RunDirLockedError run directory {run} is in use by another live job: pid {os.getpid()}" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]
    assert (run / "config.yaml").read_text() == "the first job's config\n"
    assert (run / "checkpoints" / "step_00000002.theirs.tmp").is_dir()


def test_a_key_added_since_with_a_null_default_is_no_difference() -> None:
    assert discover.differences({"model.n_layer": 2}, {"model.n_layer": 2, "model.init_from": None}) == []
    assert discover.differences({"model.init_from": "/w.pt"}, {}) == [("model.init_from", "/w.pt", "(absent)")]
    assert discover.differences({"data.splits": [1, 2]}, {"data.splits": [1, 3]})[0][0] == "data.splits"
