"""Custom schedules read from a file: one rank per line (text) or per row (CSV), then validated.

Text, one line per rank, actions ``<stage><F|B|W><micro-batch>`` separated by blanks, ``#``
starts a comment; blank and comment-only lines are skipped::

    # p = 2, m = 2, 1F1B with B split from W
    0F0 0F1 0B0 0W0 0B1 0W1   # rank 0
    1F0 1B0 1W0 1F1 1B1 1W1   # rank 1

CSV (a ``.csv`` file): one row per rank, one action per cell; empty cells are skipped (so a
spreadsheet may align actions in time), a row whose first cell starts with ``#`` is a comment.

Which rank holds a stage is read from the line that holds its actions; the number of
micro-batches is the largest one named, plus one.  The schedule is then validated by the
simulator, so a wrong file fails here with its problems (or the deadlock grid) listed, before
any process communicates.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from pipeflow.errors import DeadlockError, ScheduleError
from pipeflow.schedules.ir import Action, PipelineSchedule
from pipeflow.schedules.simulator import validate

Rows = list[tuple[int, list[str]]]  # (line number, action texts) per rank


def load_schedule(path: str | Path) -> PipelineSchedule:
    """Read, check and validate the custom schedule in `path` (text, or CSV if ``.csv``).

    Returns:
        The schedule, named ``custom``, its stage placement and m inferred from the file.

    Raises:
        ScheduleError: the file is missing or empty, an action does not parse, a stage sits on
            two ranks (both named) or on none, or the simulator finds the schedule incomplete,
            misordered or deadlocking (a :class:`DeadlockError` with the grid).
    """
    path = Path(path)
    if not path.is_file():
        raise ScheduleError(f"custom schedule file {str(path)!r} not found (schedule.path)")
    text = path.read_text()
    rows = _csv_rows(text) if path.suffix.lower() == ".csv" else _text_rows(text)
    if not rows:
        raise ScheduleError(f"{path}: no actions; expected one line of actions per rank")
    actions = [[_parse(path, line, word) for word in words] for line, words in rows]
    owner = _stage_owners(path, actions)
    m = 1 + max((a.microbatch for acts in actions for a in acts), default=-1)
    schedule = PipelineSchedule("custom", len(actions), len(owner), m, owner, actions)
    try:
        validate(schedule)
    except DeadlockError as error:
        message = str(error)[: -len(error.grid) - 1] if error.grid else str(error)
        raise DeadlockError(f"{path}: {message}", error.grid) from error
    except ScheduleError as error:
        raise ScheduleError(f"{path}: {error}") from error
    return schedule


def _text_rows(text: str) -> Rows:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if words:
            rows.append((number, words))
    return rows


def _csv_rows(text: str) -> Rows:
    rows = []
    for number, cells in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [cell.strip() for cell in cells]
        if cells and cells[0].startswith("#"):
            continue
        words = [cell for cell in cells if cell]
        if words:
            rows.append((number, words))
    return rows


def _parse(path: Path, line: int, word: str) -> Action:
    try:
        return Action.parse(word)
    except ScheduleError as error:
        raise ScheduleError(f"{path}:{line}: {error}") from None


def _stage_owners(path: Path, actions: list[list[Action]]) -> tuple[int, ...]:
    """stage -> rank, from the line that holds each stage's actions."""
    owner: dict[int, int] = {}
    for r, acts in enumerate(actions):
        for action in acts:
            first = owner.setdefault(action.stage, r)
            if first != r:
                raise ScheduleError(
                    f"{path}: stage {action.stage} appears on rank {first} and on rank {r} "
                    f"({action}); each stage must live on one rank"
                )
    missing = [s for s in range(max(owner) + 1) if s not in owner]
    if missing:
        raise ScheduleError(
            f"{path}: stage(s) {', '.join(map(str, missing))} appear on no rank; "
            f"stages must be numbered 0..{max(owner)} without gaps"
        )
    return tuple(owner[s] for s in range(len(owner)))
