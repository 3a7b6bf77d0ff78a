"""parallel.shard=full without processes: the shard points of lowered programs, the simulator's
account of them, and the FSDP2 internals the runtime relies on (tests/test_scale.py trains)."""
from __future__ import annotations

import dataclasses

import pytest

from pipeflow.errors import ConfigError, ScheduleError
from pipeflow.schedules import build_schedule, forward_only, lower, simulate
from pipeflow.schedules.ir import BACKWARD, WEIGHT, Step
from pipeflow.schedules.lowering import POSTINGS

SCHEDULES = [  # (name, p, m, stages per rank, placement)
    ("gpipe", 4, 6, 1, "loop"),
    ("1f1b", 4, 8, 1, "loop"),
    ("interleaved_1f1b", 2, 4, 2, "loop"),
    ("zb_h1", 4, 8, 1, "loop"),
    ("zbv", 2, 4, 2, "v"),
    ("dualpipev", 2, 4, 2, "v"),
]


def _schedule(name: str, p: int, m: int, v: int, placement: str):
    return build_schedule(name, p, m, v, placement, None, None)


@pytest.mark.parametrize("posting", POSTINGS)
@pytest.mark.parametrize("name,p,m,v,placement", SCHEDULES)
def test_each_stage_is_unsharded_at_its_first_action_and_resharded_after_its_last(name, p, m, v, placement, posting):
    schedule = _schedule(name, p, m, v, placement)
    plain, sharded = lower(schedule, posting), lower(schedule, posting, shard=True)
    for r, (program, marked) in enumerate(zip(plain, sharded)):
        assert all(not step.unshard and not step.reshard for step in program)  # programs without sharding unchanged
        # the same steps and transfers: only the shard points differ (and a last step to reshard in)
        stripped = [dataclasses.replace(step, unshard=(), reshard=()) for step in marked]
        assert stripped[: len(program)] == program
        assert stripped[len(program):] in ([], [Step((), None)])
        acting = {}
        for k, step in enumerate(marked):
            if step.action is not None:
                acting.setdefault(step.action.stage, []).append(k)
        assert sorted(acting) == schedule.stages_of(r)
        for s, steps in acting.items():
            assert [k for k, step in enumerate(marked) if s in step.unshard] == [steps[0]], (r, s)
            assert [k for k, step in enumerate(marked) if s in step.reshard] == [steps[-1] + 1], (r, s)
            last = marked[steps[-1]]
            assert last.action.kind == WEIGHT or (last.action.kind == BACKWARD and last.backward_weights), (
                f"rank {r}: stage {s} reduces its gradients before its last weight gradient")


def test_forward_only_programs_get_shard_points_too() -> None:
    programs = lower(forward_only(2, 3), "ahead", shard=True)
    assert [(step.unshard, step.reshard) for step in programs[0]] == [((0,), ()), ((), ()), ((), ()), ((), (0,))]
    assert [(step.unshard, step.reshard) for step in programs[1]] == [((1,), ()), ((), ()), ((), ()), ((), (1,))]


def test_a_step_prints_its_shard_points() -> None:
    program = lower(_schedule("1f1b", 2, 2, 1, "loop"), shard=True)[0]
    assert str(program[0]).startswith("unshard[0] [")
    assert str(program[-2]).endswith("0B1") and str(program[-1]) == "reshard[0] [] -"
    assert "shard" not in str(lower(_schedule("1f1b", 2, 2, 1, "loop"))[0][0])


@pytest.mark.parametrize("name,p,m,v,placement", SCHEDULES)
def test_simulator_accounts_for_gathers_and_reductions(name, p, m, v, placement) -> None:
    schedule = _schedule(name, p, m, v, placement)
    plain = simulate(schedule, posting="ahead")
    free = simulate(schedule, posting="ahead", shard=True)
    costly = simulate(schedule, posting="ahead", shard=True, shard_cost=0.5)
    assert plain.peak_unsharded == [0] * p
    assert free.peak_unsharded == costly.peak_unsharded == [v] * p  # every stage of a rank gathered at once
    assert free.makespan == plain.makespan and free.busy == plain.busy  # the points move no transfer
    assert costly.busy == plain.busy
    # at least rank 0's first gather and the last rank's last reduction lie on the critical path
    assert costly.makespan >= plain.makespan + 2 * 0.5 - 1e-12


def test_a_reduction_does_not_hold_back_the_gradient_it_follows() -> None:
    """1F1B, p = 2, m = 1, unit costs (a full B is B + W = 2), gathers and reductions of 0.5:
    rank 0 gathers (0.5) and runs F (1); rank 1 has gathered meanwhile, runs F (1) and B (2),
    posts the gradient for rank 0 and only then reduces (0.5, beside rank 0's B); rank 0 runs
    B (2) and reduces (0.5): 0.5 + 1 + 1 + 2 + 2 + 0.5 = 7, one more than without sharding."""
    result = simulate(_schedule("1f1b", 2, 1, 1, "loop"), shard=True, shard_cost=0.5)
    assert result.makespan == 7.0
    assert simulate(_schedule("1f1b", 2, 1, 1, "loop")).makespan == 6.0
    assert result.peak_unsharded == [1, 1]
    assert sorted(result.shard_timeline) == [(0, "reshard 0", 6.5, 7.0), (0, "unshard 0", 0.0, 0.5),
                                             (1, "reshard 1", 4.5, 5.0), (1, "unshard 1", 0.0, 0.5)]
    assert simulate(_schedule("1f1b", 2, 1, 1, "loop")).shard_timeline == []


