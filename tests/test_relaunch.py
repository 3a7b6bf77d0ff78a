"""Restarts that work: examples/relaunch.sh around torchrun (gloo) survives a worker killed
mid-run, resumes by itself (train.resume=auto, no run directory named) and ends exactly where an
uninterrupted run ends: the same losses after the resume (steps 2-5, logged 0-based), the same final weights bit for bit."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from pipeflow.run.checkpoint import export, find_latest

ROOT = Path(__file__).resolve().parents[1]
RUN = ["model=mlp", "data=gaussian", "train.max_steps=6", "train.save_every=2", "train.log_every=1", "train.eval_every=0",
       "train.eval_batches=1", "pipeline.profile=false", "comm.timeout_s=10", "comm.first_step_timeout_s=60",
       "metrics.tensorboard=false"]
STEP = re.compile(r"step\s+(\d+)/6 \| loss ([\d.]+)")


def _launch(cwd: Path, fault: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "PIPEFLOW_RELAUNCH_DELAY_S": "0.5"}
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
