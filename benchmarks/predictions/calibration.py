"""The calibrated cost model against live runs (issue 20's targets; a benchmark, not a test).

    python benchmarks/predictions/calibration.py recover --ranks 4 --microbatches 8 --steps 12 --out benchmarks/RESULTS.md
    python benchmarks/predictions/calibration.py predict --steps 30 --out benchmarks/RESULTS.md

``recover``: sleep-stages (one sleep layer per stage: F, B and W each a set wall time) run by the
runtime's own Pipeline, with every received tensor delivered `--delay-ms` late (the sender stamps
its post time into the payload; the receiver, once the transfer is done, sleeps until the later
post + the delay): the costs the calibration recovers from the recorded steps
(`pipeflow.planning.calibration.calibrate`) beside the set ones; the transfer latency recovered
with the delay less the one without it, beside the delay (target: within 5%).

``paths``: one run of the default job (or the tiny MoE) per path a run can take, the measured
step beside the start-of-run and calibrated predictions (targets: start-of-run within +-15%,
calibrated within +-10%): pp 4, tp 2, ep 2, cp 2, ``parallel.shard=full``, offload, DualPipeV
with MoE exchanges, a resumed run, a run re-planned on fewer ranks, and 2 emulated hosts x 2
ranks with and without a 100 Mbit tbf link between them (root and ``ip netns``; skipped with the
reason where refused).

``predict``: ``torchrun --nproc-per-node 4 train.py`` for the default job and for sleep-stages,
p = 4, m = 8, every built-in schedule: the measured step beside the start-of-run prediction (the
whole step, `pipeflow.planning.step_model`) and the calibrated one (the run's own costs
re-simulated), both over the calibrated steps (2 on), read from the run's log (targets:
calibrated within +-10%, start-of-run within +-25%).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, failure_line, gloo_worker, report, spawn_ranks  # noqa: E402
from benchmarks.sleep_tools import sleep_batch  # noqa: E402
from pipeflow.models.sleep import SleepLayer, sleep_loss  # noqa: E402
from pipeflow.models.spec import LayerSpec, ModelSpec  # noqa: E402
from pipeflow.planning.calibration import RankStep, calibrate  # noqa: E402
from pipeflow.runtime.events import EventRecorder  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.runtime.posting import Posting  # noqa: E402
from pipeflow.runtime.stage import build_stages  # noqa: E402
from pipeflow.runtime.transport import P2PComm  # noqa: E402
from pipeflow.schedules import build_schedule  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv", "v_half", "v_min",
             "dualpipev", "interleaved_zb", "auto")


class DelayedComm(P2PComm):
    """The pipeline group's communicator with every received tensor delivered `delay_s` after the
    later of the two posts (the sender stamps its post time, relative to `origin`, into the first
    element of what it sends: sleep-stages never read the values)."""

    def __init__(self, group, device, delay_s: float, origin: float, **kwargs) -> None:
        super().__init__(group, device, **kwargs)
        self.delay_s, self.origin = delay_s, origin
        self.active = False  # off for exchanges that read what they receive (warm-up, shapes)
        self._recvs: dict[int, tuple[torch.Tensor, float]] = {}

    def post(self, sends, recvs, what=""):
        """Stamp the sends, post, remember each recv's buffer and post time."""
        now = time.perf_counter()
        if not self.active:
            return super().post(sends, recvs, what)
        for _, t in sends:
            t.data.view(-1)[0] = now - self.origin
        works = super().post(sends, recvs, what)
        for work, (_, t) in zip(works[len(sends):], recvs):
            self._recvs[id(work)] = (t, now)
        return works

    def wait(self, works, what="", timeout_s=None):
        """Wait, then hold the received tensors until `delay_s` after the later post."""
        super().wait(works, what, timeout_s)
        ready = [max(posted, float(t.view(-1)[0]) + self.origin)
                 for t, posted in (self._recvs.pop(id(w)) for w in works if id(w) in self._recvs)]
        if ready and self.delay_s > 0:
            left = max(ready) + self.delay_s - time.perf_counter()
            if left > 0:
                time.sleep(left)


