"""Unit tests of the schedules package: IR, generators, lowering and the rendezvous simulator."""
from __future__ import annotations

import math
import subprocess
import sys
from collections import defaultdict

import pytest

from pipeflow.errors import DeadlockError, ScheduleError
from pipeflow.schedules import (
    Action,
    CommOp,
    PipelineSchedule,
    Program,
    SimResult,
    Step,
    build_schedule,
    forward_only,
    gpipe,
    lower,
    one_f_one_b,
    simulate,
    validate,
)
from pipeflow.schedules.ir import ACTIVATION, GRADIENT
from plain_pairing import pairing_lower

# p = ranks, m = micro-batches, r = rank, s = stage, i = micro-batch (as in the package).
TRAINING_GENERATORS = [gpipe, one_f_one_b]


def parse_actions(text: str) -> list[Action]:
    return [Action.parse(word) for word in text.split()]


def send(payload: str, i: int, src: int, dst: int, peer: int) -> CommOp:
    return CommOp("send", payload, i, src, dst, peer)


def recv(payload: str, i: int, src: int, dst: int, peer: int) -> CommOp:
    return CommOp("recv", payload, i, src, dst, peer)


# ----------------------------------------------------------------------------- IR


@pytest.mark.parametrize("text", ["0F0", "3B12", "11W7"])
def test_action_str_parse_round_trip(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == text
    assert Action.parse(str(action)) == action


def test_action_fields() -> None:
    assert Action.parse("2B5") == Action("B", 5, 2)


@pytest.mark.parametrize("text", ["", "F0", "0X1", "1F", "a1F0", "1 F 0"])
def test_action_parse_rejects_bad_text(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


def test_unknown_schedule_name_lists_valid_names() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'zigzag'") as info:
        build_schedule("zigzag", 2, 4)
    assert "1f1b" in str(info.value) and "gpipe" in str(info.value)


def test_build_schedule_by_name() -> None:
    assert build_schedule("1f1b", 4, 8).table() == one_f_one_b(4, 8).table()


def test_schedules_package_does_not_import_torch() -> None:
    code = "import sys, pipeflow.schedules; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- generators


def test_one_f_one_b_table_p4_m8() -> None:
    #                  warm-up        | steady 1F1B                             | drain
    assert one_f_one_b(4, 8).table().splitlines() == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ]


def test_gpipe_table_p2_m3() -> None:
    assert gpipe(2, 3).table().splitlines() == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]


@pytest.mark.parametrize("bad", [(0, 4), (2, 0)])
def test_generators_refuse_empty_sizes(bad: tuple[int, int]) -> None:
    with pytest.raises(ScheduleError, match="at least 1"):
        one_f_one_b(*bad)


# ----------------------------------------------------------------------------- lowering


def test_lowering_1f1b_p2_m2_literal() -> None:
    rank0, rank1 = lower(one_f_one_b(2, 2))
    assert rank0 == [
        Step((), Action.parse("0F0")),
        Step((send(ACTIVATION, 0, 0, 1, 1),), Action.parse("0F1")),
        Step((send(ACTIVATION, 1, 0, 1, 1), recv(GRADIENT, 0, 1, 0, 1)), Action.parse("0B0")),
        Step((recv(GRADIENT, 1, 1, 0, 1),), Action.parse("0B1")),
    ]
    assert rank1 == [
        Step((recv(ACTIVATION, 0, 0, 1, 0),), Action.parse("1F0")),
        Step((), Action.parse("1B0")),
        Step((send(GRADIENT, 0, 1, 0, 0), recv(ACTIVATION, 1, 0, 1, 0)), Action.parse("1F1")),
        Step((), Action.parse("1B1")),
        Step((send(GRADIENT, 1, 1, 0, 0),), None),  # flush: the sends of the last action
    ]


