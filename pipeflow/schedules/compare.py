"""Every schedule side by side: simulated makespan, bubble and memory beside the closed forms.

    python -m pipeflow.schedules.compare --ranks 4 --microbatches 8 16

Costs are one unit per F, B and W of one stage (a full backward, where a schedule does not
split it, costs B + W = 2); with v chunks per rank a stage is 1/v of a rank's share of the model,
so compare schedules by "step time / ideal" (makespan over one rank's busy time) and by the bubble.  The closed forms are the ones the simulator tests prove for every accepted
(p, v, m) up to 8 ranks and 24 micro-batches (tests/test_schedules*.py); each schedule declares
its own where it is registered (``register_schedule(..., closed_form=...)``), "-" where it has none
(or m is outside the formula's range).  Memory is in micro-batches of a rank's share: (stage,
micro-batch) pairs held from F until W (or a full B), divided by the stages per rank.  ``auto``
here is synthesised for these unit costs with 1F1B's memory (p micro-batches).
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from pipeflow.errors import ScheduleError
from pipeflow.schedules import SCHEDULES, build_schedule, simulate

@dataclass
class Row:
    """One schedule at one micro-batch count."""

    name: str
    p: int
    v: int
    m: int
    makespan: float
    closed_form: float | None  # None: the schedule declares no closed form
    formula: str
    bubble: float
    peak_rank0: int
    busy_per_rank: float
    peak_any: int = 0  # most (stage, micro-batch) pairs held on any rank


def compare(num_ranks: int, microbatch_counts: Sequence[int], stages_per_rank: int = 2) -> list[Row]:
    """Simulate every registered schedule for p = `num_ranks` and each m; skip what it refuses."""
    rows = []
    for m in microbatch_counts:
        for name, entry in SCHEDULES.items():
            needed = entry.stages_per_rank
            v = needed if needed is not None else stages_per_rank
            try:
                schedule = build_schedule(name, num_ranks, m, v)
            except ScheduleError:
                continue
            result = simulate(schedule)
            form = entry.closed_form
            closed = None if form is None else form.makespan(num_ranks, m, v)
            rows.append(Row(name, num_ranks, v, m, result.makespan, closed, "-" if form is None else form.text,
                            result.bubble, result.peak_activations[0], result.busy[0], max(result.peak_activations)))
    return rows


def markdown(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| schedule | p | chunks v | m | makespan (simulated) | closed form | step time / ideal | bubble "
        "| activations held on rank 0 | on the busiest rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        closed = "-" if r.closed_form is None else f"{r.formula} = {r.closed_form:g}"
        lines.append(
            f"| `{r.name}` | {r.p} | {r.v} | {r.m} | {r.makespan:g} | {closed} | "
            f"{r.makespan / r.busy_per_rank:.3f} | {r.bubble:.1%} | {r.peak_rank0 / r.v:g} micro-batches | "
            f"{r.peak_any / r.v:g} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: print the table."""
    parser = argparse.ArgumentParser(prog="python -m pipeflow.schedules.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--stages-per-rank", type=int, default=2, help="for interleaved_1f1b and looped_bfs")
    args = parser.parse_args(argv)
    rows = compare(args.ranks, args.microbatches, args.stages_per_rank)
    print(markdown(rows))
    wrong = [r for r in rows if r.closed_form is not None and r.makespan != r.closed_form]
    for r in wrong:
        print(f"MISMATCH: {r.name} m={r.m}: simulated {r.makespan:g}, closed form {r.closed_form:g}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
