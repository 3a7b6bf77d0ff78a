"""Explicit placement (``pipeline.stage_to_rank``): a renaming of the schedule's own ranks."""
from __future__ import annotations

import pytest

from pipeflow.errors import ScheduleError
from pipeflow.schedules import build_schedule, simulate


@pytest.mark.parametrize(
    "name, mapping",
    [("1f1b", [2, 0, 3, 1]), ("gpipe", [3, 2, 1, 0]), ("interleaved_1f1b", [1, 0, 3, 2, 1, 0, 3, 2]),
     ("zbv", [3, 1, 2, 0, 0, 2, 1, 3]), ("zb_h1", [0, 1, 2, 3])],
)
def test_a_renaming_keeps_timing_and_memory(name: str, mapping: list[int]) -> None:
    plain = build_schedule(name, 4, 8)
    moved = build_schedule(name, 4, 8, stage_to_rank=mapping)
    assert moved.stage_to_rank == tuple(mapping)
    a, b = simulate(plain), simulate(moved)  # simulate also proves the programs deadlock-free
    assert a.makespan == b.makespan and a.bubble == b.bubble
    old_to_new = {old: new for old, new in zip(plain.stage_to_rank, mapping)}
    for old, new in old_to_new.items():
        assert moved.actions[new] == plain.actions[old]
        assert b.peak_activations[new] == a.peak_activations[old]


@pytest.mark.parametrize(
    "name, mapping, message",
    [
        ("1f1b", [0, 1, 2], r"3 entries but schedule '1f1b' has 4 stages"),
        ("1f1b", [0, 1, 2, 4], r"ranks outside 0..3"),
        ("1f1b", [0, 1, 1, 3], r"does not fit schedule '1f1b'.*every rank used once"),
        ("interleaved_1f1b", [0, 1, 2, 3, 1, 0, 2, 3], r"stages grouped on ranks as \[0, 1, 2, 3, 0, 1, 2, 3\]"),
        ("zbv", [0, 1, 2, 3, 0, 1, 2, 3], r"needs stages grouped on ranks as \[0, 1, 2, 3, 3, 2, 1, 0\]"),
    ],
)
def test_a_placement_that_does_not_fit_is_refused(name: str, mapping: list[int], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, 4, 8, stage_to_rank=mapping)


def test_stage_inflight_matches_the_closed_forms() -> None:
    from pipeflow.schedules.memory import stage_inflight

    assert stage_inflight(build_schedule("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert stage_inflight(build_schedule("1f1b", 4, 2)) == [2, 2, 2, 1]
    assert stage_inflight(build_schedule("gpipe", 4, 8)) == [8] * 4
    zbh1 = stage_inflight(build_schedule("zb_h1", 4, 8))
    assert zbh1[0] == 4  # like 1F1B on the first stage
    for name in ("interleaved_1f1b", "zbv", "zb_h1", "1f1b"):
        schedule = build_schedule(name, 4, 8)
        per_rank = [sum(n for s, n in enumerate(stage_inflight(schedule)) if schedule.stage_to_rank[s] == r)
                    for r in range(4)]
        # the simulator's per-rank peak can never exceed the sum of the per-stage peaks
        assert all(a <= b for a, b in zip(simulate(schedule).peak_activations, per_rank))
