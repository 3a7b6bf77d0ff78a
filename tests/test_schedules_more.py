"""The schedules users reach for: every generator swept through the simulator, closed forms,
the deadlock-free lowering, custom schedule files, the timeline pictures and the configs.

Costs are the simulator's defaults, F = B = W = 1 (a full backward, no W after it, costs 2).
p = ranks, v = stages per rank, m = micro-batches, r = rank.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import warm
import yaml

from pipeflow.errors import DeadlockError, ScheduleError
from pipeflow.schedules import (
    GENERATORS,
    LAYOUTS,
    Action,
    PipelineSchedule,
    SimResult,
    build_schedule,
    interleaved_1f1b,
    load_schedule,
    loop_placement,
    lower,
    one_f_one_b,
    simulate,
    v_placement,
)
from pipeflow.schedules.lowering import recvs_needed
from pipeflow.schedules.compare import compare, markdown
from pipeflow.schedules.timing import asap
from plain_pairing import pairing_lower

ROOT = Path(__file__).resolve().parent.parent
RANKS, CHUNKS, MICRO = range(1, 9), range(1, 5), range(1, 25)


class Simulated(NamedTuple):
    """What the sweeps read of a simulation: a :class:`SimResult`'s figures, its timeline counted."""

    makespan: float
    busy: list[float]
    bubble: float
    peak_activations: list[int]
    actions: int  # entries of the timeline


def simulate_one(name: str, p: int, v: int, m: int) -> Simulated | None:
    """The simulated figures, or None when build_schedule refuses the combination."""
    try:
        schedule = build_schedule(name, p, m, stages_per_rank=v)
    except ScheduleError:
        return None
    result = simulate(schedule)
    return Simulated(result.makespan, result.busy, result.bubble, result.peak_activations, len(result.timeline))


_SIMULATED: dict[tuple[str, int, int, int], Simulated | None] = {}
_POOL: list = []  # two warm processes, started on first use and closed with the module


@pytest.fixture(scope="module", autouse=True)
def _close_pool() -> Iterator[None]:
    yield
    while _POOL:
        _POOL.pop().terminate()
    _SIMULATED.clear()


def run(name: str, p: int, v: int, m: int) -> Simulated | None:
    """:func:`simulate_one`, kept.  The first call for a schedule simulates its whole grid (the
    combinations :func:`simulated` keeps) on two warm processes (tests/warm.py): the simulator
    is pure Python, and the sweep would leave one of the two cores idle for a minute."""
    key = (name, p, v, m)
    if key not in _SIMULATED and simulated(name, v, m) and p in RANKS and v in CHUNKS and m in MICRO:
        grid = [(name, p_, v_, m_) for p_ in RANKS for v_ in CHUNKS for m_ in MICRO if simulated(name, v_, m_)]
        if not _POOL:
            _POOL.append(warm.context().Pool(2))
        _SIMULATED.update(zip(grid, _POOL[0].starmap(simulate_one, grid, chunksize=8)))
    if key not in _SIMULATED:
        _SIMULATED[key] = simulate_one(*key)
    return _SIMULATED[key]


def accepts(name: str, p: int, v: int, m: int) -> bool:
    """Which combinations each schedule is meant to take."""
    if name == "dualpipev":
        return v == 2 and m >= 2 * p
    if name in ("zbv", "v_half", "v_min"):
        return v == 2
    return name in ("looped_bfs", "interleaved_1f1b", "interleaved_zb", "auto") or v == 1


def idle(result: SimResult | Simulated) -> float:
    return len(result.busy) * result.makespan - sum(result.busy)


# ----------------------------------------------------------------------------- the sweep