@gloo_worker()
def recover_worker(rank: int, p: int, port: int, args: argparse.Namespace, queue) -> None:
    """Run each (schedule, delay) for the warm-up and `args.steps` steps, recording; rank 0 calibrates."""
    origin = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(origin, 0)
    m, out = args.microbatches, {}
    for name in args.schedules:
        schedule = build_schedule(name, p, m)
        S = schedule.num_stages
        spec = ModelSpec("sleep", [LayerSpec(f"sleep.{s}", SleepLayer, (args.f_ms, args.b_ms, args.w_ms))
                                   for s in range(S)], loss_fn=sleep_loss)
        stages = build_stages(spec, [range(s, s + 1) for s in range(S)], schedule.stages_of(rank))
        for delay_ms in (0.0, args.delay_ms):
            comm = DelayedComm(None, torch.device("cpu"), delay_ms / 1e3, float(origin), timeout_s=300)
            comm.warmup()
            recorder = EventRecorder()
            pipe = Pipeline(stages, schedule, comm, posting=Posting(True), recorder=recorder)
            steps = []
            for step in range(2 + args.steps):
                comm.active = step > 0  # the first pass negotiates shapes through the same calls
                inputs, targets = sleep_batch(m)
                dist.barrier()
                start = recorder.start()
                pipe.run(inputs if 0 in stages else None, targets if S - 1 in stages else None)
                dist.all_reduce(torch.zeros(1))  # the grad-norm all-reduce's place
                events = recorder.stop()
                if step >= 2:
                    steps.append(RankStep(start, recorder.stopped_at, [tuple(e) for e in events]))
            gathered = [None] * p
            dist.all_gather_object(gathered, steps)
            if rank == 0:
                log = [[gathered[r][n] for r in range(p)] for n in range(args.steps)]
                out[name, delay_ms] = calibrate(schedule, log, [64.0] * S, postings=("ahead",))
            comm.close()
    if rank == 0:
        queue.put(out)


def _error(got: float, want: float) -> str:
    return f"{100 * (got - want) / want:+.1f}%"


