"""Across emulated hosts (tests/hosts.py: network namespaces with their own addresses, names and
links), each host launched as the README says (examples/multinode.sh): dp x pp, pp 4 and pp x tp
train with the losses and weights of one process; the launcher finds each node's address where
host names do not resolve or resolve to loopback; a lost or cut-off host is named by the
survivors; a lost host is survived by an elastic job that resumes on the smaller world."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm

from hosts import (SMALL64, SMALL64_HELD, emulated_hosts, first_line_at, launch_on_hosts,  # noqa: F401 - a fixture
                   outputs, step_losses, rdzv_conf, tails, watch_lines, what_hosts_said)
from warm_exec import interpreters
from pipeflow.checkpoint.saving import export, find_latest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
HOLD_STEP = 16  # a 2-rank job waits in this step's forward until the third host's agent has joined


def _weights(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    export(find_latest(str(run_dir / "checkpoints")), str(out))
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The same training in one process (one stage): its per-step losses and final weights."""
    run_dir = tmp_path_factory.mktemp("one_process")
    done = warm.run_python(["train.py", *SMALL64, f"train.max_steps={STEPS}", f"train.save_every={STEPS}",
                            "pipeline.num_microbatches=2", f"train.run_dir={run_dir}", f"hydra.run.dir={run_dir}"],
                           timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return step_losses(done.stdout + done.stderr), _weights(run_dir, run_dir / "w.pt")


# the start-of-run report: the mesh order, and with profiled layers every link of the program measured
REPORTED = {
    "missing": [r"mesh order \[pp,dp,tp\]: pipeline ranks \[0, 2\] \[1, 3\]",
                r"links measured in [\d.]+ s .*: pipeline ranks 0-1 \(global ranks [01] and [23]\) crosses hosts host0 -> "
                r"host1: [\d.]+ ms \+ [\d.]+ MB/s",
                r"dp all-reduce per group: ranks \[0, 1\] within host host0: [\d.]+ ms; ranks \[2, 3\] within host host1"],
    "loopback": [r"mesh order \[dp,pp,tp\]: pipeline ranks \[0, 1, 2, 3\] \(parallel.order=auto: one dimension above 1",
                 r"pipeline ranks 0-1 within host host0: .*; pipeline ranks 1-2 crosses hosts host0 -> host1: .*; "
                 r"pipeline ranks 2-3 within host host1",
                 r"transfer waits per link, ms per step .*: 0-1 [\d.]+; 1-2 [\d.]+ \(crosses hosts host0 -> host1\); 2-3 "],
    # auto measured the links within and across the hosts, and either order trains as one process
    "resolve": [r"mesh order \[\w+,\w+,\w+\]: pipeline ranks .* \(parallel.order=auto chose \[\w+,\w+,\w+\]: predicted "
                r"step \[dp,pp,tp\] [\d.]+ ms .*; the orders weighed on (links timed before the mesh, in [\d.]+ s|the "
                r"pipeline's links as measured pair by pair): within a host [\d.]+ ms \+ .*, across hosts [\d.]+ ms \+ .*\)",
                # each tp group's all-reduce measured beside the pipeline's links
                r"tp all-reduce per group, measured in [\d.]+ s: ranks \[\d, \d\] (within host host\d|across hosts "
                r"host0 host1): [\d.]+ ms \+ ([\d.]+ MB/s|no per-byte cost); ranks \[\d, \d\] "],
}


@pytest.mark.parametrize(("names", "layout"), [
    # host names resolve nowhere; pp outermost: each pipeline's boundary crosses the hosts
    ("missing", ["parallel.dp=2", "parallel.pp=2", "parallel.order=[pp,dp,tp]", "pipeline.profile=true"]),
    ("loopback", ["parallel.pp=4", "pipeline.profile=true"]),  # each host's own name resolves to 127.0.0.1
    ("resolve", ["parallel.pp=2", "parallel.tp=2", "pipeline.profile=true"]),
])
def test_a_layout_across_two_hosts_trains_as_one_process(emulated_hosts, one_process, tmp_path, names, layout) -> None:
    losses, weights = one_process
    run_dir = tmp_path / "run"
    with emulated_hosts(2, names=names) as hosts:
        texts = outputs(launch_on_hosts(hosts, [*SMALL64, *layout, f"train.max_steps={STEPS}", "pipeline.num_microbatches=2",
                                                f"train.save_every={STEPS}", f"train.run_dir={run_dir}"]))
        codes = [p.returncode for p in hosts._procs]
    assert codes == [0, 0], "\n=====\n".join(t[-3000:] for t in texts)
    for pattern in REPORTED[names]:
        assert re.search(pattern, texts[0]), (pattern, texts[0][:6000])
    chosen = re.search(r"predicted step .*?([\d.]+) ms \(the pipeline's prediction\)", texts[0])
    if names == "resolve":  # issue 62: one step for one layout in the order line and the pipeline line
        assert chosen and f"predicted step {chosen.group(1)} ms (" in texts[0], texts[0][:6000]
    assert step_losses(texts[0]) == losses  # printed to 4 places; the weights below to 1e-9
    got = _weights(run_dir, tmp_path / "w.pt")
    assert sorted(got) == sorted(weights)
    for name, value in weights.items():
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_plain_torchrun_whose_gloo_would_bind_loopback_across_hosts_stops_every_rank_at_start(
        emulated_hosts, tmp_path) -> None:
    """Without the launcher's interface (torchrun given --local-addr only), on hosts whose own
    names resolve to 127.0.0.1: gloo would bind loopback; every rank stops at the join, naming
    the host and the fix, before any process group exists.  Its workers are real interpreters
    (the other launches' are warm forks joined to the host): one test keeps a fresh worker's
    start on a host, with its own imports, name and /etc/hosts, checked."""
    with emulated_hosts(2, names="loopback") as hosts:
        procs = [hosts.run(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", hosts.endpoint(), "--rdzv-id", "bind",
                               "--local-addr", hosts.addresses[i], "--rdzv-conf", f"is_host={int(i == 0)}", "train.py",
                               *SMALL64, "parallel.dp=2", "parallel.pp=2", f"train.run_dir={tmp_path}"],
                           {"OMP_NUM_THREADS": "1"}, timeout_s=90) for i in range(2)]
        texts = outputs(procs)
    said = re.findall(r"rank (\d) failed: LaunchError: rank \d: (the job spans 2 hosts \(host0, host1\), but the ranks "
                      r"on host host\d \(global ranks \d-\d\) would talk over loopback: its host name 'host\d' "
                      r"resolves to 127\.0\.0\.1)", "".join(texts))
    assert sorted(int(rank) for rank, _ in said) == [0, 1, 2, 3], texts
    assert [p.returncode for p in procs] == [1, 1]


