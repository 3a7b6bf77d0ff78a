"""pipeline.offload in the schedules layer: plans, marks in the lowered programs, their checks,
their timing in the simulator and their memory in the tensor-bytes walk (pure); the config key's check."""
from __future__ import annotations

import dataclasses

import pytest

from pipeflow.errors import ConfigError, ScheduleError
from pipeflow.schedules import build_schedule, lower
from pipeflow.schedules.ir import BACKWARD, FORWARD, Action
from pipeflow.schedules.memory import StageBytes, tensor_memory
from pipeflow.schedules.offload import HostLink, OffloadCosts, OffloadPlan, check_mode, group_bytes_of
from pipeflow.schedules.simulator import simulate, simulated_plan, validate

COSTS = {FORWARD: 1.0, BACKWARD: 2.0, "W": 1.0}


def _costs(schedule, bandwidth: float, overlapped: bool = True) -> OffloadCosts:
    return OffloadCosts(group_bytes_of([1.0] * schedule.num_stages), HostLink(bandwidth, bandwidth, 0.0, overlapped))


def _peaks(schedule, programs, timing=None) -> list[float]:
    stages = [StageBytes(0.0, 1.0, offloadable=1.0)] * schedule.num_stages
    return [m.peak.activations for m in tensor_memory(schedule, stages, programs=programs, timing=timing)]


def test_gpipe_one_rank_auto_offloads_every_group_whose_gap_hides_it():
    schedule = build_schedule("gpipe", 1, 8)
    costs = _costs(schedule, 2.0)  # a copy takes half an F
    plan = simulated_plan(schedule, "auto", costs, COSTS)
    programs = lower(schedule, offload=plan)
    sim = simulate(schedule, programs, COSTS, offload=costs)
    base = simulate(schedule, costs=COSTS)
    assert sim.makespan == pytest.approx(base.makespan)
    assert all(w == 0 for w in sim.reload_waits.values())
    # B0 follows F7: each group's copy back hides behind the action before its B
    assert plan.groups == {(0, i) for i in range(8)}
    assert plan.reloads[-1] == ((0, 0), Action(FORWARD, 7, 0))
    assert sim.offloaded_bytes == [8.0]
    assert _peaks(schedule, lower(schedule)) == [8.0]
    assert _peaks(schedule, programs, sim)[0] <= 3.0


def test_auto_on_a_link_beside_no_copy_engine_offloads_nothing_and_all_pays_for_every_copy():
    schedule = build_schedule("gpipe", 1, 4)
    costs = _costs(schedule, 4.0, overlapped=False)
    assert simulated_plan(schedule, "auto", costs, COSTS).reloads == ()
    plan = simulated_plan(schedule, "all", costs, COSTS)
    assert plan.groups == {(0, i) for i in range(4)}
    sim = simulate(schedule, lower(schedule, offload=plan), COSTS, offload=costs)
    # each group's copy out and back (0.25 each) takes the rank's own time
    assert sim.makespan == pytest.approx(simulate(schedule, costs=COSTS).makespan + 4 * 0.5)
    # reloaded right before its B
    assert all(action.kind == BACKWARD and action.microbatch == g[1] for g, action in plan.reloads)


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 8), ("gpipe", 2, 4), ("zbv", 4, 8), ("v_min", 2, 4),
                                      ("v_half", 2, 4), ("interleaved_1f1b", 2, 4), ("zb_h1", 4, 8),
                                      ("dualpipev", 2, 4), ("interleaved_zb", 2, 4)])
@pytest.mark.parametrize("bandwidth", [4.0, 0.5])
def test_every_schedule_auto_keeps_its_makespan_and_all_is_valid(name, p, m, bandwidth):
    schedule = build_schedule(name, p, m)
    costs = _costs(schedule, bandwidth)
    base = simulate(schedule, costs=COSTS)
    for posting in ("rendezvous", "ahead"):
        plan = simulated_plan(schedule, "auto", costs, COSTS, posting=posting)
        programs = lower(schedule, posting, offload=plan)
        validate(schedule, programs)
        sim = simulate(schedule, programs, COSTS, offload=costs)
        assert sim.makespan <= base.makespan * (1 + 1e-9)
        assert max(_peaks(schedule, programs, sim)) <= max(_peaks(schedule, lower(schedule, posting)))
        everything = simulated_plan(schedule, "all", costs, COSTS, posting=posting)
        assert len(everything.groups) == schedule.num_stages * m
        validate(schedule, lower(schedule, posting, offload=everything))
    if bandwidth == 4.0 and name in ("gpipe", "1f1b", "zbv"):
        assert plan.reloads, "a fast link hides some copies in every schedule with gaps"


def test_sharded_programs_take_the_marks_too():
    schedule = build_schedule("zbv", 2, 4)
    plan = simulated_plan(schedule, "all", _costs(schedule, 1.0), COSTS, shard=True)
    programs = lower(schedule, "ahead", shard=True, offload=plan)
    validate(schedule, programs)
    assert sum(len(step.offload) for program in programs for step in program) == schedule.num_stages * 4


