"""Two emulated hosts, each with a disk of its own mounted at the run directory
(``EmulatedHosts(2, private=(run_dir,))``): with ``train.checkpoint_storage=shared`` (the default)
every rank stops at start naming what each host sees; with ``local`` dp 2 x pp 2 trains and saves,
each host's disk holds its own part, and ``python -m pipeflow.checkpoint gather`` merges the
parts into a checkpoint that exports and resumes in one process; a host lost while the parts
are saved in the background leaves each host's latest complete on every host."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import warm
from hosts import SMALL64, emulated_hosts, launch_on_hosts, outputs  # noqa: F401 - a fixture

from pipeflow.checkpoint.saving import main

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_hosts_with_their_own_disks_stop_every_rank_at_start_with_shared_storage(emulated_hosts, tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with emulated_hosts(2, private=(str(run_dir),)) as hosts:
        texts = outputs(launch_on_hosts(hosts, [*SMALL64, "parallel.dp=2", "parallel.pp=2", "train.max_steps=4",
                                                "pipeline.num_microbatches=2", f"train.run_dir={run_dir}"]))
        codes = [p.returncode for p in hosts._procs]
    said = [line for text in texts for line in text.splitlines() if "failed: RunDirNotSharedError" in line]
    ranks = {int(re.search(r"rank (\d+) failed", line).group(1)) for line in said}
    # every rank raises it; under load a host's agent may stop its other rank (SIGTERM, on the
    # first failure) before that one prints: each host says it at least once
    assert ranks & {0, 1} and ranks & {2, 3}, "\n=====\n".join(t[-3000:] for t in texts)
    for line in said:
        assert f"the hosts do not see one run directory {run_dir}" in line, line
        assert "host host0 (global ranks 0-1) sees the files of host0 (its own)" in line, line
        assert "host host1 (global ranks 2-3) sees the files of host1 (its own)" in line, line
        assert "train.checkpoint_storage=local" in line, line
    assert all(code != 0 for code in codes), codes


def test_local_storage_keeps_each_hosts_part_and_gather_merges_them(emulated_hosts, tmp_path) -> None:
    run_dir, parts = tmp_path / "run", tmp_path / "parts"
    run_dir.mkdir()
    with emulated_hosts(2, private=(str(run_dir),)) as hosts:
        texts = outputs(launch_on_hosts(hosts, [*SMALL64, "parallel.dp=2", "parallel.pp=2", "train.max_steps=20",
                                                "train.save_every=10", "train.checkpoint_storage=local",
                                                # each host's part written in the background (issue 60); the
                                                # synchronous local save: tests/test_storage.py
                                                "train.checkpoint_mode=async",
                                                "pipeline.num_microbatches=2", f"train.run_dir={run_dir}"]))
        codes = [p.returncode for p in hosts._procs]
        for i in range(2):
            shutil.copytree(hosts.disk(i, str(run_dir)), parts / f"host{i}")
    assert codes == [0, 0], "\n=====\n".join(t[-3000:] for t in texts)
    for i, shards in enumerate((["__0_0.distcp", "__1_0.distcp"], ["__2_0.distcp", "__3_0.distcp"])):
        root = parts / f"host{i}" / "checkpoints"
        assert (root / "latest").read_text() == "step_00000020"
        assert sorted(os.listdir(root / "step_00000020")) == [".metadata", *shards, "meta.json", "rng"]
        assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
    merged = tmp_path / "merged"
    merged.mkdir()
    shutil.copy(parts / "host0" / "config.yaml", merged / "config.yaml")  # export learns the model from it
    out = merged / "checkpoints" / "step_00000020"
    steps = [str(parts / f"host{i}" / "checkpoints" / "step_00000020") for i in range(2)]
    assert main(["gather", *steps, str(out)]) == 0
    assert main(["export", str(out), str(tmp_path / "w.pt")]) == 0
    # host0's ranks held a whole replica (dp 2 x pp 2: ranks 0-1 are stages 0-1 of replica 0): its part alone
    # exports the model, which the merged checkpoint must hold too
    assert main(["export", str(parts / "host0" / "checkpoints" / "step_00000020"), str(tmp_path / "w0.pt")]) == 0
    merged_weights, replica = torch.load(tmp_path / "w.pt"), torch.load(tmp_path / "w0.pt")
    assert sorted(merged_weights) == sorted(replica)
    assert all(torch.equal(merged_weights[k], v) for k, v in replica.items())
    resumed = warm.run_python(["train.py", *SMALL64, "train.max_steps=21", f"train.resume={out}",
                               f"train.run_dir={tmp_path / 'one'}", f"hydra.run.dir={tmp_path / 'one'}"], env=ENV, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint {out} at step 20" in resumed.stdout + resumed.stderr


def test_a_host_lost_during_background_saves_leaves_each_hosts_latest_complete(emulated_hosts, tmp_path) -> None:
    """Issue 60: local storage, saves in the background every 5 steps; host 1 is killed after a
    save: host 0's ranks stop with a named error, and each host's latest names a step whose part
    every host holds complete (gather merges them), however far the save in flight had got."""
    from hosts import first_line_at, watch_lines

    run_dir, parts = tmp_path / "run", tmp_path / "parts"
    run_dir.mkdir()
    with emulated_hosts(2, private=(str(run_dir),)) as hosts:
        procs = launch_on_hosts(hosts, [*SMALL64, "parallel.dp=2", "parallel.pp=2", "train.max_steps=100000",
                                        "train.save_every=5", "train.checkpoint_storage=local",
                                        "train.checkpoint_mode=async", "pipeline.num_microbatches=2",
                                        "train.log_every=5", "comm.timeout_s=5", f"train.run_dir={run_dir}"])
        lines, threads = watch_lines(procs)
        first_line_at(lines[0], r"saved checkpoint of step 10:", 120)
        hosts.kill(1)
        procs[0].wait(timeout=60)
        for i in range(2):
            shutil.copytree(hosts.disk(i, str(run_dir)), parts / f"host{i}")
    for thread in threads:
        thread.join(timeout=10)
    text = "".join(line for _, line in lines[0])
    assert procs[0].returncode == 1 and re.search(r"(CommError|PipelineTimeoutError|CheckpointPeerLostError)", text), \
        text[-3000:]
    latest = [(parts / f"host{i}" / "checkpoints" / "latest").read_text() for i in range(2)]
    assert all(int(name.split("_")[1]) >= 10 for name in latest), latest
    for name in set(latest):  # every host's part of each host's latest: complete, merged into the whole
        steps = [str(parts / f"host{i}" / "checkpoints" / name) for i in range(2)]
        assert main(["gather", *steps, str(tmp_path / "merged" / name)]) == 0, name
