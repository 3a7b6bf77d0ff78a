"""Two torchrun agents on this machine act as two nodes (2 processes each, c10d rendezvous on
loopback) and train dp=2 x pp=2 with checkpoints; one node then resumes the run with dp=1."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from test_cli import SMALL, torchrun
from mp_harness import _free_port
from warm_exec import interpreters

ROOT = Path(__file__).resolve().parents[1]


def test_two_nodes_train_and_a_single_node_resumes_with_another_dp(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NNODES": "2", "NPROC": "2", "PYTHON": sys.executable, **interpreters(),
           "ENDPOINT": f"127.0.0.1:{_free_port()}", "RUN_ID": f"test{os.getpid()}"}
    overrides = [*SMALL, "parallel.dp=2", "pipeline.num_microbatches=2", "train.max_steps=40", "train.eval_every=0",
                 "train.save_every=20", "pipeline.checkpoint_activations=true", f"train.run_dir={tmp_path}"]
    nodes = [subprocess.Popen([str(ROOT / "examples" / "multinode.sh"), *overrides], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n=====\n".join(out[-3000:] for out in outs)
    text = "\n".join(outs)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) \|", text).groups())
    assert last < first - 0.3, text[-3000:]
    assert (tmp_path / "checkpoints" / "step_00000040" / "meta.json").is_file()

    run = torchrun(2, *SMALL, "pipeline.num_microbatches=2", "train.max_steps=45", "train.eval_every=0",
                   "train.resume=auto", f"train.run_dir={tmp_path}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "at step 40 (saved with dp=2, pp=2, tp=1, shard=none (4 processes))" in run.stdout, run.stdout[-3000:]
    resumed_first = float(re.search(r"loss ([\d.]+) -> ([\d.]+) \|", run.stdout).group(1))
    assert resumed_first < first - 0.3  # it continued from the trained weights