def channel_sequences(programs: list[Program]) -> dict[tuple[int, int, str], list[CommOp]]:
    """The ops posted on each directed channel (src rank, dst rank, send|recv), in program order."""
    sequences: dict[tuple[int, int, str], list[CommOp]] = defaultdict(list)
    for r, program in enumerate(programs):
        for step in program:
            for op in step.ops:
                src, dst = (r, op.peer) if op.is_send else (op.peer, r)
                sequences[src, dst, op.op].append(op)
    return sequences


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b, forward_only])
def test_lowering_pairs_every_send_with_its_recv_in_order(generator) -> None:
    for p in range(1, 6):
        for m in range(1, 7):
            sequences = channel_sequences(lower(generator(p, m)))
            for (src, dst, kind), ops in sequences.items():
                if kind == "send":
                    recvs = sequences[src, dst, "recv"]
                    assert len(ops) == len(recvs)
                    assert all(a.matches(b) for a, b in zip(ops, recvs))


# ----------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b, forward_only])
def test_every_schedule_simulates_complete_and_deadlock_free(generator) -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            schedule = generator(p, m)
            result = validate(schedule)
            assert isinstance(result, SimResult)
            assert len(result.timeline) == sum(len(acts) for acts in schedule.actions)


@pytest.mark.parametrize("generator", TRAINING_GENERATORS)
def test_bubble_and_makespan_match_the_formula(generator) -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            result = simulate(generator(p, m), costs={"F": 1.0, "B": 1.0, "W": 1.0})
            assert math.isclose(result.bubble, (p - 1) / (m + p - 1)), (p, m)
            assert math.isclose(result.makespan, (m + p - 1) * 3), (p, m)
            assert result.busy == [3.0 * m] * p


def test_peak_activations() -> None:
    for p in range(1, 9):
        for m in range(1, 17):
            assert simulate(one_f_one_b(p, m)).peak_activations == [min(p - r, m) for r in range(p)]
            assert simulate(gpipe(p, m)).peak_activations == [m] * p
            assert simulate(forward_only(p, m)).peak_activations == [0] * p


def test_forward_only_interleaved_placement() -> None:
    schedule = forward_only(2, 3, stage_to_rank=(0, 1, 0, 1))
    result = validate(schedule)
    assert result.busy == [6.0, 6.0]
    assert result.timeline[0][:2] == (0, Action.parse("0F0"))


def test_forward_only_makespan() -> None:
    assert simulate(forward_only(4, 8)).makespan == 8 + 4 - 1


def test_costs_mapping_callable_and_latency() -> None:
    schedule = gpipe(1, 2)
    assert simulate(schedule, costs={"F": 2.0}).makespan == 2 * 2 + 2 * (1 + 1)
    assert simulate(schedule, costs=lambda a: 3.0 if a.kind == "F" else 0.5).makespan == 8.0
    base, slow = simulate(gpipe(2, 2)), simulate(gpipe(2, 2), comm_latency=0.5)
    assert slow.makespan > base.makespan


def test_timeline_is_sorted_and_non_overlapping_per_rank() -> None:
    result = simulate(one_f_one_b(4, 8))
    assert [entry[2] for entry in result.timeline] == sorted(entry[2] for entry in result.timeline)
    for r in range(4):
        spans = [(start, end) for rank, _, start, end in result.timeline if rank == r]
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:]))


def split_backward_schedule() -> PipelineSchedule:
    """p = 2, m = 2 with B split into B (input grads) and W (weight grads)."""
    actions = [
        parse_actions("0F0 0F1 0B0 0B1 0W0 0W1"),
        parse_actions("1F0 1F1 1B0 1W0 1B1 1W1"),
    ]
    return PipelineSchedule("split", 2, 2, 2, (0, 1), actions)


def test_split_backward_schedule() -> None:
    result = validate(split_backward_schedule())
    assert result.peak_activations == [2, 2]
    assert result.busy == [6.0, 6.0]


def test_backward_weights_inconsistent_with_w() -> None:
    schedule = split_backward_schedule()
    programs = lower(schedule)
    step = programs[0][2]
    programs[0][2] = Step(step.ops, step.action, backward_weights=True)
    with pytest.raises(ScheduleError, match="rank 0 step 2: 0B0 has backward_weights=True"):
        simulate(schedule, programs)


# ----------------------------------------------------------------------------- broken programs


def test_swapped_recvs_of_different_microbatches_is_a_misorder() -> None:
    schedule = one_f_one_b(4, 4)
    programs = lower(schedule)
    first, second = programs[1][1], programs[1][2]  # rank 1: recv act1 for 1F1, act2 for 1F2
    programs[1][1] = Step((first.ops[0], second.ops[1]), first.action)
    programs[1][2] = Step((second.ops[0], first.ops[1]), second.action)
    with pytest.raises(ScheduleError, match="misordered") as info:
        simulate(schedule, programs)
    message = str(info.value)
    assert not isinstance(info.value, DeadlockError)
    assert "rank 0 step 2" in message and "rank 1 step 1" in message
    assert "micro-batch 1" in message and "micro-batch 2" in message


