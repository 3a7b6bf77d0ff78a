"""Checkpoints are atomic: a process killed in the middle of a save leaves the last good one
loadable, and the next run (in this process, on a one-rank group) resumes from it
(``train.resume=auto``) and cleans up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import scale_cases
import warm
from pipeflow.run.builder import build_run
from pipeflow.checkpoint.saving import find_latest, resolve

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import os, socket, sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
    import scale_cases
    import pipeflow.checkpoint.saving as ck
    from pipeflow.run.builder import build_run
    cfg = scale_cases.make_config(1, "1f1b", 2, train__param_dtype="float32", train__max_steps={steps},
                                  train__save_every=2, train__run_dir={run_dir!r}, train__resume="auto")
    trainer = build_run(cfg, torch.device("cpu"))
    trainer.fit()
    print("RESUMED_AT", {steps} - len(trainer.history), flush=True)
    if {crash}:
        rename = os.rename
        def stuck(src, dst):  # the save hangs after its data and meta.json, before the rename
            if os.path.basename(str(src)).startswith("step_00000004.") and str(src).endswith(".tmp"):
                print("SAVING", flush=True)
                time.sleep(120)
            rename(src, dst)
        ck.os.rename = stuck
        trainer.save_checkpoint(4)
    dist.destroy_process_group()
""")


def _child(run_dir: Path, steps: int, crash: bool) -> subprocess.Popen:
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), steps=steps, run_dir=str(run_dir), crash=crash)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path, one_rank_group) -> None:
    run_dir = tmp_path / "run"
    child = _child(run_dir, steps=2, crash=True)
    lines = []
    for line in child.stdout:  # wait until the second save is under way, then kill -9
        lines.append(line)
        if line.startswith("SAVING"):
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    root = run_dir / "checkpoints"
    interrupted = list(root.glob("step_00000004.*.tmp"))  # step_<n>.<job token>.tmp
    assert len(interrupted) == 1 and (interrupted[0] / "meta.json").is_file()  # the interrupted save, all but renamed
    assert find_latest(str(root)) == str(root / "step_00000002")
    assert resolve("auto", str(root)) == str(root / "step_00000002")
    cli = warm.run_python(["-m", "pipeflow.checkpoint", "export", str(root), str(tmp_path / "model.pt")], cwd=ROOT,
                          timeout=120)
    assert cli.returncode == 0, cli.stderr[-3000:]
    state = torch.load(tmp_path / "model.pt")
    assert f"wrote {len(state)} tensors" in cli.stdout and all(torch.isfinite(v).all() for v in state.values())
    assert all(key.split(".")[0].isdigit() for key in state)  # <layer index>.<key>: the unsplit model's names

    cfg = scale_cases.make_config(1, "1f1b", 2, train__param_dtype="float32", train__max_steps=4, train__save_every=2,
                                  train__run_dir=str(run_dir), train__resume="auto")  # the killed job's config, 4 steps
    resumed = build_run(cfg, torch.device("cpu"))
    resumed.fit()
    assert 4 - len(resumed.history) == 2  # train.resume=auto picked step 2
    assert find_latest(str(root)) == str(root / "step_00000004")
    assert not list(root.glob("*.tmp"))  # the dead job's leftover, removed when its stale lock was taken over


RANK_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    import torch, torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import scale_cases
    from pipeflow.checkpoint import integrity
    from pipeflow.run.builder import build_run
    cfg = scale_cases.make_config(1, "1f1b", 2, train__param_dtype="float32", train__max_steps=40,
                                  train__save_every=2, train__run_dir={run_dir!r}, train__checkpoint_mode="async",
                                  comm__timeout_s=10)
    share = integrity.digest_share
    def stuck(folder, *args):  # rank 1's background save of step 4 stops while hashing its files
        if rank == 1 and "step_00000004." in folder:
            print("SAVING", flush=True)
            time.sleep(120)
        return share(folder, *args)
    integrity.digest_share = stuck
    build_run(cfg, torch.device("cpu")).fit()
""")


def test_a_rank_killed_during_a_background_write_leaves_latest_complete(tmp_path: Path, one_rank_group) -> None:
    """Issue 60: rank 1 is killed (-9) while its background save of step 4 runs, training going on
    meanwhile: rank 0 stops with a named error, latest still names step 2, complete, and the run
    resumes from it (here under another layout: one rank)."""
    import socket

    run_dir = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = RANK_CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), port=port, run_dir=str(run_dir))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in (0, 1)]
    lines = []
    for line in ranks[1].stdout:
        lines.append(line)
        if line.startswith("SAVING"):
            ranks[1].send_signal(signal.SIGKILL)
            break
    ranks[1].wait(timeout=60)
    survivor = ranks[0].communicate(timeout=120)[0]
    assert ranks[1].returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    assert ranks[0].returncode not in (0, None), survivor[-3000:]
    # a named error, not a hang: the training's P2P or the save's agreement meets the dead peer first
    assert "pipeflow.errors.CommError" in survivor or "CheckpointPeerLostError" in survivor, survivor[-3000:]
    root = run_dir / "checkpoints"
    assert find_latest(str(root)) == str(root / "step_00000002"), sorted(p.name for p in root.iterdir())
    assert resolve("auto", str(root)) == str(root / "step_00000002")
    cfg = scale_cases.make_config(1, "1f1b", 1, train__param_dtype="float32", train__max_steps=4, train__save_every=2,
                                  train__run_dir=str(run_dir), train__resume="auto", parallel__pp=1)
    resumed = build_run(cfg, torch.device("cpu"))
    resumed.fit()
    assert 4 - len(resumed.history) == 2  # train.resume=auto picked step 2
    assert find_latest(str(root)) == str(root / "step_00000004")