def simulated(name: str, v: int, m: int) -> bool:
    """The whole grid is simulated, except for the largest programs (several chunks per rank:
    looped BFS and the interleaved ones with v >= 3), for which m runs over 1..8, 12, 16, 24,
    and auto, which simulates every built-in to choose: v = 1, 2 with m over 1..6, 8, 12, 24, and
    v = 3, 4 at m = 1 (tests/test_auto_schedule.py has its claims).  Keeps the sweep within ~1 min."""
    if name == "auto":
        return (v <= 2 and (m <= 6 or m in (8, 12, 24))) or m == 1
    if name in ("looped_bfs", "interleaved_1f1b", "interleaved_zb"):
        return v < 3 or m <= 8 or m in (12, 16, 24)
    return True


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_sweep_every_accepted_combination_is_valid(name: str) -> None:
    """p 1..8, v 1..4, m 1..24: accepted ones simulate complete, ordered and deadlock-free."""
    for p in RANKS:
        for v in CHUNKS:
            for m in MICRO:
                if not simulated(name, v, m):
                    if name == "auto":  # building it is simulating it
                        continue
                    try:
                        build_schedule(name, p, m, stages_per_rank=v)
                    except ScheduleError:
                        pytest.fail(f"{name} refused p={p} v={v} m={m}")
                    continue
                result = run(name, p, v, m)
                assert (result is not None) == accepts(name, p, v, m), (name, p, v, m)
                if result is not None:  # simulate() raised on anything incomplete or stuck
                    split = name in ("zb_h1", "zb_h2", "zbv", "interleaved_zb", "v_half", "v_min")  # all split
                    assert result.actions >= (3 if split else 2) * p * v * m
                    assert result.busy == [3.0 * v * m] * p


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_rejections_name_the_valid_values(name: str) -> None:
    needed, _ = LAYOUTS[name]
    if needed is not None:
        with pytest.raises(ScheduleError, match=f"schedule.stages_per_rank={needed}"):
            build_schedule(name, 4, 8, stages_per_rank=needed + 1)
    with pytest.raises(ScheduleError, match="at least 1"):
        build_schedule(name, 0, 8)


def test_specific_rejections() -> None:
    with pytest.raises(ScheduleError, match=r"at least 2p = 8 micro-batches.*valid.*8, 9"):
        build_schedule("dualpipev", 4, 7)
    with pytest.raises(ScheduleError, match="cannot use schedule.placement=v; it needs: loop"):
        build_schedule("1f1b", 4, 8, placement="v")
    with pytest.raises(ScheduleError, match="cannot use schedule.placement=loop; it needs: v"):
        build_schedule("zbv", 4, 8, placement="loop")
    with pytest.raises(ScheduleError, match="unknown placement 'zigzag'; valid: loop, v"):
        build_schedule("zbv", 4, 8, placement="zigzag")
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'") as info:
        build_schedule("zb", 4, 8)
    assert all(name in str(info.value) for name in list(GENERATORS) + ["custom"])


def test_build_schedule_defaults_and_old_positional_calls() -> None:
    assert build_schedule("1f1b", 4, 8).table() == one_f_one_b(4, 8).table()
    assert build_schedule("zbv", 4, 8).num_stages == 8  # v = 2 needed, picked by default
    assert build_schedule("interleaved_1f1b", 4, 8).num_stages == 8  # v = 2 by default
    assert build_schedule("looped_bfs", 2, 3, 3, "loop").stage_to_rank == loop_placement(2, 3)


@pytest.mark.parametrize(
    "name, p, m, table",
    [
        ("interleaved_1f1b", 2, 4, [
            "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
            "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
        ]),
        ("looped_bfs", 2, 2, ["0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0", "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0"]),
        ("interleaved_zb", 2, 2, [  # torch's ScheduleInterleavedZeroBubble order (ZB1P)
            "0F0 0F1 2F0 2F1 2B0 2W0 2B1 2W1 0B0 0W0 0B1 0W1",
            "1F0 1F1 3F0 3B0 3F1 3B1 3W0 1B0 3W1 1B1 1W0 1W1",
        ]),
        ("zb_h1", 3, 4, [  # rank r holds back its first r Ws
            "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
            "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
            "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
        ]),
        ("zbv", 2, 4, [
            "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 "
            "0B2 0W2 0B3 0W3",
            "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 "
            "1B3 1W2 2W3 1W3",
        ]),
        ("dualpipev", 2, 4, [  # "F then B" pairs are DualPipe's overlapped chunks
            "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0B2 0W2 0B3 0W3",
            "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 1W3",
        ]),
    ],
)
def test_tables(name: str, p: int, m: int, table: list[str]) -> None:
    assert build_schedule(name, p, m).table().splitlines() == table