def test_show_draws_the_simulated_gathers_and_reductions(tmp_path) -> None:
    import matplotlib.image
    import numpy as np

    from pipeflow.schedules.show import main, parse_args

    assert parse_args(["schedule=zbv", "parallel.shard=full", "costs.shard=0.5"]) == {
        "name": "zbv", "shard": "full", "shard_cost": 0.5}
    purple = np.array([0x94, 0x67, 0xBD]) / 255  # matplotlib's tab:purple
    for shard, expected in (("full", True), ("none", False)):
        out = tmp_path / f"{shard}.png"
        assert main(["schedule=zbv", "parallel.pp=2", "pipeline.num_microbatches=4", f"parallel.shard={shard}",
                     "costs.shard=0.5", f"--out={out}"]) == 0
        image = matplotlib.image.imread(out)[..., :3]
        assert ((np.abs(image - purple).max(axis=-1) < 0.02).sum() > 50) == expected, shard


def test_simulator_rejects_misplaced_shard_points() -> None:
    schedule = _schedule("1f1b", 2, 4, 1, "loop")
    programs = lower(schedule, shard=True)
    late = [dataclasses.replace(step, unshard=()) for step in programs[0]]
    late[1] = dataclasses.replace(late[1], unshard=(0,))  # gathered after its first action ran
    with pytest.raises(ScheduleError, match=r"(?s)misplaced shard points.*rank 0: stage 0 is unsharded at steps \[1\]"):
        simulate(schedule, [late, programs[1]])
    twice = list(programs[1])
    twice[2] = dataclasses.replace(twice[2], reshard=(1,))  # resharded before its last action, and twice
    with pytest.raises(ScheduleError, match=r"rank 1: stage 1 is resharded at steps \[2, \d+\]; expected once, after"):
        simulate(schedule, [programs[0], twice])
    stray = list(programs[1])
    stray[0] = dataclasses.replace(stray[0], unshard=(1, 0))  # stage 0 lives on rank 0
    with pytest.raises(ScheduleError, match="rank 1: stage 0 has shard points"):
        simulate(schedule, [programs[0], stray])


def test_the_fsdp2_internals_pipeflow_relies_on_exist_in_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """pipeflow reduces FSDP2 gradients once per step through FSDP2 internals (as
    torch.distributed.pipelining does); this fails when a torch version drops or renames them."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from pipeflow.runtime.parallel.fsdp import check_internals

    check_internals()
    monkeypatch.delattr(FSDPState, "_root_post_backward_final_callback")
    with pytest.raises(ConfigError, match=r"shard=full needs FSDP2 internals .*_root_post_backward_final_callback"):
        check_internals()


def _traced_with_shard_points() -> list:
    """One traced step of 1F1B on 2 ranks as the pipeline records it with parallel.shard=full."""
    from pipeflow.runtime.events import SHARD

    timed = [[(SHARD, "unshard 0", 0.0, 0.5), ("F", "0F0", 0.5, 1.5), ("comm", "recv", 1.5, 3.0), ("B", "0B0", 3.0, 5.0),
              (SHARD, "reduce-scatter + reshard 0", 5.0, 5.5)],
             [(SHARD, "unshard 1", 0.0, 0.5), ("comm", "recv", 0.5, 1.5), ("F", "1F0", 1.5, 2.0), ("B", "1B0", 2.0, 3.0),
              (SHARD, "reduce-scatter + reshard 1", 3.0, 3.5)]]
    return [(r, 0.0, 6.0, [(k, n, s / 1e3, e / 1e3) for k, n, s, e in events]) for r, events in enumerate(timed)]


def test_the_trace_shows_gathers_and_reductions_and_counts_them_as_communication(tmp_path) -> None:
    import matplotlib.image
    import numpy as np

    from pipeflow.observability.figures import step_figures
    from pipeflow.observability.trace import chrome_trace, draw_step
    from pipeflow.runtime.events import TimedEvent

    per_rank = _traced_with_shard_points()
    events = [e for e in chrome_trace({1: per_rank})["traceEvents"] if e["ph"] == "X" and e["cat"] == "shard"]
    assert sorted((e["pid"], e["name"]) for e in events) == [
        (0, "reduce-scatter + reshard 0"), (0, "unshard 0"), (1, "reduce-scatter + reshard 1"), (1, "unshard 1")]
    figures = step_figures([TimedEvent(*e) for e in per_rank[0][3]], 0.0, 6e-3)
    assert figures.comm_wait_s == pytest.approx(2.5e-3) and figures.compute_s == pytest.approx(3e-3)
    image = matplotlib.image.imread(draw_step(per_rank, 2, "shard=full", str(tmp_path / "step.png")))[..., :3]
    purple = np.array([0x94, 0x67, 0xBD]) / 255  # matplotlib's tab:purple
    assert (np.abs(image - purple).max(axis=-1) < 0.02).sum() > 50
    plain = [(r, s, e, [t for t in timed if t[0] != "shard"]) for r, s, e, timed in per_rank]
    image = matplotlib.image.imread(draw_step(plain, 2, "shard=none", str(tmp_path / "plain.png")))[..., :3]
    assert (np.abs(image - purple).max(axis=-1) < 0.02).sum() == 0
