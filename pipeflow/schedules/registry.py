"""The schedule registry: each generator registers itself where it is defined, with the layout it
needs and its closed-form makespan (or none).

`SCHEDULES` maps a name to its `ScheduleEntry`; `GENERATORS` (name -> generator) and `LAYOUTS`
(name -> (stages per rank or None, placements)) are live read-only views of it, so a schedule
registered later appears in both, in `build_schedule` and in ``python -m pipeflow.schedules.compare``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from pipeflow.errors import ScheduleError
from pipeflow.schedules.ir import PipelineSchedule

Generator = Callable[..., PipelineSchedule]
G = TypeVar("G", bound=Generator)
V = TypeVar("V")


@dataclass(frozen=True)
class ClosedForm:
    """A schedule's makespan with unit costs (F = B = W = 1; a full backward 2) for p ranks,
    m micro-batches and v stages per rank (None outside the range the formula covers, e.g.
    m < p), and the formula as printed."""

    text: str
    makespan: Callable[[int, int, int], float | None]


@dataclass(frozen=True)
class ScheduleEntry:
    """One registered schedule.

    Attributes:
        generator: (p, m[, v]) -> PipelineSchedule.
        stages_per_rank: the count it needs, or None if it takes any (passed as its third argument).
        placements: the placements it can use, its own first.
        closed_form: its makespan in closed form, or None where none is known.
    """

    generator: Generator
    stages_per_rank: int | None
    placements: tuple[str, ...]
    closed_form: ClosedForm | None = None


SCHEDULES: dict[str, ScheduleEntry] = {}


def register_schedule(
    name: str,
    *,
    stages_per_rank: int | None,
    placements: tuple[str, ...] = ("loop",),
    closed_form: ClosedForm | None = None,
    overwrite: bool = False,
) -> Callable[[G], G]:
    """A decorator that registers a generator under `name` (``schedule=<name>``) and returns it unchanged.

    Args:
        name: the schedule's name in configs and tables.
        stages_per_rank: the count it needs, or None if it takes any.
        placements: the placements it can use, its own first.
        closed_form: its unit-cost makespan, or None (compare prints "-").
        overwrite: allow replacing an existing entry.

    Raises:
        ScheduleError: `name` is taken and overwrite is False.
    """

    def register(generator: G) -> G:
        if name in SCHEDULES and not overwrite and SCHEDULES[name].generator is not generator:
            raise ScheduleError(f"schedule {name!r} is already registered; pass overwrite=True to replace it")
        SCHEDULES[name] = ScheduleEntry(generator, stages_per_rank, tuple(placements), closed_form)
        return generator

    return register


class _View(Mapping[str, V], Generic[V]):
    """A read-only mapping name -> one field of each registered schedule, in registration order."""

    def __init__(self, pick: Callable[[ScheduleEntry], V]) -> None:
        self._pick = pick

    def __getitem__(self, name: str) -> V:
        return self._pick(SCHEDULES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(list(SCHEDULES))

    def __len__(self) -> int:
        return len(SCHEDULES)

    def __repr__(self) -> str:
        return repr(dict(self))


GENERATORS: Mapping[str, Generator] = _View(lambda entry: entry.generator)
LAYOUTS: Mapping[str, tuple[int | None, tuple[str, ...]]] = _View(
    lambda entry: (entry.stages_per_rank, entry.placements)
)