def test_placements() -> None:
    assert loop_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert v_placement(2, 4) == (0, 1, 1, 0, 0, 1, 1, 0)
    assert build_schedule("dualpipev", 3, 6).stage_to_rank == v_placement(3)


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble(name: str) -> None:
    for p in RANKS:
        for m in MICRO:
            assert math.isclose(run(name, p, 1, m).bubble, (p - 1) / (m + p - 1)), (p, m)


def test_peak_activations_gpipe_1f1b() -> None:
    for p in RANKS:
        for m in MICRO:
            assert run("1f1b", p, 1, m).peak_activations[0] == min(p, m)
            assert run("gpipe", p, 1, m).peak_activations == [m] * p


def test_interleaved_bubble() -> None:
    """Megatron's (p - 1) / (v m + p - 1): makespan 3 (v m + p - 1), for every m >= p, a
    multiple of p or not; below p, 3 (v - 1)(p - m) more (each chunk waits for the pipe)."""
    for p in RANKS:
        for v in CHUNKS:
            for m in filter(lambda m: simulated("interleaved_1f1b", v, m), MICRO):
                result = run("interleaved_1f1b", p, v, m)
                assert result.makespan == 3 * (v * m + p - 1) + 3 * (v - 1) * max(0, p - m), (p, v, m)
                if m >= p:
                    assert math.isclose(result.bubble, (p - 1) / (v * m + p - 1))


