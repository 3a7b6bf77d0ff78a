"""The planner's calibrated picks against a measured 3 x 3 sweep (issue 20's target; a benchmark).

    python benchmarks/predictions/planner_picks.py --pp 2 4 --repeats 3 --steps 30 --out benchmarks/RESULTS.md

For each pipeline size: one run of the GPT (1F1B, m = 8) writes its costs (``costs.json``); the
planner ranks, with those costs (``plan.calibration=<that run>``), the 3 schedules x 3
micro-batch counts of `--schedules` x `--microbatches` (each at the split it finds best); every
one of the nine layouts is then run with the planner's overrides, `--repeats` times in
alternating order, and measured as the median of its runs' median steps.  Targets: the
planner's first pick within 5% of the fastest layout measured, and each of its top three within
5% of the measured top three (the k-th pick's step against the k-th fastest).  With
`--rehearse K` (default 9: all nine) the planner also builds its K fastest layouts as train.py
would and ranks them by their rehearsed step (``plan.rehearse``); both figures are in the table.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from benchmarks.runner import benchmark_parser, failure_line, report  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
_SUMMARY = re.compile(r"median step (\d+(?:\.\d+)?) ms \|")


RERUNS: list[str] = []  # runs that failed once and were run again, for the table's notes


def train(pp: int, words: list[str], steps: int, run_dir: str) -> float:
    """Median step (ms) of one ``torchrun train.py`` run with `words`; a failed run is run once
    more (its log kept beside the run directory, and named under the table)."""
    cmd = ["torchrun", "--nproc-per-node", str(pp), "train.py", f"parallel.pp={pp}", *words,
           f"train.max_steps={steps}", "train.eval_every=0", "train.eval_batches=1", "metrics.tensorboard=false"]
    for attempt in range(2):
        done = subprocess.run([*cmd, f"train.run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=1200)
        found = _SUMMARY.search(done.stdout + done.stderr)
        if done.returncode == 0 and found:
            return float(found.group(1))
        log = f"{run_dir}.failed{attempt}.log"
        with open(log, "w") as f:
            f.write(done.stdout + done.stderr)
        shutil.rmtree(run_dir, ignore_errors=True)  # the rerun starts afresh in the same directory
        RERUNS.append(f"`{' '.join(words)}` failed (exit {done.returncode}: {failure_line(done.stdout + done.stderr)}), "
                      f"log {log}")
        print(RERUNS[-1], file=sys.stderr, flush=True)
    raise RuntimeError(f"{' '.join(cmd)} failed twice:\n{(done.stdout + done.stderr)[-2000:]}")


def plan(pp: int, calibration: str, args: argparse.Namespace, out_csv: str) -> list[dict]:
    """The planner's best layout of each (schedule, m), fastest first, from its CSV."""
    cmd = [sys.executable, "-m", "pipeflow.plan", f"parallel.pp={pp}", f"plan.calibration={calibration}",
           f"plan.schedules=[{','.join(args.schedules)}]", f"plan.microbatches=[{','.join(map(str, args.microbatches))}]",
           f"plan.csv={out_csv}", "plan.max_chunks=2", f"plan.rehearse={args.rehearse}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(out_csv) as f:
        rows = [r for r in csv.DictReader(f) if r["fits"] == "True"]
    best: dict[tuple[str, str], dict] = {}
    for r in sorted(rows, key=_planned):  # the rehearsed layout of a kind, else its best predicted split
        best.setdefault((r["schedule"], r["num_microbatches"]), r)
    return sorted(best.values(), key=_planned)


def _planned(row: dict) -> tuple[int, float]:
    """The planner's order: rehearsed layouts first, by their rehearsed step, then by prediction."""
    return (0, float(row["rehearsed_ms"])) if row.get("rehearsed_ms") else (1, float(row["step_ms"]))


def one_size(pp: int, args: argparse.Namespace, work: str) -> list[str]:
    """Calibrate, plan, measure the nine layouts; the table rows and the verdict for `pp`."""
    base = os.path.join(work, f"base_pp{pp}")
    train(pp, ["schedule=1f1b", "pipeline.num_microbatches=8"], args.steps, base)
    picks = plan(pp, base, args, os.path.join(work, f"plan_pp{pp}.csv"))
    measured: dict[str, list[float]] = {r["overrides"]: [] for r in picks}
    for rep in range(args.repeats):
        order = picks if rep % 2 == 0 else picks[::-1]  # alternating, so drift hits every layout alike
        for k, r in enumerate(order):
            run_dir = os.path.join(work, f"pp{pp}_rep{rep}_{k}")
            measured[r["overrides"]].append(train(pp, shlex.split(r["overrides"]), args.steps, run_dir))
    step = {o: statistics.median(ts) for o, ts in measured.items()}
    fastest = sorted(step.values())
    rows = []
    for k, r in enumerate(picks, 1):
        rank = fastest.index(step[r["overrides"]]) + 1
        rehearsed = f"{float(r['rehearsed_ms']):.1f}" if r.get("rehearsed_ms") else "-"
        rows.append(f"| {pp} | {k} | `{r['overrides']}` | {float(r['step_ms']):.1f} | {rehearsed} | "
                    f"{' / '.join(f'{t:.0f}' for t in measured[r['overrides']])} | {step[r['overrides']]:.1f} | {rank} |")
    first = step[picks[0]["overrides"]] / fastest[0]
    top3 = [step[r["overrides"]] / fastest[k] for k, r in enumerate(picks[:3])]
    rows.append(f"| {pp} | | first pick / fastest: {first:.3f}; top three / measured top three: "
                f"{', '.join(f'{x:.3f}' for x in top3)} (target <= 1.05) | | | | | |")
    return rows


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs=3, default=["1f1b", "zb_h1", "interleaved_1f1b"])
    parser.add_argument("--microbatches", type=int, nargs=3, default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rehearse", type=int, default=9, help="plan.rehearse: layouts the planner rehearses (0: none)")
    args = parser.parse_args()
    rows = [f"GPT (default job), schedules {', '.join(args.schedules)} x m {args.microbatches}; each planner pick "
            f"(ranked with the costs of one 1F1B m = 8 run, plan.rehearse={args.rehearse}) measured {args.repeats} "
            f"times in alternating order, {args.steps} steps a run", "",
            "| pp | planner's rank | overrides | predicted (ms) | rehearsed (ms) | measured runs (ms) | median (ms) "
            "| measured rank |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    work = tempfile.mkdtemp(prefix="planner_picks_")  # kept: the logs of any failed run stay there
    for pp in args.pp:
        rows += one_size(pp, args, work)
        print("\n".join(rows), flush=True)  # each size's rows as soon as they are measured
    if RERUNS:
        rows += ["", "Runs that failed and were run again: " + "; ".join(RERUNS)]
    report("The planner's calibrated picks against a measured 3 x 3 sweep", "\n".join(rows), args.out)


if __name__ == "__main__":
    main()
