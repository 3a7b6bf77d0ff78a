"""Check what a `train.py` run on CUDA measured: its trace and its log (used by gpu_check.sh).

    python benchmarks/gpu_checks/run_figures.py RUN_DIR LOG [--expect TEXT ...]

From ``RUN_DIR/trace.json`` (``metrics.trace_steps``), per traced step and rank: compute time
(F/B/W, timed by CUDA events) must be > 0 and the rank's bubble ``1 - compute / span`` in
[0, 1); from LOG: the end-of-run summary line (median step time, measured bubble in [0, 1)),
and every ``--expect`` text.  Prints the figures; exits 1 if a check fails.  Imports nothing
but the standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys


def trace_figures(path: str) -> list[tuple[int, int, float, float]]:
    """(step, rank, compute ms, span ms) of every traced step and rank in a Chrome trace."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    spans: dict[tuple[int, int], list[float]] = {}
    for e in events:
        key = (e["args"]["step"], e["pid"])
        row = spans.setdefault(key, [0.0, float("inf"), float("-inf")])
        if e["cat"] in ("F", "B", "W"):
            row[0] += e["dur"] / 1e3
        row[1], row[2] = min(row[1], e["ts"]), max(row[2], e["ts"] + e["dur"])
    return [(step, rank, c, (end - start) / 1e3) for (step, rank), (c, start, end) in sorted(spans.items())]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_checks/run_figures.py", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("log")
    parser.add_argument("--expect", nargs="*", default=[], help="texts the log must contain")
    args = parser.parse_args()
    failures = []
    trace = os.path.join(args.run_dir, "trace.json")
    if not os.path.isfile(trace):
        failures.append(f"no {trace}")
    else:
        for step, rank, compute, span in trace_figures(trace):
            bubble = 1 - compute / span if span > 0 else float("nan")
            print(f"traced step {step}, rank {rank}: compute {compute:.3f} ms over a span of {span:.3f} ms, "
                  f"bubble {bubble:.1%}")
            if not compute > 0:
                failures.append(f"step {step} rank {rank}: compute time {compute} ms is not > 0")
            if not 0 <= bubble < 1:
                failures.append(f"step {step} rank {rank}: bubble {bubble} outside [0, 1)")
    with open(args.log, errors="replace") as f:
        log = f.read()
    summary = re.search(r"median step (\d+) ms \| (.*?) \| bubble (\d+)% measured", log)
    if summary is None:
        failures.append("no end-of-run summary line in the log")
    else:
        print(f"median step {summary.group(1)} ms, {summary.group(2)}, bubble {summary.group(3)}% measured")
        if not 0 <= int(summary.group(3)) < 100:
            failures.append(f"measured bubble {summary.group(3)}% outside [0, 100)")
    for text in args.expect:
        found = text in log
        print(f"log {'contains' if found else 'LACKS'}: {text!r}")
        if not found:
            failures.append(f"the log lacks {text!r}")
    for failure in failures:
        print(f"FAIL {failure}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
