"""The picture a deadlock raises with: a rank x step table of the programs, each rank's stuck
step marked, long programs shown around the stuck steps only."""
from __future__ import annotations

from pipeflow.schedules.ir import Program, Step

_GRID_FULL = 24  # programs up to this many steps are drawn whole in a deadlock grid
_GRID_RADIUS = 3  # otherwise: this many steps either side of each stuck step


def cell(step: Step) -> str:
    """A step as a grid cell: its action (``1F3``), or ``-`` for a step without one."""
    return str(step.action) if step.action is not None else "-"


def _grid_columns(length: int, stuck_steps: list[int]) -> list[int | None]:
    """Step indices to draw; None stands for a run of hidden steps (``...``)."""
    if length <= _GRID_FULL:
        return list(range(length))
    near = {c for k in stuck_steps for c in range(k - _GRID_RADIUS, k + _GRID_RADIUS + 1)}
    shown = sorted(c for c in near if 0 <= c < length)
    columns: list[int | None] = []
    previous = -1
    for c in shown:
        if c != previous + 1:
            columns.append(None)
        columns.append(c)
        previous = c
    return columns + ([None] if previous < length - 1 else [])


def deadlock_grid(programs: list[Program], stuck: dict[int, int]) -> str:
    """A rank x step text table of the programs, each rank's stuck step marked ``[1F3]``."""
    length = max((len(program) for program in programs), default=0)
    columns = _grid_columns(length, list(stuck.values()))
    rows = [["step"] + ["..." if c is None else str(c) for c in columns]]
    for r, program in enumerate(programs):
        row = [f"rank {r}"]
        for c in columns:
            text = "..." if c is None else cell(program[c]) if c < len(program) else ""
            row.append(f"[{text}]" if c is not None and stuck.get(r) == c else text)
        rows.append(row)
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    return "\n".join(
        " ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )
