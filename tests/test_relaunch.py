"""Restarts that work: examples/relaunch.sh around torchrun (gloo) survives a worker killed
mid-run, resumes by itself (train.resume=auto, no run directory named) and ends exactly where an
uninterrupted run ends: the same losses after the resume (steps 2-5, logged 0-based), the same final weights bit for bit."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from warm_exec import interpreters

from pipeflow.checkpoint.saving import export, find_latest

ROOT = Path(__file__).resolve().parents[1]
RUN = ["model=mlp", "data=gaussian", "train.max_steps=6", "train.save_every=2", "train.log_every=1", "train.eval_every=0",
       "train.eval_batches=1", "pipeline.profile=false", "comm.timeout_s=10", "comm.first_step_timeout_s=60",
       "metrics.tensorboard=false"]
STEP = re.compile(r"step\s+(\d+)/6 \| loss ([\d.]+)")


def _launch(cwd: Path, fault: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "PIPEFLOW_RELAUNCH_DELAY_S": "0.5",
           **interpreters()}
    env.pop("PIPEFLOW_FAULT_INJECT", None)
    if fault:
        env["PIPEFLOW_FAULT_INJECT"] = fault
    cwd.mkdir()
    return subprocess.run(["bash", str(ROOT / "examples" / "relaunch.sh"), *RUN], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _losses(text: str) -> dict[int, str]:
    return {int(step): loss for step, loss in STEP.findall(text)}


def _final_weights(cwd: Path, tmp: Path) -> dict[str, torch.Tensor]:
    (run,) = list((cwd / "outputs").iterdir())
    out = tmp / f"{cwd.name}.pt"
    export(find_latest(str(run / "checkpoints")), str(out))
    return torch.load(out)


def test_relaunch_loop_survives_a_killed_worker_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = _launch(tmp_path / "straight", None)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _launch(tmp_path / "killed", "kill:rank=1:step=3:attempt=0")  # SIGKILL in step 3 of launch 1 only
    text = killed.stdout + killed.stderr
    assert killed.returncode == 0, text[-4000:]
    assert "[relaunch] launch 1 exited with status 1" in text and "[relaunch] launch 2 of 3" in text, text[-4000:]
    assert re.search(r"exitcode\s*: -9", text)  # launch 1: the worker really was killed
    assert "train.resume=auto: continuing outputs/" in text, text[-4000:]
    assert re.search(r"resumed from checkpoint outputs/[^/]+/checkpoints/step_00000002 at step 2", text), text[-4000:]
    assert len(list((tmp_path / "killed" / "outputs").iterdir())) == 1  # one run directory, continued
    expected, got = _losses(straight.stdout), _losses(killed.stdout.split("resumed from checkpoint")[1])
    assert sorted(got) == [2, 3, 4, 5] and all(got[s] == expected[s] for s in got), (expected, got)
    reference, resumed = _final_weights(tmp_path / "straight", tmp_path), _final_weights(tmp_path / "killed", tmp_path)
    assert sorted(reference) == sorted(resumed) and all(torch.equal(reference[k], resumed[k]) for k in reference)


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl_c"])
def test_sigterm_to_the_launcher_saves_at_the_next_step_exits_75_and_resume_continues_there(
        tmp_path: Path, ctrl_c: bool) -> None:
    """train.save_on_signal (default SIGTERM and SIGINT): what a cluster scheduler sends before it
    kills a job, or Ctrl-C in the terminal (SIGINT to the launcher's process group; torchrun's agent
    passes it on to the workers, issue 57). Every rank saves at the same step boundary, says so, and
    exits 75, and so does the launcher (python -m pipeflow.launch: torchrun alone exits 1); the run
    directory records the step; train.resume=auto continues from that step, so at most the step in
    flight is lost."""
    run_dir = tmp_path / "run"
    long = [a for a in RUN if not a.startswith(("train.max_steps", "train.save_every"))]
    args = [sys.executable, "-m", "pipeflow.launch", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "train.py"), *long, "train.max_steps=100000", "train.save_every=0", f"train.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **interpreters()}
    env.pop("PIPEFLOW_FAULT_INJECT", None)
    job = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=ctrl_c)
    lines = []
    try:
        for line in job.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if re.search(r"step\s+3/100000 \| loss", line):
                if ctrl_c:  # what the terminal sends: SIGINT to the foreground process group
                    os.killpg(job.pid, signal.SIGINT)
                else:
                    job.send_signal(signal.SIGTERM)
                break
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    text = "".join(lines) + rest
    saved = re.search(r"preempted at step (\d+): saved \S+/checkpoints/step_(\d+)", text)
    assert saved and saved.group(1) == str(int(saved.group(2))), text[-4000:]
    step = int(saved.group(1))
    logged = max(int(s) for s in re.findall(r"step\s+(\d+)/100000 \| loss", text))
    assert step >= logged + 1  # every step logged before the signal is in the checkpoint
    assert job.returncode == 75 and f"[pipeflow.launch] preempted at step {step}: checkpoint " in text, text[-4000:]
    assert (run_dir / "preempted").read_text().startswith(f"preempted at step {step}: ")
    resumed = subprocess.run([*args[:-3], "train.max_steps=%d" % (step + 2), "train.resume=auto", f"train.run_dir={run_dir}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(rf"resumed from checkpoint \S+step_{step:08d} at step {step}", resumed.stdout + resumed.stderr)
    assert not (run_dir / "preempted").exists()  # the run went on: no longer preempted


CRASHING_MODEL = '''
import functools, os, time
from pipeflow.models.mlp import build_mlp


@functools.wraps(build_mlp)
def build(**kwargs):
    if os.environ.get("RANK") == "1":
        os._exit(1)  # a crash on one rank while its peer still builds its model
    time.sleep(10)
    return build_mlp(**kwargs)
'''


def test_a_rank_that_crashes_at_start_up_is_a_failure_not_a_preemption(tmp_path: Path) -> None:
    """Issue 57: rank 1 exits 1 while rank 0 builds its model; torchrun's agent SIGTERMs rank 0,
    which leaves at once, knowing the agent stopped it (no preemption recorded).  The launcher
    exits 1 (torchrun's own status), not 75: a requeue on 75 would restart a crashing job forever."""
    (tmp_path / "crashing_model.py").write_text(CRASHING_MODEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path), **interpreters()}
    env.pop("PIPEFLOW_FAULT_INJECT", None)
    done = subprocess.run([sys.executable, "-m", "pipeflow.launch", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "train.py"), *RUN, "model._target_=crashing_model.build",
                           f"train.run_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-4000:]
    # rank 0 knows its SIGTERM came from torchrun's agent (the launcher marks the agent's stops):
    # it says so and records no preemption
    assert "during start-up from torchrun's agent, which stops its workers" in text, text[-4000:]
    assert "preempted" not in text and "status 75" not in text, text[-4000:]


def test_a_node_that_joins_restarts_the_workers_after_a_save_and_that_is_no_preemption(tmp_path: Path) -> None:
    """Issue 57, item 2: two launchers as two nodes of one elastic job (--nnodes 1:2).  The second
    joins while the first trains: torchrun's agent SIGTERMs its workers to restart them on the
    bigger world; they save (nothing lost), say it was the agent, record no preemption, and go on
    from that step with dp 2; the launcher does not exit.  A SIGTERM to both launchers then is a
    preemption: each saves, and both launchers exit 75."""
    import socket
    import threading
    import time

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **interpreters(launchers=True)}
    env.pop("PIPEFLOW_FAULT_INJECT", None)
    long = [a for a in RUN if not a.startswith(("train.max_steps", "train.save_every"))]
    args = [env["PYTHON"], "-m", "pipeflow.launch", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "join", "--rdzv-conf",
            "join_timeout=60,last_call_timeout=1", str(ROOT / "train.py"), *long, "parallel.pp=2", "parallel.dp=auto",
            "train.max_steps=100000", "train.save_every=0", "train.resume=auto", f"train.run_dir={run_dir}"]
    lines: list[str] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
        return proc

    def when(pattern: str, after: int = 0) -> int:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for i in range(after, len(lines)):
                if re.search(pattern, lines[i]):
                    return i
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in 90 s:\n" + "".join(lines)[-4000:])

    first = start()
    second = None
    try:
        when(r"step\s+3/100000 \| loss")
        second = start()
        stopped = when(r"stopped at step \d+ by torchrun's agent")
        resumed = when(r"resumed from checkpoint \S+ at step \d+ \(saved with dp=1, pp=2", stopped)
        when(r"step\s+\d+/100000 \| loss", resumed)
        first.send_signal(signal.SIGTERM)  # the scheduler's signal, on both nodes
        second.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
        second.wait(timeout=60)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
    text = "".join(lines)
    saved = re.search(r"stopped at step (\d+) by torchrun's agent, .*: saved \S+step_(\d+)", text)
    assert saved and saved.group(1) == str(int(saved.group(2))), text[-4000:]
    assert re.search(rf"resumed from checkpoint \S+step_{int(saved.group(1)):08d} at step {saved.group(1)}", text)
    assert "mesh: dp=2 x pp=2" in text, text[-4000:]
    assert first.returncode == second.returncode == 75, text[-4000:]
    assert text.count("[pipeflow.launch] preempted at step") == 2 and text.count("preempted at step") == 3, text[-4000:]