def test_swapped_steps_are_rejected() -> None:
    schedule = one_f_one_b(4, 4)
    programs = lower(schedule)
    programs[1][2], programs[1][3] = programs[1][3], programs[1][2]  # 1B0 before 1F2
    with pytest.raises(ScheduleError, match="rank 1 step 2"):
        simulate(schedule, programs)


def test_backward_before_forward_deadlocks_with_grid() -> None:
    schedule = one_f_one_b(4, 4)
    schedule.actions[1] = parse_actions("1F0 1B0 1F1 1F2 1F3 1B1 1B2 1B3")
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    grid = info.value.grid
    assert "[1B0]" in grid and "[0F2]" in grid
    assert all(f"rank {r}" in grid for r in range(4))
    assert "recv gradient of micro-batch 0 from stage 2 (rank 2)" in grid
    assert grid in str(info.value)


def test_deadlock_grid_of_long_programs_shows_a_window() -> None:
    schedule = gpipe(2, 16)
    actions = schedule.actions[1]
    actions.insert(10, actions.pop(16))  # 1B0 before 1F10
    validate(schedule)  # lower() posts 0's recv of grad 0 early: no deadlock
    with pytest.raises(DeadlockError) as info:  # the plain pairing deadlocks
        simulate(schedule, pairing_lower(schedule))
    table = info.value.grid.splitlines()[:3]
    assert table[0].split()[:3] == ["step", "...", "8"]
    assert "[1F10]" in table[2] and "[0F12]" in table[1]
    assert all(row.endswith("...") for row in table)


def test_action_without_its_input_is_caught() -> None:
    schedule = gpipe(2, 1)
    programs = lower(schedule)
    programs[0][1] = Step(programs[0][1].ops[1:], programs[0][1].action)  # drop send act0
    programs[1][0] = Step((), programs[1][0].action)  # drop recv act0
    with pytest.raises(ScheduleError, match="rank 1 step 0: 1F0 runs before 0F0"):
        simulate(schedule, programs)


def test_leftover_unmatched_ops() -> None:
    schedule = one_f_one_b(2, 2)
    programs = lower(schedule)
    del programs[1][-1]  # the flush of grad 1
    with pytest.raises(ScheduleError, match="left over") as info:
        simulate(schedule, programs)
    assert "rank 0 step 3: recv gradient of micro-batch 1" in str(info.value)


def test_missing_action() -> None:
    schedule = one_f_one_b(2, 3)
    schedule.actions[1].remove(Action.parse("1B2"))
    with pytest.raises(ScheduleError, match=r"missing 1B2 \(stage 1 is on rank 1\)"):
        simulate(schedule)


def test_duplicated_action() -> None:
    schedule = gpipe(2, 2)
    schedule.actions[0].append(Action.parse("0F1"))
    with pytest.raises(ScheduleError, match="0F1 appears 2 times: rank 0 step 1, rank 0 step 4"):
        simulate(schedule)


def test_action_on_the_wrong_rank() -> None:
    schedule = gpipe(2, 2)
    schedule.actions[1].append(Action.parse("0W0"))
    with pytest.raises(ScheduleError, match="stage 0 belongs to rank 0"):
        simulate(schedule)


def test_microbatch_out_of_range() -> None:
    schedule = gpipe(2, 2)
    schedule.actions[0].append(Action.parse("0F5"))
    with pytest.raises(ScheduleError, match="micro-batch 5 out of range 0..1"):
        simulate(schedule)


def test_forward_only_refuses_backward() -> None:
    schedule = forward_only(2, 2)
    schedule.actions[0].append(Action.parse("0B0"))
    with pytest.raises(ScheduleError, match="forward-only"):
        simulate(schedule)


def test_wrong_number_of_programs() -> None:
    with pytest.raises(ScheduleError, match="1 programs for 2 ranks"):
        simulate(gpipe(2, 2), lower(gpipe(1, 2)))