def test_interleaved_takes_every_count_torch_takes() -> None:
    """torch's flexible interleaving takes m with m % max(1, m // p) == 0 (p = 4: 1..8, 10, 12,
    ...); pipeflow takes those and every other m (uneven groups, larger first)."""
    from pipeflow.schedules.interleaved import group_sizes

    torch_counts = [m for m in MICRO if m % max(1, m // 4) == 0]
    assert torch_counts[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    for m in torch_counts:  # where torch takes it, the same groups as torch's rounds
        assert group_sizes(4, m) == [m // max(1, m // 4)] * max(1, m // 4)
    assert group_sizes(4, 9) == [5, 4] and group_sizes(4, 14) == [5, 5, 4]
    assert build_schedule("interleaved_1f1b", 4, 3).table().splitlines()[3] == (
        "3F0 3F1 3F2 7F0 7B0 7F1 7B1 7F2 7B2 3B0 3B1 3B2"
    )


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for p, m in [(1, 3), (4, 8), (3, 7)]:
        assert interleaved_1f1b(p, m, 1).table() == one_f_one_b(p, m).table()


def test_interleaved_zb_makespan_and_memory() -> None:
    """3vm + p - 1 for every m >= p: ZB-H1's p - 1 idle units per rank beside v times the work,
    v - 1 times fewer than interleaved 1F1B's; with one chunk it is ZB-H1 itself."""
    from pipeflow.schedules import interleaved_zb, zb_h1

    for p in RANKS:
        for v in CHUNKS:
            for m in filter(lambda m: simulated("interleaved_zb", v, m), range(p, 25)):
                result = run("interleaved_zb", p, v, m)
                assert result.makespan == 3 * v * m + p - 1, (p, v, m)
                if m % p == 0:  # 1F1B's p micro-batches of a rank's share on rank 0
                    assert result.peak_activations[0] == p * v, (p, v, m)
    for p, m in [(1, 3), (3, 4), (4, 9)]:
        assert interleaved_zb(p, m, 1).table() == zb_h1(p, m).table()


def test_zb_h2_memory_and_makespan() -> None:
    """At most 2p micro-batches on every rank; 3m + p - 1 (the loop bound) for m >= p with unit
    costs, like ZB-H1; below ZB-H1 where B costs more than W (F = B = 1, W = 0.5), m > p."""
    uneven = {"F": 1.0, "B": 1.0, "W": 0.5}
    for p in RANKS:
        for m in MICRO:
            result = run("zb_h2", p, 1, m)
            assert max(result.peak_activations) <= 2 * p, (p, m)
            if m >= p:
                assert result.makespan == 3 * m + p - 1, (p, m)
            if m > p > 1:
                h2 = simulate(build_schedule("zb_h2", p, m), costs=uneven).makespan
                assert h2 < simulate(build_schedule("zb_h1", p, m), costs=uneven).makespan, (p, m)
    assert max(run("zb_h2", 4, 1, 12).peak_activations) == 8  # the bound bites at m >= 3p


@pytest.mark.parametrize("name, bound", [("v_half", lambda p: p / 2 + 1), ("v_min", lambda p: math.ceil(p / 3) + 1)])
def test_controllable_memory_bounds(name: str, bound) -> None:
    """V-Half holds at most p/2 + 1, V-Min ceil(p/3) + 1 micro-batches of a rank's share (pairs / 2)
    on every rank, unit costs; V-Half within 1F1B's time once m >= 2p (V-Min pays a steady-state
    bubble where p is a multiple of 3, docs/explanation/simulator.md has its figures)."""
    for p in RANKS:
        for m in MICRO:
            result = run(name, p, 2, m)
            assert max(result.peak_activations) / 2 <= bound(p), (name, p, m, result.peak_activations)
            if m >= 2 * p and name == "v_half":  # 1F1B on the same work (a V stage is half a share)
                assert result.makespan <= 6 * (m + p - 1), (name, p, m)
    assert max(run("v_min", 8, 2, 24).peak_activations) / 2 == 4 < run("zbv", 8, 2, 24).peak_activations[0] / 2


def test_looped_bfs_makespan() -> None:
    """3 (v m + p - 1), plus 3 (v - 1)(p - m) when m < p: each chunk waits for the pipe to fill."""
    for p in RANKS:
        for v in CHUNKS:
            for m in filter(lambda m: simulated("looped_bfs", v, m), MICRO):
                extra = 3 * (v - 1) * max(0, p - m)
                assert run("looped_bfs", p, v, m).makespan == 3 * (v * m + p - 1) + extra


def test_zb_h1_idle_is_a_third_of_1f1b() -> None:
    """Idle time p (p - 1) against 1F1B's 3 p (p - 1), makespan 3m + p - 1, once m >= p.

    Peak: min(p, m) micro-batches between F and W on every rank, 1F1B's rank-0 peak.  A limit
    of p - r on rank r (1F1B's per-rank count) cannot give a third: the last rank could hold 1,
    so it would run F, B, W strictly in turn, finishing its last B at 3m + p - 2 or later; that
    gradient still needs p - 1 hops to rank 0 and a W there: makespan >= 3m + 2p - 2.
    """
    for p in RANKS:
        for m in MICRO:
            zb, plain = run("zb_h1", p, 1, m), run("1f1b", p, 1, m)
            assert zb.peak_activations == [min(p, m)] * p
            if m >= p:
                assert zb.makespan == 3 * m + p - 1
                assert 3 * idle(zb) == idle(plain) == 3 * p * (p - 1)
            else:  # too few micro-batches to fill the cool-down: 2 (m + p) - 1
                assert zb.makespan == 2 * (m + p) - 1


def test_zbv_attains_its_lower_bound() -> None:
    """Lower bound for any schedule on the V placement: makespan >= 6m + p - 1.

    Rank p - 1 holds stages p - 1 and p; its first action, F of micro-batch 0 on stage p - 1,
    needs the forwards of stages 0..p-2 first, one unit each, so it starts at p - 1 or later,
    and it has 6m units of work (F, B, W of m micro-batches on 2 stages).  ZB-V's makespan is
    max(6m + p - 1, 4m + 4p - 2): the bound itself once m >= (3p - 1) / 2 (so for every
    m >= 2p), a bubble of (p - 1) / (6m + p - 1), holding 2p stage-activations (p
    micro-batches' worth) per rank.  Fewer micro-batches cannot keep rank p - 1 busy.
    """
    for p in RANKS:
        for m in MICRO:
            result = run("zbv", p, 2, m)
            assert result.makespan == max(6 * m + p - 1, 4 * m + 4 * p - 2), (p, m)
            if m >= 2 * p:
                assert math.isclose(result.bubble, (p - 1) / (6 * m + p - 1))
                assert result.peak_activations == [2 * p] * p


def test_dualpipev_makespan() -> None:
    """6m + p - 1 + min(p - 1, (m - p) // 2); peak 2p + 1 stage-activations per rank.

    Without rendezvous (sends that never wait, the asap timing) it is exactly ZB-V's bound,
    6m + p - 1.  Under rendezvous, its 2-unit full backwards on neighbouring ranks are offset
    by one unit, so some transfers find no instant where both ranks are between actions: each
    such meeting costs one unit, at most p - 1 in all.
    """
    for p in RANKS:
        for m in range(2 * p, 25):
            result = run("dualpipev", p, 2, m)
            assert result.makespan == 6 * m + p - 1 + min(p - 1, (m - p) // 2), (p, m)
            assert result.peak_activations == [2 * p + 1] * p
            assert asap_makespan(build_schedule("dualpipev", p, m)) == 6 * m + p - 1


def test_dualpipev_marks_its_overlapped_pairs() -> None:
    """Issue 46: rank r's pairs are DeepSeek's overlapped chunks, (m - 2p + r + 1) rounds of two in
    the main phase and p - r - 1 after it, each an F then a full B of the rank's other stage."""
    for p in (2, 3, 4):
        for m in (2 * p, 2 * p + 3):
            schedule = build_schedule("dualpipev", p, m)
            split = schedule.split_backwards()
            for r, acts in enumerate(schedule.actions):
                pairs = schedule.pairs_of(r)
                assert len(pairs) == 2 * (m - 2 * p + r + 1) + p - r - 1
                for k in pairs:
                    f, b = acts[k], acts[k + 1]
                    assert (f.kind, b.kind) == ("F", "B") and f.stage != b.stage
                    assert (b.stage, b.microbatch) not in split  # a full backward
            assert build_schedule("zbv", p, m).pairs == ()


def test_overlapped_pairs_lower_deadlock_free_and_as_fast_without_exchanges() -> None:
    """Issue 46: every posting's programs with the pairs overlapped are proved deadlock-free as if
    every action had a communication point (the B waits for its inputs before its F ends), and
    without communication inside actions the step is exactly F-then-B's."""
    from pipeflow.schedules import validate

    for p in (2, 3, 4, 5):
        for m in range(2 * p, 2 * p + 4):
            schedule = build_schedule("dualpipev", p, m)
            for posting in ("rendezvous", "group", "at_step", "ahead"):
                programs = lower(schedule, posting, overlap=True)
                assert any(step.paired for program in programs for step in program)
                validate(schedule, programs)
                plain = simulate(schedule, posting=posting).makespan
                assert simulate(schedule, programs, posting=posting).makespan == plain, (p, m, posting)


def test_overlapped_pair_lowering_posts_the_b_inputs_at_the_pair_start() -> None:
    """A paired step waits only for the recvs its B consumes (posted when the pair starts:
    ``pair_posts``' first half); the F's sends go in the second half, waited after both, with the
    first step's ``after``."""
    from pipeflow.schedules.lowering import pair_posts

    schedule = build_schedule("dualpipev", 3, 8)
    for posting in ("rendezvous", "group", "at_step", "ahead"):
        for program in lower(schedule, posting, overlap=True):
            for k, step in enumerate(program):
                if not step.paired:
                    continue
                early, late = pair_posts(step)
                assert all(not op.is_send and op.consumer == step.action for op in step.waits)
                assert set(early) <= set(step.waits) and not set(early) & set(late)
                assert all(op.producer == program[k - 1].action for op in late if op.is_send)
                assert program[k - 1].after == ()
                assert all(op in step.after for op in late if op.is_send)


def test_overlapped_pair_hides_each_exchange_behind_the_other_compute() -> None:
    """The pair's timing (``overlapped_pair``): without communication the F then the B; with it
    each exchange runs while the other action computes, so the step with exchanges is shorter
    overlapped than F then B, and its prediction differs (issue 46)."""
    from pipeflow.schedules.sim_engine import RuntimeCosts, overlapped_pair

    assert overlapped_pair([1.0], [2.0]) == (1.0, 1.0, 3.0)
    # F: 0.5 compute, 1 exchange, 0.5 compute; B: 1, 1, 1.  F hands over at 0.5; B computes to 1.5,
    # starts its exchange (link free at 1.5), hands back; F's exchange done at 1.5: F ends at 2.0;
    # B's exchange ends at 2.5, B computes its last 1: 3.5 (4.5 one after the other)
    assert overlapped_pair([0.5, 1.0, 0.5], [1.0, 1.0, 1.0]) == (2.0, 0.5, 3.5)
    assert overlapped_pair([0.5, 1.0, 0.5], [1.0, 1.0, 1.0], second_ready=2.0)[1:] == (2.0, 5.0)
    schedule = build_schedule("dualpipev", 4, 10)
    runtime = RuntimeCosts(exchanges=lambda action: (0.6, 2) if action.kind in "FB" else (0.0, 0))
    overlapped = simulate(schedule, posting="ahead", runtime=runtime, overlap=True)
    sequential = simulate(schedule, posting="ahead", runtime=runtime)
    assert overlapped.makespan < 0.9 * sequential.makespan
    pairs = {(r, str(a)): (start, end) for r, a, start, end in overlapped.timeline}
    program = lower(schedule, "ahead", overlap=True)[0]
    first = next(k for k, step in enumerate(program) if step.paired)
    f, b = pairs[0, str(program[first - 1].action)], pairs[0, str(program[first].action)]
    assert b[0] < f[1] < b[1]  # drawn interleaved: the B started before its F ended
    # dense layers under NCCL's posting (a batch completes as a whole): the B's inputs, posted
    # when the pair starts, arrive during its F, and the F's sends no longer hold the B back
    dense = build_schedule("dualpipev", 4, 16)
    latency = {"posting": "group", "comm_latency": 0.3}
    assert simulate(dense, overlap=True, **latency).makespan < 0.97 * simulate(dense, **latency).makespan


def asap_makespan(schedule: PipelineSchedule) -> float:
    split = {(a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.kind == "W"}
    return max(span[1] for row in asap(schedule, split) for span in row if span)


# ----------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_lowering_is_the_plain_pairing_where_that_never_stalls(name: str) -> None:
    for p in RANKS:
        for m in range(1, 13):
            schedule = build_schedule(name, p, m)
            assert lower(schedule) == pairing_lower(schedule), (p, m)


@pytest.mark.parametrize(
    "name, p, m, v",
    [("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2), ("looped_bfs", 2, 4, 2),
     ("dualpipev", 2, 4, 2), ("zbv", 2, 4, 2), ("dualpipev", 4, 8, 2)],
)
def test_plain_pairing_fails_where_lower_does_not(name: str, p: int, m: int, v: int) -> None:
    """Deadlocks (a send waits on a recv its peer posts only after waiting on us) or misorders
    (p = 2 with V placement: activations and gradients share one channel)."""
    schedule = build_schedule(name, p, m, stages_per_rank=v)
    with pytest.raises(ScheduleError, match="deadlock|misordered"):
        simulate(schedule, pairing_lower(schedule))
    simulate(schedule)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_lowering_places_sends_after_producers_and_recvs_before_consumers(name: str) -> None:
    for p, m in [(1, 3), (2, 4), (3, 6), (4, 8)]:
        schedule = build_schedule(name, p, m)
        channels: dict[tuple[int, int, str], list] = defaultdict(list)
        for r, program in enumerate(lower(schedule)):
            done: set[Action] = set()
            received = set()
            for step in program:
                for op in step.ops:
                    if op.is_send:
                        producer = Action("F" if op.payload == "act" else "B", op.microbatch, op.src_stage)
                        assert producer in done, (name, p, m, r, op)
                        channels[r, op.peer, "send"].append(op)
                    else:
                        received.add(op)
                        channels[op.peer, r, "recv"].append(op)
                if step.action is not None:
                    assert set(recvs_needed(step.action, schedule)) <= received
                    done.add(step.action)
        for (src, dst, kind), ops in channels.items():
            if kind == "send":
                assert all(a.matches(b) for a, b in zip(ops, channels[src, dst, "recv"]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "interleaved_zb"])
def test_no_rank_ever_stalls_on_a_transfer(name: str) -> None:
    """The rendezvous makespan equals the asap one (sends that never wait) for these."""
    for p in range(1, 6):
        for m in (p, 2 * p, 2 * p + 1):
            try:
                schedule = build_schedule(name, p, m)
            except ScheduleError:  # dualpipev: m >= 2p
                continue
            assert simulate(schedule).makespan == asap_makespan(schedule), (p, m)


# ----------------------------------------------------------------------------- custom files

GOOD = """\
# p = 2, m = 2: 1F1B with the backward split
0F0 0F1 0B0 0W0 0B1 0W1   # rank 0
1F0 1B0 1W0 1F1 1B1 1W1   # rank 1
"""


def write(tmp_path: Path, text: str, name: str = "schedule.txt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_custom_text_file(tmp_path: Path) -> None:
    schedule = load_schedule(write(tmp_path, GOOD))
    assert (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) == (2, 2, 2)
    assert schedule.stage_to_rank == (0, 1)
    assert schedule.table() == "0F0 0F1 0B0 0W0 0B1 0W1\n1F0 1B0 1W0 1F1 1B1 1W1"
    assert build_schedule("custom", 2, 2, path=write(tmp_path, GOOD)).table() == schedule.table()


def test_custom_csv_file_with_v_placement(tmp_path: Path) -> None:
    rows = [
        "# a spreadsheet: empty cells align actions in time",
        "0F0,,,3F0,3B0,,,0B0",
        ",1F0,2F0,,,2B0,1B0,",
    ]
    schedule = load_schedule(write(tmp_path, "\n".join(rows), "zb.csv"))
    assert schedule.stage_to_rank == v_placement(2)
    assert build_schedule("custom", 2, 1, placement="v", path=tmp_path / "zb.csv")
    with pytest.raises(ScheduleError, match="not by schedule.placement=loop"):
        build_schedule("custom", 2, 1, placement="loop", path=tmp_path / "zb.csv")


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0 0X0\n1F0 1B0 0B0\n", r"schedule.txt:1: cannot parse action '0X0'"),
        ("0F0 0B0\n1F0 1B0 0W0\n", "stage 0 appears on rank 0 and on rank 1"),
        ("0F0 0B0\n2F0 2B0\n", r"stage\(s\) 1 appear on no rank"),
        ("0F0 0F1 0B0\n1F0 1B0 1F1 1B1\n", r"missing 0B1 \(stage 0 is on rank 0\)"),
        ("# nothing\n\n", "no actions"),
    ],
)
def test_custom_bad_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        load_schedule(write(tmp_path, text))
    assert "schedule.txt" in str(info.value)


def test_custom_deadlock_shows_the_grid(tmp_path: Path) -> None:
    path = write(tmp_path, "0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1\n")  # 0B0 before 0F1, GPipe on 1
    with pytest.raises(DeadlockError) as info:
        load_schedule(path)
    assert str(path) in str(info.value) and "[1F1]" in info.value.grid


def test_custom_needs_a_path_and_matching_sizes(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="schedule.path"):
        build_schedule("custom", 2, 2)
    with pytest.raises(ScheduleError, match="not found"):
        build_schedule("custom", 2, 2, path=tmp_path / "missing.txt")
    path = write(tmp_path, GOOD)
    with pytest.raises(ScheduleError, match=r"parallel.pp \(pipeline ranks\)=2, but 4"):
        build_schedule("custom", 4, 2, path=path)
    with pytest.raises(ScheduleError, match="pipeline.num_microbatches=2, but 8"):
        build_schedule("custom", 2, 8, path=path)
    with pytest.raises(ScheduleError, match="schedule.stages_per_rank=1, but 2"):
        build_schedule("custom", 2, 2, stages_per_rank=2, path=path)


# ----------------------------------------------------------------------------- pictures, configs


def test_show_draws_a_timeline(tmp_path: Path) -> None:
    from pipeflow.schedules.show import draw_timeline, main, parse_args

    settings = parse_args(["schedule=zbv", "pipeline.num_stages=2", "+pipeline.num_microbatches=4",
                           "costs.W=0.5", "--out", str(tmp_path / "z.png")])
    assert settings == {"name": "zbv", "ranks": 2, "microbatches": 4, "W": 0.5,
                        "out": str(tmp_path / "z.png")}
    assert main(["schedule=zbv", "parallel.pp=2", "pipeline.num_microbatches=4",
                 f"--out={tmp_path / 'z.png'}"]) == 0
    assert (tmp_path / "z.png").stat().st_size > 1000
    assert main(["schedule=zbv", "pipeline.stages_per_rank=3"]) == 2
    assert main(["pipeline.colour=red"]) == 2
    custom = write(tmp_path, GOOD)
    assert main(["schedule=custom", f"schedule.path={custom}", f"--out={tmp_path / 'c.png'}"]) == 0
    timeline = simulate(build_schedule("1f1b", 2, 2)).timeline
    assert draw_timeline(timeline, 2, "t", tmp_path / "t.svg").stat().st_size > 1000


def test_docs_pictures_and_configs_exist() -> None:
    for name in GENERATORS:
        assert (ROOT / "docs" / "schedules" / f"{name}.png").is_file(), name
    for name in list(GENERATORS) + ["custom"]:
        config = yaml.safe_load((ROOT / "configs" / "schedule" / f"{name}.yaml").read_text())
        assert config["name"] == name
    assert yaml.safe_load((ROOT / "configs" / "schedule" / "custom.yaml").read_text())["path"] == "???"


def test_compare_table_matches_the_closed_forms() -> None:
    rows = compare(4, [4, 8, 16])
    assert {r.name for r in rows} == set(GENERATORS)
    assert all(r.makespan == r.closed_form for r in rows if r.closed_form is not None)
    assert {r.name for r in rows if r.closed_form is None} == {"v_half", "v_min", "auto"}  # none known
    assert "| `zbv` | 4 | 2 | 8 | 51 |" in markdown(rows)


def test_a_schedule_registered_without_a_closed_form_is_compared_with_none() -> None:
    """A schedule declares its closed form (or none) where it is registered; compare needs no
    table of its own, shows "-" for none and reports no mismatch for it."""
    from pipeflow.schedules import LAYOUTS, SCHEDULES, register_schedule
    from pipeflow.schedules.compare import main

    @register_schedule("gpipe_unproven", stages_per_rank=1)
    def gpipe_unproven(num_ranks: int, num_microbatches: int):
        return GENERATORS["gpipe"](num_ranks, num_microbatches)

    try:
        assert GENERATORS["gpipe_unproven"] is gpipe_unproven and LAYOUTS["gpipe_unproven"] == (1, ("loop",))
        assert build_schedule("gpipe_unproven", 2, 4).num_stages == 2
        rows = [r for r in compare(4, [8]) if r.name == "gpipe_unproven"]
        assert len(rows) == 1 and rows[0].closed_form is None and rows[0].formula == "-"
        assert "| `gpipe_unproven` | 4 | 1 | 8 | 33 | - | 1.375 |" in markdown(rows)
        assert main(["--ranks", "4", "--microbatches", "8"]) == 0
        with pytest.raises(ScheduleError, match="already registered"):
            register_schedule("gpipe_unproven", stages_per_rank=1)(lambda p, m: None)
    finally:
        SCHEDULES.pop("gpipe_unproven")
    assert "gpipe_unproven" not in GENERATORS