def test_a_stop_that_reached_rank_0_only_through_the_step_is_the_agents_when_every_signal_was() -> None:
    """Issue 61's grow drill: host 1's agent stopped its worker (a node joined) before host 0's
    agent stopped rank 0; rank 0 learnt of the stop from the step's all-reduce alone and called it
    a preemption. The packet's slot now sums 1 per rank its own agent stopped and 2^20 per rank
    signalled from outside: every rank judges alike."""
    import types

    from pipeflow.run.readback import StepValues
    from pipeflow.run.step_update import EXTERNAL_SIGNAL
    from pipeflow.run.trainer import Trainer

    rank0 = types.SimpleNamespace(loop=types.SimpleNamespace(metrics=types.SimpleNamespace(end_step=lambda *a: None)),
                                  history=[], _from_agent=False)
    pending = types.SimpleNamespace(step=7, lr=0.1, timing=None)
    slot = 1.0  # host 1's worker, stopped by its agent; rank 0 not signalled yet
    values = StepValues(1.0, 1.0, preempt=slot > 0, external=slot >= EXTERNAL_SIGNAL)
    assert Trainer._record(rank0, pending, values) and rank0._from_agent  # no preemption: the launcher goes on
    slot = 1.0 + EXTERNAL_SIGNAL  # and a scheduler's SIGTERM on another rank: a preemption after all
    values = StepValues(1.0, 1.0, preempt=slot > 0, external=slot >= EXTERNAL_SIGNAL)
    assert Trainer._record(rank0, pending, values) and not rank0._from_agent
