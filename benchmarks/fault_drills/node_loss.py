"""Drill: lose a host at a random step, N times, and check the elastic job survives every time.

Two emulated hosts (examples/emulated_hosts.py; root) x 2 ranks each run one elastic job:

    NNODES=1:2 TORCHRUN_ARGS="--max-restarts 3" examples/multinode.sh \
        parallel.pp=2 parallel.dp=auto train.resume=auto train.save_every=10 ...

and host 1 is killed (every process of its namespace) once the job has logged a step drawn at
random.  Each trial prints whether the job finished (status 0), the seconds from the kill to the
first step of the restarted job, the steps lost (the step killed at minus the step resumed
from) and whether every step's loss from the resumed step on equals that of an uninterrupted
run in one process (float64, as printed).  Exit status 1 when any trial fails.

    python benchmarks/fault_drills/node_loss.py --trials 10

``--lose rendezvous-host`` kills host 0 instead (it hosts the rendezvous and rank 0, which holds
the run directory's lock): the job ends on host 1, and the drill starts it again there at once,
as the launcher's message says (the same command, ENDPOINT on host 1); each
trial says whether that first try started (the dead job's lock taken over, not refused) and the
seconds from the kill to its first resumed step.

    python benchmarks/fault_drills/node_loss.py --trials 5 --lose rendezvous-host

``--replan`` runs a job that re-plans its layout (``parallel.replan=true parallel.pp=auto
parallel.tp=auto parallel.dp=auto``, issue 61) within a memory limit one rank cannot meet, on 3
hosts x 1 rank (``--nproc 2``: 2 hosts x 2 ranks): the last host is killed at a random step (those
left re-plan smaller), started again once the job has trained a few steps without it (all
re-plan larger after the workers saved); each trial checks the layout changed both times, every
logged loss is within 1e-6 of the uninterrupted run's, no step was retrained after the join, and
times the kill to the first resumed step.  ``--storage local``: each host its own disk, each part
of a checkpoint also kept on the next host (``train.checkpoint_replicas=2``), the restarts
assembling a checkpoint from what the hosts hold.  It ends with ``survived K of N``.

    python benchmarks/fault_drills/node_loss.py --replan --trials 10 --steps 200
    python benchmarks/fault_drills/node_loss.py --replan --trials 10 --steps 200 --storage local
    python benchmarks/fault_drills/node_loss.py --replan --trials 10 --steps 200 --nproc 2
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from hosts import SMALL64, launch_on_hosts, step_losses  # noqa: E402
from examples.emulated_hosts import EmulatedHosts, unavailable  # noqa: E402

# the documented command's: pipeflow.launch's recovery defaults (launch.RDZV_DEFAULTS); pass
# --rdzv-conf to try others (a lost node's restart re-rendezvouses within last_call_timeout once
# the survivors are there)
RDZV_CONF = ""


def overrides(run_dir: str, steps: int, save_every: int) -> list[str]:
    """The drill's job: a tiny float64 GPT, pp 2 x dp auto, saving every `save_every` steps."""
    return [*SMALL64, f"train.max_steps={steps}", f"train.save_every={save_every}", "train.resume=auto",
            f"train.run_dir={run_dir}", "parallel.pp=2", "parallel.dp=auto", "pipeline.num_microbatches=2"]


