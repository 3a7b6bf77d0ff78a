"""Measure the fault table of docs/guides/failures.md: every fault made with the real commands, under
torchrun and hand-launched (one ``python train.py`` per rank with RANK/WORLD_SIZE/MASTER_*).

For each fault: the error each rank printed, the seconds from the fault to the moment every
process of the job had exited, the processes left 60 s after the fault (then killed), and the
steps of progress lost (steps done minus the last checkpoint's step; save every 2 steps).

    python benchmarks/fault_drills/fault_table.py            # every fault, both launches (about 5-10 minutes)
    python benchmarks/fault_drills/fault_table.py kill stall # some of them
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAST = ["model=mlp", "data=gaussian", "train.max_steps=8", "train.eval_every=0", "train.eval_batches=1",
        "pipeline.profile=false", "comm.timeout_s=3", "comm.first_step_timeout_s=30", "comm.join_timeout_s=5",
        "train.save_every=2", "train.log_every=1", "metrics.tensorboard=false"]
CAP_S = 60.0
LONG = ["train.max_steps=100000"]  # a job still running when the fault is made from outside
FAILED = re.compile(r"rank (\d+) failed(?: with|:) (\w+)")


@dataclass
class Fault:
    """One fault: its name, how it is made, and what the job is launched with."""

    name: str
    how: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    external: str | None = None  # sigstop | kill-launcher | second-job | None
    prepare: str | None = None  # damage-explicit | damage-auto | garble-meta
    launches: tuple[str, ...] = ("torchrun", "hand")
    nproc: int = 2


FAULTS = [
    Fault("stall", "PIPEFLOW_FAULT_INJECT=stall:rank=1:step=3", {"PIPEFLOW_FAULT_INJECT": "stall:rank=1:step=3"}),
    Fault("raise", "PIPEFLOW_FAULT_INJECT=raise:rank=1:step=3", {"PIPEFLOW_FAULT_INJECT": "raise:rank=1:step=3"}),
    Fault("kill", "PIPEFLOW_FAULT_INJECT=kill:rank=1:step=3 (SIGKILL)", {"PIPEFLOW_FAULT_INJECT": "kill:rank=1:step=3"}),
    Fault("oom", "PIPEFLOW_FAULT_INJECT=oom:rank=0:step=3", {"PIPEFLOW_FAULT_INJECT": "oom:rank=0:step=3"}),
    Fault("shape", "PIPEFLOW_FAULT_INJECT=shape:rank=0:step=3", {"PIPEFLOW_FAULT_INJECT": "shape:rank=0:step=3"}),
    Fault("dtype", "PIPEFLOW_FAULT_INJECT=dtype:rank=0:step=3", {"PIPEFLOW_FAULT_INJECT": "dtype:rank=0:step=3"}),
    Fault("nan", "PIPEFLOW_FAULT_INJECT=nan:rank=0:step=3 (train.check_finite=false)", {"PIPEFLOW_FAULT_INJECT": "nan:rank=0:step=3"}),
    Fault("nan-checked", "nan:rank=0:step=3 with train.check_finite=true", {"PIPEFLOW_FAULT_INJECT": "nan:rank=0:step=3"},
          ["train.check_finite=true"]),
    Fault("diverge", "optim.lr=1e30", overrides=["optim.lr=1e30"]),
    Fault("sigstop", "kill -STOP of rank 1 after step 3 is logged", overrides=LONG, external="sigstop"),
    Fault("kill-launcher", "kill -9 of torchrun after step 3 is logged", overrides=LONG, external="kill-launcher",
          launches=("torchrun",)),
    Fault("never-joins", "rank 1 of 2 never started (hand-launched: only rank 0)", launches=("hand-missing",)),
    Fault("second-job", "a second job started in the same train.run_dir", overrides=LONG, external="second-job",
          launches=("torchrun",)),
    Fault("damaged-explicit", "one bit flipped in a data file; train.resume=<that checkpoint>", prepare="damage-explicit"),
    Fault("damaged-auto", "one bit flipped in the newest checkpoint; train.resume=auto", prepare="damage-auto"),
    Fault("garbled-meta", "meta.json overwritten with '{garbage'; train.resume=<that checkpoint>", prepare="garble-meta"),
    Fault("bad-fault-rank", "PIPEFLOW_FAULT_INJECT=kill:rank=7:step=1 on 2 ranks", {"PIPEFLOW_FAULT_INJECT": "kill:rank=7:step=1"}),
    Fault("max-steps", "train.max_steps=-5", overrides=["train.max_steps=-5"]),
    Fault("run-dir-file", "train.run_dir=<a file>", overrides=["train.run_dir=@FILE"]),
    Fault("mismatch", "rank 1 launched with pipeline.num_microbatches=4", launches=("hand-mismatch",)),
]


def _pids(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes() and b"fault_table" not in (entry / "cmdline").read_bytes():
                    state = (entry / "stat").read_text().split(")")[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(launch: str, run_dir: Path, overrides: list[str], env: dict[str, str], nproc: int, log: Path) -> list[subprocess.Popen]:
    args = [*FAST, *overrides, f"train.run_dir={run_dir}"]
    base = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    out = open(log, "a")
    if launch == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "train.py", *args]
        return [subprocess.Popen(cmd, cwd=ROOT, env=base, stdout=out, stderr=subprocess.STDOUT)]
    port, procs = _free_port(), []
    ranks = [0] if launch == "hand-missing" else list(range(nproc))
    for r in ranks:
        extra = ["pipeline.num_microbatches=4"] if launch == "hand-mismatch" and r == 1 else []
        renv = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "train.py", *args, *extra], cwd=ROOT, env=renv, stdout=out,
                                      stderr=subprocess.STDOUT))
    return procs


def _wait_for(log: Path, pattern: str, timeout: float) -> float | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return time.time()
        time.sleep(0.05)
    return None


def _prepare(fault: Fault, run_dir: Path, log: Path) -> list[str]:
    """Run a clean job first (4 steps, checkpoints at 2 and 4), then damage as the fault says."""
    if fault.prepare is None:
        return []
    procs = _start("torchrun", run_dir, ["train.max_steps=4"], {}, 2, log)
    for p in procs:
        p.wait(timeout=180)
    ckpt = run_dir / "checkpoints" / "step_00000004"
    if fault.prepare == "garble-meta":
        (ckpt / "meta.json").write_text("{garbage")
    else:
        data = ckpt / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    open(log, "w").close()
    return ["train.resume=auto"] if fault.prepare == "damage-auto" else [f"train.resume={ckpt}"]


def measure(fault: Fault, launch: str, work: Path) -> dict[str, object]:
    """Run `fault` under `launch`; returns what the table shows."""
    run_dir = work / f"{fault.name}-{launch}"
    log = work / f"{fault.name}-{launch}.log"
    log.write_text("")
    (work / "a_file").write_text("x")
    if "train.run_dir=@FILE" in fault.overrides:  # the run directory is a file
        run_dir = work / "a_file"
    overrides = [o for o in fault.overrides if "@FILE" not in o] + _prepare(fault, run_dir, log)
    started = time.time()
    procs = _start(launch, run_dir, overrides, fault.env, fault.nproc, log)
    marker = str(run_dir)
    t_fault = None
    if fault.external in ("sigstop", "kill-launcher", "second-job"):
        t_fault = _wait_for(log, r"step\s+3/\d+", 120)
        if fault.external == "sigstop":
            victim = next(p for p in _pids(marker) if _rank_of(p) == 1)
            os.kill(victim, signal.SIGSTOP)
        elif fault.external == "kill-launcher":
            procs[0].kill()
        else:
            second = work / f"{fault.name}-second.log"
            other = _start("torchrun", run_dir, [], {}, 2, second)
            other[0].wait(timeout=120)
            first = [p for p in _pids(marker)]
            text = second.read_text(errors="replace")
            for p in first:
                with_suppress_kill(p)
            procs[0].kill()
            return {"errors": _errors(text), "exit_s": f"{time.time() - t_fault:.1f} (second job)", "left": 0,
                    "lost": "0 (first job untouched)", "rc": other[0].returncode}
        t_fault = time.time()
    deadline = time.time() + CAP_S + 60
    while time.time() < deadline and (any(p.poll() is None for p in procs) or _pids(marker)):
        if t_fault is None:
            match = re.search(r"t=([\d.]+)", log.read_text(errors="replace"))
            if match:
                t_fault = float(match.group(1))
        if t_fault is not None and time.time() - t_fault > CAP_S:
            break
        time.sleep(0.1)
    ended = time.time()
    text = log.read_text(errors="replace")
    match = re.search(r"t=([\d.]+)", text)
    t_fault = float(match.group(1)) if match and t_fault is None else t_fault
    left = _pids(marker)
    for pid in left:
        with_suppress_kill(pid)
    for p in procs:
        if p.poll() is None:
            p.kill()
    rcs = [p.wait() for p in procs]
    exit_s = f"{ended - t_fault:.1f}" if t_fault is not None else f"{ended - started:.1f} from launch"
    return {"errors": _errors(text), "exit_s": exit_s, "left": len(left), "lost": _lost(text, run_dir), "rc": rcs}


def with_suppress_kill(pid: int) -> None:
    """SIGKILL `pid`, ignoring a process already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _errors(text: str) -> str:
    seen: dict[str, str] = {}
    for rank, kind in FAILED.findall(text):
        seen.setdefault(rank, kind)
    return "; ".join(f"rank {r}: {k}" for r, k in sorted(seen.items())) or "(no error)"