def test_a_host_cut_off_is_named_by_the_survivors_within_the_collective_deadline(emulated_hosts, tmp_path) -> None:
    """No reset reaches the survivors: they wait out the deadline (comm.timeout_s, plus the
    collectives' margin for a step-end collective), then name the host that stopped answering."""
    overrides = [*SMALL64, "parallel.pp=4", "pipeline.num_microbatches=4", "train.max_steps=100000",
                 "train.log_every=10", "comm.timeout_s=3", f"train.run_dir={tmp_path}"]
    with emulated_hosts(2) as hosts:
        procs = launch_on_hosts(hosts, overrides)
        lines, threads = watch_lines(procs)
        first_line_at(lines[0], r"step\s+20/", 90)
        cut = time.monotonic()
        hosts.partition(1)
        named = first_line_at(lines[0], r"lost host host1 \(10\.213\.\d+\.2, global ranks 2-3\): no heartbeat", 60) - cut
        procs[0].wait(timeout=30)
        ended = time.monotonic() - cut
    for thread in threads:
        thread.join(timeout=10)
    text = "".join(line for _, line in lines[0])
    # mostly a P2P wait (PipelineTimeoutError, after comm.timeout_s: pp 4 puts a boundary across the cut);
    # a step-end collective (CommError) if the cut finds host0 there, after the collectives' margin too
    assert procs[0].returncode == 1 and re.search(r"(CommError|PipelineTimeoutError): ", text), text[-3000:]
    assert named < 3 + 15 + 5 and ended < 3 + 15 + 10, (named, ended)  # comm.timeout_s, the margin, the probe