def reference(steps: int, workdir: str) -> dict[int, float]:
    """Per-step losses of the same job uninterrupted, in one process."""
    run_dir = os.path.join(workdir, "reference")
    done = subprocess.run([sys.executable, "train.py", *overrides(run_dir, steps, 0)[:-3], "pipeline.num_microbatches=2",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{done.stderr[-3000:]}")
    return step_losses(done.stdout + done.stderr)


def trial(kill_step: int, steps: int, save_every: int, workdir: str, timeout_s: float, shared_store: bool,
          rdzv_conf: str = RDZV_CONF) -> dict:
    """One job, host 1 killed once step `kill_step` is logged; what happened."""
    run_dir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    lines: list[tuple[float, str]] = []
    with EmulatedHosts(2, names="missing") as hosts:
        procs = launch_on_hosts(hosts, overrides(run_dir, steps, save_every), nnodes="1:2",
                                torchrun_args="--max-restarts 3" + (f" --rdzv-conf {rdzv_conf}" if rdzv_conf else ""),
                                timeout_s=timeout_s, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if shared_store else "1"},
                                warm_workers=False, rdzv_conf=None)  # real interpreters: a restart's imports count
        pump = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in procs[0].stdout))
        pump.start()
        killed_at = None
        pattern = re.compile(rf"step\s+{kill_step}/{steps} \|")
        while procs[0].poll() is None:
            if killed_at is None and any(pattern.search(line) for _, line in list(lines)):
                hosts.kill(1)
                killed_at = time.monotonic()
            time.sleep(0.02)
        pump.join()
        status = procs[0].returncode
    text = "".join(line for _, line in lines)
    resumed = re.search(r"resumed from checkpoint \S+ at step (\d+)", text)
    after = text.split("resumed from checkpoint", 1)[1] if resumed else ""
    after_resume = False
    first_after = None
    for t, line in lines:  # the first step logged after the resume
        after_resume = after_resume or (resumed is not None and "resumed from checkpoint" in line)
        if after_resume and re.search(r"step\s+\d+/\d+ \| loss", line):
            first_after = t
            break
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"status": status, "killed": killed_at is not None, "resumed_at": int(resumed.group(1)) if resumed else None,
            "recovery_s": (first_after - killed_at) if (first_after and killed_at) else None,
            "losses": step_losses(after), "text": text}


def replan_overrides(run_dir: str, steps: int, save_every: int, storage: str = "shared") -> list[str]:
    """The re-planning drill's job: the same tiny GPT, its degrees chosen at each start within a
    memory limit that one rank cannot meet (so a lost host is not simply absorbed by dp); with
    `storage` ``local`` each host's part of a checkpoint also kept on the next host."""
    local = ["train.checkpoint_storage=local", "train.checkpoint_replicas=2"] if storage == "local" else []
    return [*SMALL64, f"train.max_steps={steps}", f"train.save_every={save_every}", "train.resume=auto",
            f"train.run_dir={run_dir}", "parallel.replan=true", "parallel.pp=auto", "parallel.dp=auto",
            "parallel.tp=auto", f"plan.memory_limit_gb={MEMORY_LIMIT_GB}", "pipeline.num_microbatches=2", *local]


JOIN_RATE_MBIT = 0.3  # host 1's link while host 2 starts again (tests/test_hosts.py's grow test does the same)
MEMORY_LIMIT_GB = 0.0009  # the drill's model needs about 1.2 MB on one rank, 0.7 MB on each of two