def _lost(text: str, run_dir: Path) -> str:
    steps = [int(s) for s in re.findall(r"step\s+(\d+)/\d+", text)]
    done = max(steps) + 1 if steps else 0
    latest = run_dir / "checkpoints" / "latest"
    try:
        saved = int(json.loads((run_dir / "checkpoints" / latest.read_text().strip() / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError):  # no checkpoint, or the fault garbled it
        saved = 0
    return str(max(0, done - saved))


def main(names: list[str]) -> None:
    """Measure the faults named (all when none) and print the table rows."""
    chosen = [f for f in FAULTS if not names or f.name in names]
    with tempfile.TemporaryDirectory(prefix="pf-faults-") as tmp:
        work = Path(tmp)
        print("| fault | how injected | launch | error per rank | fault -> all exited (s) | processes left | steps lost |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for fault in chosen:
            for launch in fault.launches:
                row = measure(fault, launch, work)
                print(f"| {fault.name} | {fault.how} | {launch} | {row['errors']} | {row['exit_s']} | {row['left']} | {row['lost']} |",
                      flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python benchmarks/fault_drills/fault_table.py", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="FAULT",
                        help=f"the faults to measure (default: all): {', '.join(f.name for f in FAULTS)}")
    names = parser.parse_args().names
    unknown = sorted(set(names) - {f.name for f in FAULTS})
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}")
    main(names)