def test_a_lost_host_is_survived_by_an_elastic_job_that_resumes_on_the_smaller_world(
        emulated_hosts, one_process, tmp_path) -> None:
    """--nnodes 1:2 --max-restarts 3 with parallel.pp=2 parallel.dp=auto, on torchrun's shared
    store: host 1 killed after step 25; host 0 names it, restarts, resumes from step 20 with dp 1
    and finishes with the losses of one uninterrupted process."""
    losses, _ = one_process
    overrides = [*SMALL64, "parallel.pp=2", "parallel.dp=auto", "pipeline.num_microbatches=2",
                 f"train.max_steps={STEPS}", "train.save_every=10", "train.resume=auto", f"train.run_dir={tmp_path}"]
    with emulated_hosts(2, names="missing") as hosts:
        # torchrun's shared agent store, as plain torchrun has it: the restart meets in a new epoch;
        # the documented command: the launcher's own --rdzv-conf defaults recover in seconds.  Host 1
        # first, host 0 (the endpoint) once host 1's agent waits for it: on the shared store a host
        # that came after a round of host 0 alone (min 1) could never join (the launcher's warning)
        common = {"nnodes": "1:2", "env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, "torchrun_args": "--max-restarts 3"}
        procs = launch_on_hosts(hosts, overrides, on=[1], **common)
        late, late_thread = watch_lines(procs)
        first_line_at(late[0], r"waiting for the rendezvous at", 120)
        procs = launch_on_hosts(hosts, overrides, on=[0], **common) + procs
        lines, threads = watch_lines(procs[:1])
        lines, threads = lines + late, threads + late_thread
        # host 1 killed at step 25 of the two hosts' mesh
        meshed = first_line_at(lines[0], r"mesh: dp=2 x pp=2", 120)
        first_line_at(lines[0], rf"step\s+25/{STEPS}", 90, after=meshed)
        hosts.kill(1)
        procs[0].wait(timeout=120)
    for thread in threads:
        thread.join(timeout=10)
    text = "".join(line for _, line in lines[0])
    assert procs[0].returncode == 0, text[-4000:]
    assert re.search(r"lost host host1 \(10\.213\.\d+\.2, global ranks 2-3\)", text), text[-4000:]
    assert re.search(r"resumed from checkpoint \S+step_00000020 at step 20 \(saved with dp=2, pp=2", text), text[-4000:]
    assert re.search(r"mesh: dp=2 x pp=2.*mesh: dp=1 x pp=2", text, re.S), text[-4000:]
    after = step_losses(text.rsplit("resumed from checkpoint", 1)[1])  # the survivors' resume
    assert sorted(after) == list(range(20, STEPS)) and all(after[s] == losses[s] for s in after), (after, losses)


def test_a_slurm_job_saves_on_the_time_limits_signal_and_requeues_itself(emulated_hosts, tmp_path) -> None:
    """examples/slurm.sbatch under stand-ins for srun and scontrol (tests/slurm/) that set the
    SLURM_* variables per host as Slurm does: SIGTERM to every process of the step (what
    --signal=TERM@120 sends) saves, the launchers and srun return 75, and the job is requeued."""
    import json
    import signal

    run_dir = tmp_path / "run"
    with emulated_hosts(2, names="resolve") as hosts:
        env = {**os.environ, "PATH": f"{ROOT / 'tests' / 'slurm'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
               "PIPEFLOW_TEST_HOSTS": json.dumps([[ns, name] for ns, name in zip(hosts.namespaces, hosts.hostnames)]),
               "PIPEFLOW_TEST_REQUEUED": str(tmp_path / "requeued"), "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NODELIST": "host[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(ROOT),
               "NPROC": "2", "PYTHON": sys.executable, **interpreters()}
        job = subprocess.Popen(["timeout", "-k", "5", "150", "bash", str(ROOT / "examples" / "slurm.sbatch"), *SMALL64,
                                "parallel.pp=2", "parallel.dp=auto", "pipeline.num_microbatches=2",
                                "train.max_steps=100000", "train.save_every=0", f"train.run_dir={run_dir}"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, threads = watch_lines([job])
        first_line_at(lines[0], r"step\s+10/100000", 90)
        for host in range(2):  # Slurm signals every process of the step, on every node
            for pid in hosts.pids(host):
                os.kill(pid, signal.SIGTERM)
        job.wait(timeout=90)
    for thread in threads:
        thread.join(timeout=10)
    text = "".join(line for _, line in lines[0])
    saved = re.search(r"preempted at step (\d+): saved \S+step_(\d+)", text)
    assert job.returncode == 75 and saved, text[-4000:]
    assert "[srun stand-in] task statuses [75, 75]" in text and "requeueing job 4242" in text, text[-3000:]
    assert (tmp_path / "requeued").read_text() == "4242\n"
    assert (run_dir / "checkpoints" / f"step_{int(saved.group(2)):08d}" / "meta.json").is_file()


def test_a_lost_host_is_survived_by_a_job_that_replans_its_pipeline(emulated_hosts, one_process, tmp_path) -> None:
    """Issue 61: 3 hosts x 1 rank, each its own disk (train.checkpoint_storage=local, each part
    also on the next host: train.checkpoint_replicas=2), parallel.replan=true parallel.pp=auto
    parallel.dp=auto: 3 ranks plan pp 3 (3 replicas cannot share a batch of 8 in 2 micro-batches);
    the job held in step 16 until the three hosts are planned for; host 2 killed after step 25; the
    survivors re-plan for 2 ranks, assemble step 20 from their own parts and host 2's copy, resume
    on the new layout and finish with the losses of one uninterrupted process."""
    losses, _ = one_process
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = [*SMALL64_HELD, "parallel.replan=true", "parallel.pp=auto", "parallel.dp=auto",
                 "pipeline.num_microbatches=2", f"train.max_steps={STEPS}", "train.save_every=10", "train.resume=auto",
                 f"train.run_dir={run_dir}", "train.checkpoint_storage=local", "train.checkpoint_replicas=2"]
    held = tmp_path / "held"
    held.touch()
    env = {"PIPEFLOW_LAUNCH_VERBOSE": "1",  # verbose: says why a round failed
           "PIPEFLOW_FAULT_INJECT": f"hold:rank=0:step={HOLD_STEP}", "PIPEFLOW_FAULT_HOLD": str(held)}
    with emulated_hosts(3, names="missing", private=(str(run_dir),)) as hosts:
        procs = launch_on_hosts(hosts, overrides, nproc=1, nnodes="2:3", env=env, torchrun_args="--max-restarts 3")
        lines, threads = watch_lines(procs)
        try:
            # Under load a round of the minimum, 2 hosts, may form before the third joins, and
            # (in CI) trained all 40 steps first: held in step 16 until the third host is planned
            # for, or waits to join and the agents stop the two hosts' workers.
            try:
                first_line_at(lines[0], r"re-planned for 3 ranks|1 node waits to join the job", 180)
                if not any("re-planned for 3 ranks" in line for _, line in lines[0]):
                    first_line_at(lines[0], r"closing signal SIGTERM", 120)
            finally:
                held.unlink()
            planned = first_line_at(lines[0], r"re-planned for 3 ranks", 150)
            first_line_at(lines[0], rf"step\s+25/{STEPS}", 120, after=planned)  # host 2 killed after step 25
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nwhat the hosts said:\n{what_hosts_said(lines)}") from None
        hosts.kill(2)
        procs[0].wait(timeout=120)
        procs[1].wait(timeout=30)
        kept = hosts.disk(0, str(run_dir)) / "checkpoints" / "replicas" / "host2"
        copies = sorted(os.listdir(kept)) if kept.is_dir() else []
    for thread in threads:
        thread.join(timeout=10)
    text = "".join(line for _, line in lines[0])
    everything = text[-4000:] + tails(lines[1:])
    assert procs[0].returncode == 0, everything
    assert "step_00000020" in copies, f"host 0 keeps {copies} of host 2's parts\n{everything}"  # step 20's, on host 0
    assert re.search(r"re-planned for 3 ranks \(3 hosts x 1 rank\): dp 1 x pp 3 x tp 1(?: \(was [^)]*\))?, predicted "
                     r"step", text), text[-4000:]
    assert re.search(r"re-planned for 2 ranks \(2 hosts x 1 rank\): dp \d x pp \d x tp 1 \(was dp 1 x pp 3 x tp 1 on "
                     r"3 ranks: the job lost 1 rank\)", text), text[-4000:]
    assert re.search(r"assembled step_00000020 from the parts the hosts hold \(host0's from rank 0, host1's from "
                     r"rank 1, host2's from rank 0\)", text), text[-4000:]
    assert re.search(r"resumed from checkpoint \S+assembled/step_00000020 at step 20 \(saved with dp=1, pp=3", text), \
        text[-4000:]
    after = step_losses(text.rsplit("resumed from checkpoint", 1)[1])  # the survivors' resume
    assert sorted(after) == list(range(20, STEPS)) and all(after[s] == losses[s] for s in after), (after, losses)


GROW_STEPS = 60


def test_a_host_that_joins_grows_a_replanning_job(emulated_hosts, tmp_path) -> None:
    """Issue 61: 2 of 3 hosts start the elastic job (--nnodes 2:3, 1 rank each) and plan for 2
    ranks; the third joins while the job is held in step 16 (the `hold` fault: the job cannot end
    first, however long the new agent takes to start under load, and no link is slowed, which
    would delay the agents' heartbeats into a "dead node"); once the launchers say it waits to
    join, the hold is lifted: the agents stop the workers, which save at the next step boundary
    (no step retrained), and the 3 ranks re-plan pp 3 and finish with the losses of one
    uninterrupted process."""
    STEPS = GROW_STEPS  # noqa: N806 - the module's name, this test's count
    reference = tmp_path / "one"
    done = warm.run_python(["train.py", *SMALL64, f"train.max_steps={STEPS}", "pipeline.num_microbatches=2",
                            f"train.run_dir={reference}", f"hydra.run.dir={reference}"], timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    losses = step_losses(done.stdout + done.stderr)
    overrides = [*SMALL64_HELD, "parallel.replan=true", "parallel.pp=auto", "parallel.dp=auto",
                 "pipeline.num_microbatches=2", f"train.max_steps={STEPS}", "train.save_every=10", "train.resume=auto",
                 f"train.run_dir={tmp_path / 'run'}"]
    # the workers get 120 s (not torch's 30) to save once the agents stop them; the re-formed round
    # waits up to 60 s for all three agents: in CI (a load of 37) host 0's agent lost every
    # compare-and-set to the other two for 30 s, they closed the round without it, and the job
    # finished on hosts 1 and 2
    common = {"nproc": 1, "nnodes": "2:3", "env": {"PIPEFLOW_LAUNCH_VERBOSE": "1"},
              "torchrun_args": "--max-restarts 3 --shutdown-timeout 120",
              "rdzv_conf": rdzv_conf(last_call_timeout=60)}
    held = tmp_path / "held"
    held.touch()
    hold = {"PIPEFLOW_FAULT_INJECT": f"hold:rank=0:step={HOLD_STEP}", "PIPEFLOW_FAULT_HOLD": str(held)}
    with emulated_hosts(3, names="missing") as hosts:
        procs = launch_on_hosts(hosts, overrides, on=[0, 1], **{**common, "env": {**common["env"], **hold}})
        lines, threads = watch_lines(procs)
        first_line_at(lines[0], rf"hold at training step {HOLD_STEP}", 120)
        procs += launch_on_hosts(hosts, overrides, on=[2], **common)
        joined, joiner = watch_lines(procs[2:])
        try:
            first_line_at(lines[0], r"1 node waits to join the job", 180)
            # released once the agent has signalled the workers, so they stop at the next step
            # boundary: released sooner, a loaded machine could let them finish the run first
            first_line_at(lines[0], r"closing signal SIGTERM", 120)
        finally:
            held.unlink()
        try:
            first_line_at(lines[0], r"re-planned for 3 ranks", 120)
        except AssertionError as exc:  # what the other hosts said
            raise AssertionError(f"{exc}{tails([*lines[1:], *joined])}") from None
        for proc in procs:
            proc.wait(timeout=150)
    for thread in threads + joiner:
        thread.join(timeout=10)
    text = "".join(line for _, line in lines[0])
    assert [p.returncode for p in procs] == [0, 0, 0], text[-4000:] + "\nthe joining host:\n" + "".join(
        line for _, line in joined[0])[-3000:]
    assert re.search(r"re-planned for 2 ranks \(2 hosts x 1 rank\): dp \d x pp \d x tp 1, predicted step", text), \
        text[-4000:]
    assert "[pipeflow.launch] 1 node waits to join the job: torchrun's agent stops the workers" in text, text[-4000:]
    stopped = re.search(r"stopped at step (\d+) by torchrun's agent", text)
    assert stopped, what_hosts_said([lines[0], *lines[1:], *joined])
    assert re.search(r"re-planned for 3 ranks \(3 hosts x 1 rank\): dp 1 x pp 3 x tp 1 \(was dp \d x pp \d x tp 1 on 2 "
                     r"ranks: the job gained 1 rank\)", text), text[-4000:]
    step = int(stopped.group(1))
    # the resume that follows the stop (under a loaded suite the two hosts' job may have restarted
    # once before, resuming from an earlier save: once from step 10 in CI)
    resumed = int(re.search(r"resumed from checkpoint \S+ at step (\d+) ", text[stopped.end():]).group(1))
    assert resumed == step == HOLD_STEP + 1, (step, resumed, text[-4000:])  # the save at the stop: no step retrained
    after = step_losses(text[stopped.end():].split("resumed from checkpoint", 1)[1])
    assert sorted(after) == list(range(step, STEPS)) and all(after[s] == losses[s] for s in after), (after, losses)