def replan_trial(kill_step: int, steps: int, save_every: int, workdir: str, timeout_s: float,
                 storage: str = "shared", nproc: int = 1) -> dict:
    """3 hosts x 1 rank (or 2 x 2 with `nproc` 2); the last host killed once step `kill_step` is
    logged, started again once 5 more steps were logged by those left; what happened."""
    run_dir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    lines: list[tuple[float, str]] = []
    job = replan_overrides(run_dir, steps, save_every, storage)
    count = 3 if nproc == 1 else 2
    common = {"nproc": nproc, "nnodes": f"{count - 1}:{count}", "torchrun_args": "--max-restarts 5",
              "timeout_s": timeout_s, "warm_workers": False, "rdzv_conf": None}
    killed_at = rejoined_at = None
    slowed = False
    private = (run_dir,) if storage == "local" else ()
    with EmulatedHosts(count, names="missing", private=private) as hosts:
        procs = launch_on_hosts(hosts, job, **common)
        pump = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in procs[0].stdout))
        pump.start()
        kill = re.compile(rf"step\s+{kill_step}/{steps} \|")
        while procs[0].poll() is None:
            seen = list(lines)
            if killed_at is None and any(kill.search(line) for _, line in seen):
                hosts.kill(count - 1)
                killed_at = time.monotonic()
            elif killed_at is not None and rejoined_at is None:
                after = [line for t, line in seen if t > killed_at and re.search(r"step\s+\d+/\d+ \| loss", line)]
                if len(after) >= 5:
                    procs += launch_on_hosts(hosts, job, on=[count - 1], **common)
                    rejoined_at = time.monotonic()
                    if count == 3:  # the job must not end before the host's agent has joined: slow it meanwhile
                        hosts.limit(1, JOIN_RATE_MBIT)
                        slowed = True
            elif slowed and any(t > rejoined_at and f"re-planned for {count} ranks" in line for t, line in seen):
                hosts.limit(1, None)
                slowed = False
            time.sleep(0.02)
        pump.join()
        for proc in procs[1:]:
            proc.wait(timeout=30)
        status = procs[0].returncode
    text = "".join(line for _, line in lines)
    plans = re.findall(r"re-planned for (\d) ranks[^:]*: (dp \d x pp \d x tp \d)", text)
    first_after = next((t for t, line in lines if killed_at and t > killed_at
                        and re.search(r"step\s+\d+/\d+ \| loss", line)
                        and any("resumed from checkpoint" in l2 for t2, l2 in lines if killed_at < t2 <= t)), None)
    stopped = re.search(r"stopped at step (\d+) by torchrun's agent", text)
    resumed = [int(n) for n in re.findall(r"resumed from checkpoint \S+ at step (\d+)", text)]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"status": status, "plans": plans, "stopped_at": int(stopped.group(1)) if stopped else None,
            "resumed": resumed, "recovery_s": first_after - killed_at if first_after and killed_at else None,
            "rejoined": rejoined_at is not None, "losses": step_losses(text), "text": text,
            "assembled": len(re.findall(r"assembled step_\d+ from the parts the hosts hold", text))}