def recover(args: argparse.Namespace) -> None:
    """Part (a): set costs and an injected transfer delay, recovered from live recorded steps."""
    results = spawn_ranks(recover_worker, args)
    rows = [f"sleep-stages, one layer per stage: F {args.f_ms:g} ms, B {args.b_ms:g} ms, W {args.w_ms:g} ms set "
            f"(a full backward B + W); every received tensor delivered {args.delay_ms:g} ms after the later post; "
            f"p = {args.ranks}, m = {args.microbatches}, {args.steps} steps after 2 of warm-up; recovered = mean "
            "over stages of the calibrated costs",
            "", "| schedule | F (ms) | B (ms) | W (ms) | full backward (ms) | transfer latency, no delay (ms) | "
            "with the delay (ms) | difference vs the delay | the same from blocked waits alone |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in args.schedules:
        base, cal = results[name, 0.0], results[name, args.delay_ms]

        def cell(values: list[float], want: float) -> str:
            finite = [v for v in values if v == v]
            if not finite:
                return "-"
            got = 1e3 * statistics.fmean(finite)
            return f"{got:.2f} ({_error(got, want)})"

        moved = 1e3 * (cal.latency_s - base.latency_s)
        blocked = 1e3 * (cal.blocked_latency_s - base.blocked_latency_s)
        rows.append(f"| {name} | {cell(cal.forward, args.f_ms)} | {cell(cal.input_grad, args.b_ms)} | "
                    f"{cell(cal.weight_grad, args.w_ms)} | {cell(cal.backward, args.b_ms + args.w_ms)} | "
                    f"{1e3 * base.latency_s:.3f} | {1e3 * cal.latency_s:.3f} | {moved:.3f} ({_error(moved, args.delay_ms)}) | "
                    f"{blocked:.3f} ({_error(blocked, args.delay_ms)}) |")
    report("Calibration recovers set costs on live sleep-stages", "\n".join(rows), args.out)


_START = re.compile(r"predicted step ([\d.]+) ms \(posting")
_CAL = re.compile(r"calibration over (\d+) steps \((\w+)\): step measured ([\d.]+) ms, predicted at start ([\d.]+) ms, "
                  r"calibrated ([\d.]+) ms")
_SUMMARY = re.compile(r"median step (\d+) ms \| predicted step \(calibrated\) (\S+) ms")


def train_run(ranks: int, words: list[str], run_dir: str, steps: int) -> tuple[int, str]:
    """One ``torchrun`` of train.py with `words` for `steps` steps in `run_dir` (no evaluation, no
    TensorBoard): its exit status and output."""
    cmd = ["torchrun", "--nproc-per-node", str(ranks), "train.py", *words, f"train.max_steps={steps}",
           "train.eval_every=0", "train.eval_batches=1", "metrics.tensorboard=false", f"train.run_dir={run_dir}",
           f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout + done.stderr


def calibration_of(status: int, log: str) -> tuple[float, float, float, str] | str:
    """(measured, start-of-run, calibrated, posting) from a finished run's calibration line, or why not."""
    found = _CAL.search(log)
    if status != 0 or not found:
        return failure_line(log)
    return float(found.group(3)), float(found.group(4)), float(found.group(5)), found.group(2)


def figures(measured: float, start: float, calibrated: float) -> str:
    """A table's measured, start-of-run and calibrated cells, each prediction with its error."""
    return (f"{measured:.1f} | {start:.1f} | {_error(start, measured)} | {calibrated:.1f} | "
            f"{_error(calibrated, measured)}")


def one_run(job: list[str], schedule: str, args: argparse.Namespace) -> tuple[float, float, float, str] | str:
    """(measured, start-of-run, calibrated, posting) from one torchrun of train.py, or why not."""
    v = ["schedule.stages_per_rank=2"] if schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zb") else []
    with tempfile.TemporaryDirectory() as run_dir:
        return calibration_of(*train_run(args.ranks, [*job, f"schedule={schedule}",
                                                      f"pipeline.num_microbatches={args.microbatches}", *v],
                                         run_dir, args.steps))


JOBS = {"default job (GPT)": [], "sleep-stages": ["model=sleep", "model.num_layers=8", "data=gaussian",
                                                  "model.forward_ms=10", "model.backward_ms=10", "model.weight_ms=10"]}


def predict(args: argparse.Namespace) -> None:
    """Part (b): measured step vs the start-of-run and the calibrated predictions, every schedule."""
    rows = [f"p = {args.ranks}, m = {args.microbatches}, {args.steps} steps per run; measured = median step over the "
            "calibrated steps (2 on), from the run's calibration line; targets: calibrated within +-10%, "
            "start-of-run within +-25%", "",
            "| job | schedule | posting | measured (ms) | start-of-run (ms) | error | calibrated (ms) | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    hits = {"start": [], "calibrated": []}
    for job, words in JOBS.items():
        for schedule in args.schedules:
            got = one_run(words, schedule, args)
            if isinstance(got, str):
                rows.append(f"| {job} | {schedule} | - | failed: {got} | | | | |")
                continue
            measured, start, calibrated, posting = got
            hits["start"].append(abs(start / measured - 1) <= 0.25)
            hits["calibrated"].append(abs(calibrated / measured - 1) <= 0.10)
            rows.append(f"| {job} | {schedule} | {posting} | {figures(measured, start, calibrated)} |")
            print(rows[-1], flush=True)
    rows.append("")
    rows.append(f"within target: start-of-run {sum(hits['start'])}/{len(hits['start'])}, "
                f"calibrated {sum(hits['calibrated'])}/{len(hits['calibrated'])}")
    report("Predicted step vs measured: start-of-run and calibrated", "\n".join(rows), args.out)


MOE = ["experiment=moe_tiny_pp2_ep2"]
PATHS: dict[str, tuple[int, list[str]]] = {  # name -> (ranks, overrides)
    "pp 4 (1f1b)": (4, []),
    "pp 2 x tp 2": (4, ["parallel.pp=2", "parallel.tp=2"]),
    "pp 2 x cp 2": (4, ["parallel.pp=2", "parallel.cp=2"]),
    "pp 2 x dp 2, shard=full": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.shard=full"]),
    "pp 4, offload=auto (gpipe)": (4, ["schedule=gpipe", "pipeline.offload=auto"]),
    "MoE pp 2 x ep 2 (1f1b)": (4, MOE),
    "MoE pp 2 x ep 2, dualpipev": (4, [*MOE, "schedule=dualpipev"]),
}


def _restarted(args: argparse.Namespace, replan: bool) -> tuple[float, float, float, str] | str:
    """The second run's calibration: the same run resumed (or re-planned on 2 of 4 ranks)."""
    words = ["train.save_every=10", "train.resume=auto"]
    if replan:
        words += ["parallel.replan=true", "parallel.pp=auto", "parallel.dp=auto"]
    with tempfile.TemporaryDirectory() as run_dir:
        status, first = train_run(4, words, run_dir, args.steps)
        if status != 0:
            return failure_line(first)
        return calibration_of(*train_run(2 if replan else 4, words, run_dir, 2 * args.steps))


def _on_hosts(args: argparse.Namespace, rate_mbit: float | None) -> tuple[float, float, float, str] | str:
    """2 emulated hosts x 2 ranks, pp 4 (two boundaries inside a host, one across), the link
    between them limited to `rate_mbit` (None: the veth's own rate)."""
    sys.path.insert(0, str(Path(ROOT) / "tests"))
    from examples.emulated_hosts import EmulatedHosts, unavailable
    from hosts import launch_on_hosts, outputs

    why = unavailable()
    if why:
        return f"skipped: {why}"
    with tempfile.TemporaryDirectory() as run_dir, EmulatedHosts(2, names="missing") as hosts:
        if rate_mbit is not None:
            hosts.limit(1, rate_mbit)
        words = [f"train.max_steps={args.steps}", "train.eval_every=0", "train.eval_batches=1",
                 "metrics.tensorboard=false", f"train.run_dir={run_dir}"]
        procs = launch_on_hosts(hosts, words, nproc=2, timeout_s=900, warm_workers=False, rdzv_conf=None)
        texts = outputs(procs, timeout_s=900)
    return calibration_of(procs[0].returncode, texts[0])


def paths(args: argparse.Namespace) -> None:
    """Measured step vs the start-of-run and calibrated predictions on every path a run can take."""
    rows = [f"{args.steps} steps per run (the restarted ones {args.steps} more); measured = median step over the "
            "calibrated steps, from the run's calibration line; targets: start-of-run within +-15%, calibrated "
            "within +-10%", "",
            "| path | ranks | measured (ms) | start-of-run (ms) | error | calibrated (ms) | error |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (ranks, words) in PATHS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            _row(rows, name, ranks, calibration_of(*train_run(ranks, words, run_dir, args.steps)))
    for name, ranks, run in (("resumed (same layout)", 4, lambda: _restarted(args, False)),
                             ("re-planned, 4 ranks -> 2", 2, lambda: _restarted(args, True)),
                             ("2 hosts x 2 ranks", 4, lambda: _on_hosts(args, None)),
                             ("2 hosts x 2 ranks, 100 Mbit between", 4, lambda: _on_hosts(args, 100))):
        if args.only and not any(o in name for o in args.only):
            continue
        _row(rows, name, ranks, run())
    report("Predicted step vs measured on every path: start-of-run and calibrated", "\n".join(rows), args.out)


def _row(rows: list[str], name: str, ranks: int, got: tuple[float, float, float, str] | str) -> None:
    cells = f"{got} | | | |" if isinstance(got, str) else figures(*got[:3])  # a failure: why, then empty cells
    rows.append(f"| {name} | {ranks} | {cells} |")
    print(rows[-1], flush=True)


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("part", choices=("recover", "predict", "paths"))
    parser.add_argument("--only", nargs="+", default=None, help="paths: those whose name contains one of these")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="recorded steps (recover: 12) or run steps (predict: 30)")
    parser.add_argument("--schedules", nargs="+", default=None)
    parser.add_argument("--f-ms", type=float, default=20.0)
    parser.add_argument("--b-ms", type=float, default=20.0)
    parser.add_argument("--w-ms", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    args = parser.parse_args()
    if args.part == "paths":
        args.steps = args.steps or 30
        paths(args)
    elif args.part == "recover":
        args.steps = args.steps or 12
        args.schedules = args.schedules or ["1f1b", "zb_h1"]
        recover(args)
    else:
        args.steps = args.steps or 30
        args.schedules = args.schedules or list(SCHEDULES)
        predict(args)


if __name__ == "__main__":
    main()