def test_a_slow_link_frees_memory_later_in_the_timed_walk():
    schedule = build_schedule("gpipe", 1, 6)
    costs = _costs(schedule, 0.25)  # a copy out takes 4 F
    plan = simulated_plan(schedule, "all", costs, COSTS)
    programs = lower(schedule, offload=plan)
    sim = simulate(schedule, programs, COSTS, offload=costs)
    assert _peaks(schedule, programs, sim)[0] > _peaks(schedule, programs)[0]


def test_a_reload_issued_at_its_backward_delays_it_by_the_copy():
    schedule = build_schedule("gpipe", 1, 2)
    plan = OffloadPlan("all", (((0, 0), Action(BACKWARD, 0, 0)),))
    costs = OffloadCosts(lambda g: 3.0, HostLink(1.0, 1.5))
    sim = simulate(schedule, lower(schedule, offload=plan), COSTS, offload=costs)
    # 0F0 [0,1], its copy out [1,4]; 0F1 [1,2]; the reload issued at 2 starts when the copy out
    # ends (4) and takes 2: B0 (3 with its W) waits 4, then B1
    assert sim.reload_waits[(0, 0)] == pytest.approx(4.0)
    assert sim.makespan == pytest.approx(12.0)
    kinds = [kind for kind, *_ in sim.events[0]]
    assert "d2h" in kinds and "h2d" in kinds


@pytest.mark.parametrize("change,fragment", [
    (lambda steps: {0: dict(offload=((0, 1),))}, "not after its F"),
    (lambda steps: {len(steps) - 1: dict(reload=((0, 0),))}, "expected after its F"),
    (lambda steps: {1: dict(reload=((0, 0),)), 2: dict(reload=((0, 0),))}, "expected once each"),
])
def test_misplaced_marks_are_named(change, fragment):
    schedule = build_schedule("gpipe", 1, 2)  # 0F0 0F1 0B1 0B0
    plan = OffloadPlan("all", (((0, 0), Action(BACKWARD, 0, 0)),))
    program = lower(schedule, offload=plan)[0]
    program = [dataclasses.replace(step, reload=()) if step.reload else step for step in program]
    for k, fields in change(program).items():
        program[k] = dataclasses.replace(program[k], **fields)
    with pytest.raises(ScheduleError, match=fragment):
        validate(schedule, [program])


def test_mode_names_are_checked():
    assert check_mode("auto") == "auto"
    with pytest.raises(ConfigError, match="none, auto, all"):
        check_mode("some")


def test_all_without_known_bytes_still_takes_every_group_reloaded_at_its_backward():
    """Without profiles a group's bytes are unknown (0): ``all`` offloads every group anyway, each
    reloaded right before its B on a link without a copy engine; ``auto`` gains nothing."""
    schedule = build_schedule("1f1b", 2, 4)
    unknown = OffloadCosts(lambda g: 0.0, HostLink(1.0, 1.0, 0.0, overlapped=False))
    plan = simulated_plan(schedule, "all", unknown, COSTS)
    assert plan.groups == {(s, i) for s in range(2) for i in range(4)}
    assert all(action == Action(BACKWARD, g[1], g[0]) for g, action in plan.reloads)
    assert simulated_plan(schedule, "auto", OffloadCosts(lambda g: 0.0, HostLink(4.0, 4.0)), COSTS).reloads == ()


def test_an_unknown_offload_mode_is_a_config_error_at_start() -> None:
    from pipeflow.config.schema import check_config
    from pipeflow.commands.plan.command import compose_config

    with pytest.raises(Exception, match="pipeline.offload=sometimes") as info:  # a choice: refused composing
        compose_config(["pipeline.offload=sometimes"])
    assert "expected one of [none, auto, all]" in str(info.value.__cause__)
    assert check_config(compose_config(["pipeline.offload=auto"]), 4) == (1, 4)


def test_auto_under_a_memory_limit_adds_groups_the_gaps_do_not_hide_until_it_fits():
    """One GPipe rank, copies out fast and back slowly: auto hides 5 groups (peak 6 micro-batches);
    under a limit of 5 it adds the largest other group (slower, but it fits); under a limit
    nothing reaches it keeps the hidden groups alone."""
    schedule = build_schedule("gpipe", 1, 8)
    costs = OffloadCosts(lambda g: 1.0 + g[1] / 100, HostLink(4.0, 0.3))

    def predicted(plan):
        programs = lower(schedule, offload=plan)
        sim = simulate(schedule, programs, COSTS, offload=costs)
        return _peaks(schedule, programs, sim)[0], sim.makespan

    hidden = simulated_plan(schedule, "auto", costs, COSTS)
    assert len(hidden.groups) == 5 and predicted(hidden) == (pytest.approx(6.0, abs=0.1), 32.0)
    fitted = simulated_plan(schedule, "auto", costs, COSTS, fits=lambda p: predicted(p)[0] <= 5.1)
    assert fitted.groups > hidden.groups and len(fitted.groups) == 6
    assert predicted(fitted)[0] <= 5.1 and predicted(fitted)[1] > 32.0
    assert simulated_plan(schedule, "auto", costs, COSTS, fits=lambda p: False) == hidden