def _replan_trials(args: argparse.Namespace, rng: random.Random, workdir: str) -> int:
    """The ``--replan`` trials: one line each, then ``survived K of N`` and the recovery times."""
    expected = reference(args.steps, workdir)
    survived, recoveries = 0, []
    world = 3 * 1 if args.nproc == 1 else 2 * args.nproc
    for k in range(args.trials):
        kill_step = rng.randrange(args.save_every + 1, args.steps // 3)
        got = replan_trial(kill_step, args.steps, args.save_every, workdir, args.timeout, args.storage, args.nproc)
        worlds = [int(w) for w, _ in got["plans"]]
        shapes = [shape for _, shape in got["plans"]]
        changed = worlds == [world, world - args.nproc, world] and shapes[0] != shapes[1] and shapes[1] != shapes[2]
        same = bool(got["losses"]) and all(abs(expected[s] - v) <= 1e-6 for s, v in got["losses"].items()
                                           if s in expected) and set(got["losses"]) <= set(expected)
        kept = got["stopped_at"] is not None and got["stopped_at"] in got["resumed"]  # the join retrained nothing
        ok = got["status"] == 0 and got["rejoined"] and changed and same and kept
        survived += ok
        if got["recovery_s"] is not None:
            recoveries.append(got["recovery_s"])
        recovery = f"{got['recovery_s']:.1f} s" if got["recovery_s"] is not None else "-"
        lost = f"host {2 if args.nproc == 1 else 1}"
        print(f"trial {k + 1:2d}: killed {lost} at step {kill_step:3d} | layouts {' -> '.join(shapes) or '-'} | "
              f"resumed at {got['resumed']} (the join saved step {got['stopped_at']}; assembled {got['assembled']}) | "
              f"kill -> first resumed step {recovery} | losses {'equal' if same else 'DIFFER'} | "
              f"{'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            print(got["text"][-4000:], flush=True)
    print(f"survived {survived} of {args.trials} ({args.storage} storage, "
          f"{'3 hosts x 1 rank' if args.nproc == 1 else f'2 hosts x {args.nproc} ranks'})")
    _print_recoveries(recoveries, counted=True)
    return 0 if survived == args.trials else 1


def _print_recoveries(recoveries: list[float], counted: bool) -> None:
    """The summary line of the kill -> first resumed step times (median, min, max; with `counted`,
    how many trials timed one); nothing when none did."""
    if recoveries:
        ordered = sorted(recoveries)
        print(f"kill -> first resumed step: median {statistics.median(ordered):.1f} s (min {ordered[0]:.1f}, "
              f"max {ordered[-1]:.1f}{f', {len(ordered)} trials' if counted else ''})")


def rendezvous_host_trial(kill_step: int, steps: int, save_every: int, workdir: str, timeout_s: float) -> dict:
    """One job, host 0 (the rendezvous, rank 0, the lock) killed once step `kill_step` is logged;
    the job started again on host 1 as soon as host 1's launcher has ended."""
    run_dir = tempfile.mkdtemp(prefix="run-", dir=workdir)
    lines: list[tuple[float, str]] = []
    job = overrides(run_dir, steps, save_every)
    with EmulatedHosts(2, names="missing") as hosts:
        procs = launch_on_hosts(hosts, job, nnodes="1:2", torchrun_args="--max-restarts 3", timeout_s=timeout_s,
                                warm_workers=False, rdzv_conf=None)
        pumps = [threading.Thread(target=lambda p=p: lines.extend((time.monotonic(), line) for line in p.stdout))
                 for p in procs]
        for pump in pumps:
            pump.start()
        pattern = re.compile(rf"step\s+{kill_step}/{steps} \|")
        while not any(pattern.search(line) for _, line in list(lines)):
            if procs[0].poll() is not None:
                break
            time.sleep(0.02)
        hosts.kill(0)
        killed_at = time.monotonic()
        procs[1].wait(timeout=timeout_s)
        for pump in pumps:
            pump.join()
        ended_at = time.monotonic()
        again = launch_on_hosts(hosts, job, nnodes="1:2", timeout_s=timeout_s, on=[1], warm_workers=False, rdzv_conf=None,
                                env={"ENDPOINT": f"{hosts.addresses[1]}:29500"})[0]
        restart = [(time.monotonic(), line) for line in again.stdout]  # type: ignore[union-attr]
        status = again.wait()
    text = "".join(line for _, line in restart)
    resumed = re.search(r"resumed from checkpoint \S+ at step (\d+)", text)
    first = next((t for t, line in restart if resumed and re.search(r"step\s+\d+/\d+ \| loss", line)), None)
    shutil.rmtree(run_dir, ignore_errors=True)
    how = re.search(r"(this job's before its restart|answers no more|was not renewed in \d+ s)", text)
    return {"status": status, "refused": "RunDirLockedError" in text, "lock": how.group(1) if how else "free",
            "resumed_at": int(resumed.group(1)) if resumed else None, "ended_s": ended_at - killed_at,
            "recovery_s": first - killed_at if first is not None else None, "text": text}


def _rendezvous_host_trials(args: argparse.Namespace, rng: random.Random, workdir: str) -> int:
    """The ``--lose rendezvous-host`` trials: one line each, then the median recovery."""
    failures, recoveries = 0, []
    for k in range(args.trials):
        kill_step = rng.randrange(args.save_every + 1, args.steps - 5)
        got = rendezvous_host_trial(kill_step, args.steps, args.save_every, workdir, args.timeout)
        ok = got["status"] == 0 and not got["refused"] and got["resumed_at"] is not None
        failures += not ok
        if got["recovery_s"] is not None:
            recoveries.append(got["recovery_s"])
        print(f"trial {k + 1:2d}: killed host 0 at step {kill_step:3d} | host 1's launcher ended after "
              f"{got['ended_s']:.1f} s | restart on host 1 {'REFUSED' if got['refused'] else 'started'} (the dead "
              f"job's lock: {got['lock']}), status "
              f"{got['status']}, resumed at step {got['resumed_at']} | kill -> first resumed step "
              f"{got['recovery_s']:.1f} s | {'ok' if ok else 'FAILED'}" if got["recovery_s"] is not None else
              f"trial {k + 1:2d}: FAILED (status {got['status']}, refused {got['refused']})", flush=True)
        if not ok:
            print(got["text"][-4000:], flush=True)
    print(f"{args.trials - failures} of {args.trials} restarts after losing the rendezvous host started at the "
          f"first try and finished")
    _print_recoveries(recoveries, counted=False)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """Run the trials and print one line each, then a summary."""
    parser = argparse.ArgumentParser(prog="python benchmarks/fault_drills/node_loss.py", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per trial")
    parser.add_argument("--rdzv-conf", default=RDZV_CONF,
                        help="torchrun's --rdzv-conf (default: none, the launcher's recovery defaults)")
    parser.add_argument("--lose", choices=["host1", "rendezvous-host"], default="host1",
                        help="host 1 (the survivors go on), or host 0, which hosts the rendezvous and rank 0 (the "
                             "job ends; it is started again on host 1 at once)")
    parser.add_argument("--replan", action="store_true",
                        help="3 hosts x 1 rank re-planning their layout: lose host 2, then start it again")
    parser.add_argument("--storage", choices=["shared", "local"], default="shared",
                        help="--replan: one run directory every host sees, or each host its own disk "
                             "(train.checkpoint_storage=local, each part also on the next host)")
    parser.add_argument("--nproc", type=int, choices=[1, 2], default=1,
                        help="--replan: 3 hosts x 1 rank, or 2 hosts x 2 ranks (tensor parallelism may be chosen)")
    parser.add_argument("--store", choices=["shared", "fresh"], default="shared",
                        help="torchrun's shared agent store across restarts (plain torchrun's default), or a fresh "
                             "one per restart (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, pipeflow.launch's default)")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="pipeflow-drill-")
    try:
        if args.lose == "rendezvous-host":
            return _rendezvous_host_trials(args, rng, workdir)
        if args.replan:
            return _replan_trials(args, rng, workdir)
        expected = reference(args.steps, workdir)
        failures, recovery_times = 0, []
        for k in range(args.trials):
            kill_step = rng.randrange(args.save_every + 1, args.steps - 5)
            got = trial(kill_step, args.steps, args.save_every, workdir, args.timeout, args.store == "shared",
                        args.rdzv_conf)
            recovery_times.append(got["recovery_s"])
            same = bool(got["losses"]) and all(expected.get(s) == v for s, v in got["losses"].items())
            ok = got["status"] == 0 and got["killed"] and got["resumed_at"] is not None and same
            failures += not ok
            lost = kill_step - got["resumed_at"] if got["resumed_at"] is not None else None
            recovery = f"{got['recovery_s']:.1f} s" if got["recovery_s"] is not None else "-"
            print(f"trial {k + 1:2d}: killed at step {kill_step:3d} | status {got['status']} | resumed at step "
                  f"{got['resumed_at']} | steps lost {lost} | kill -> first resumed step {recovery} | losses from the "
                  f"resumed step {'equal' if same else 'DIFFER'} to the uninterrupted run's | {'ok' if ok else 'FAILED'}",
                  flush=True)
            if not ok:
                print(got["text"][-4000:], flush=True)
        print(f"{args.trials - failures} of {args.trials} trials finished with the uninterrupted run's losses "
              f"({args.store} store, --rdzv-conf {args.rdzv_conf or 'as the launcher sets it'})")
        _print_recoveries([r for r in recovery_times if r is not None], counted=True)
        return 1 if failures else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
