"""In-run calibration (pipeflow.planning.calibration): the costs of a step recovered exactly from
a log the simulator wrote with known costs, and the calibrated prediction equal to that step."""
from __future__ import annotations

import math

import pytest

from dataclasses import asdict

from pipeflow.planning.calibration import (Calibration, RankStep, calibrate, on_rank0_clock, predict, simulated_log,
                                           which_posting)
from pipeflow.schedules import build_schedule, lower

NAN = math.nan


def known(name: str, p: int, m: int, v: int | None = None) -> tuple:
    """A schedule and costs with every term different: per stage F/B/W, per rank start, overhead
    and posting, a transfer latency and a per-byte cost over two payload sizes, a tail."""
    schedule = build_schedule(name, p, m, v)
    S = schedule.num_stages
    forward = [1e-3 * (s + 1) for s in range(S)]
    input_grad = [2e-3 + 1e-4 * s for s in range(S)]
    weight_grad = [5e-4 * (s + 1) for s in range(S)]
    full = [b + w for b, w in zip(input_grad, weight_grad)]
    boundary = [1000.0 * (1 + s) for s in range(S)]  # several sizes: latency and bandwidth both identifiable
    cal = Calibration(forward, input_grad, weight_grad, full, [1e-4 * r for r in range(p)],
                      [2e-5 * (r + 1) for r in range(p)], [3e-5 + 1e-6 * r for r in range(p)], 2e-4, 1e-7, 5e-3,
                      "ahead", boundary, 0, NAN, [])
    return schedule, cal


def log_of(schedule, cal: Calibration, posting: str, steps: int = 3) -> list[list[RankStep]]:
    programs = lower(schedule, posting)
    return [simulated_log(schedule, programs, cal.action_cost(schedule), cal.runtime(), cal.tail_s, origin=7.0 * n)
            for n in range(steps)]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-9) for a, b in zip(got, want))


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, None), ("zb_h1", 4, 8, None), ("interleaved_1f1b", 2, 4, 2),
                                        ("zbv", 2, 4, None), ("gpipe", 4, 8, None), ("dualpipev", 2, 4, None)])
def test_the_costs_of_a_simulated_log_are_recovered_exactly(name: str, p: int, m: int, v: int | None) -> None:
    schedule, truth = known(name, p, m, v)
    steps = log_of(schedule, truth, "ahead")
    cal = calibrate(schedule, steps, truth.boundary_bytes)
    split = schedule.split_backwards()
    whole = any((a.stage, a.microbatch) not in split for acts in schedule.actions for a in acts if a.kind == "B")
    assert close(cal.forward, truth.forward)
    if split:
        assert close(cal.input_grad, truth.input_grad) and close(cal.weight_grad, truth.weight_grad)
    else:
        assert all(math.isnan(x) for x in cal.input_grad + cal.weight_grad)
    if whole:
        assert close(cal.backward, truth.backward)
    assert close(cal.start, truth.start) and close(cal.step_overhead, truth.step_overhead)
    assert close(cal.post, truth.post)
    assert cal.latency_s == pytest.approx(truth.latency_s, abs=1e-9)
    assert cal.per_byte_s == pytest.approx(truth.per_byte_s, abs=1e-12)
    assert cal.tail_s == pytest.approx(truth.tail_s, abs=1e-9)
    assert cal.posting == "ahead" and cal.steps == 3
    # the calibrated prediction is the step that was logged, per rank and in total
    prediction = predict(schedule, cal)
    assert prediction.step_s == pytest.approx(cal.measured_step_s, abs=1e-9)
    assert close(prediction.finish_s, cal.measured_finish_s)


def test_a_log_of_overlapped_pairs_is_calibrated_in_either_order_of_the_pairs_events() -> None:
    """Issue 62: DualPipeV with pipeline.overlap_pairs (the default) ran pairs whose two actions
    record as each ends, and whose second posts inside the pair: its steps matched no lowering
    ("none of 4 recorded steps follows the programs of schedule 'dualpipev'"). Lowered with the
    pairs, the compute is recovered exactly, whichever of a pair's actions logged first, and the
    calibrated step is the logged one (the per-step overheads absorb the pairs' missing gaps)."""
    schedule, truth = known("dualpipev", 2, 8)
    programs = lower(schedule, "ahead", overlap=True)
    assert any(step.paired for program in programs for step in program)
    steps = [simulated_log(schedule, programs, truth.action_cost(schedule), truth.runtime(), truth.tail_s,
                           origin=7.0 * n) for n in range(3)]
    with pytest.raises(ValueError, match="none of 3 recorded steps follows"):
        calibrate(schedule, steps, truth.boundary_bytes)  # as before: lowered without the pairs
    swapped = [[RankStep(r.start, r.end, _pairs_swapped(r.events)) for r in step] for step in steps]
    for log in (steps, swapped):
        cal = calibrate(schedule, log, truth.boundary_bytes, overlap=True)
        for got, want in ((cal.forward, truth.forward), (cal.input_grad, truth.input_grad),
                          (cal.weight_grad, truth.weight_grad), (cal.backward, truth.backward)):
            assert close(got, want), (got, want)
        assert cal.overlap and predict(schedule, cal).step_s == pytest.approx(cal.measured_step_s, rel=5e-3)


def test_a_log_with_shard_points_is_calibrated_with_the_gathers_in_the_gaps() -> None:
    """Issue 62: a parallel.shard=full run's steps hold shard points (FSDP2's gathers and
    reduce-scatters) and matched no lowering: "no calibrated prediction".  Lowered with them, the
    compute is recovered exactly and the gathers' time stays out of it (in the calls and gaps
    around the steps), so the calibrated step is the logged one."""
    schedule, truth = known("1f1b", 2, 4)
    programs = lower(schedule, "ahead", shard=True)
    assert any(step.unshard for program in programs for step in program)
    from pipeflow.schedules import simulate

    sim_steps = []
    for n in range(3):
        sim = simulate(schedule, programs, truth.action_cost(schedule), runtime=truth.runtime(), shard_cost=2e-3)
        end = 7.0 * n + max(sim.finish) + truth.tail_s
        sim_steps.append([RankStep(7.0 * n if r == 0 else 7.0 * n + min(e[2] for e in sim.events[r]), end,
                                   _as_the_runtime_logs(programs[r], [(k, name, 7.0 * n + a, 7.0 * n + b)
                                                                      for k, name, a, b in sim.events[r]]))
                          for r in range(schedule.num_ranks)])
    with pytest.raises(ValueError, match="none of 3 recorded steps follows"):
        calibrate(schedule, sim_steps, truth.boundary_bytes)  # as before: lowered without shard points
    cal = calibrate(schedule, sim_steps, truth.boundary_bytes, shard=True)
    assert close(cal.forward, truth.forward) and close(cal.backward, truth.backward)
    assert predict(schedule, cal).step_s == pytest.approx(cal.measured_step_s, rel=0.1)


def _as_the_runtime_logs(program: list, events: list) -> list:
    """The simulator's events of `program` as the runtime logs them: a step with shard points that
    posts logs its posting (before the gathers) and its wait (after) apart, under one name."""
    out, it = [], iter(events)
    for step in program:
        if step.ops or step.waits:
            comm = next(it)
            if (step.unshard or step.reshard) and step.ops:
                out.append((comm[0], comm[1], comm[2], comm[2]))
            out.append(comm)
        for _ in range((step.action is not None) + bool(step.after)):
            out.append(next(it))
    return out


def _pairs_swapped(events: list) -> list:
    """Each F immediately followed by a B logged the other way round (the B ended first)."""
    out, i = [], 0
    while i < len(events):
        if i + 1 < len(events) and events[i][0] == "F" and events[i + 1][0] == "B":
            out += [events[i + 1], events[i]]
            i += 2
        else:
            out.append(events[i])
            i += 1
    return out


def test_a_ranks_clock_offset_is_taken_out_before_calibrating() -> None:
    """On several machines each rank's perf_counter counts from its own boot. Records of ranks whose
    clocks read 5 s ahead and 3.25 s behind rank 0's, moved onto rank 0's clock by their offsets (as
    the run and the rehearsal do before gathering), calibrate as one clock's records; raw, they did."""
    schedule, truth = known("zb_h1", 4, 8)
    steps = log_of(schedule, truth, "ahead")
    offsets = [0.0, 5.0, -3.25, 0.0]  # each rank's clock minus rank 0's
    skewed = [[on_rank0_clock(record, -offset) for record, offset in zip(step, offsets)] for step in steps]
    aligned = [[on_rank0_clock(record, offset) for record, offset in zip(step, offsets)] for step in skewed]
    want = asdict(calibrate(schedule, steps, truth.boundary_bytes))
    got = asdict(calibrate(schedule, aligned, truth.boundary_bytes))
    for key, value in want.items():
        if isinstance(value, list):
            assert close(got[key], value), key
        elif isinstance(value, float):
            assert got[key] == pytest.approx(value, abs=1e-9, nan_ok=True), key
        else:
            assert got[key] == value, key
    raw = calibrate(schedule, skewed, truth.boundary_bytes)  # before: rank 1 seemed to start 5 s late
    assert raw.start[1] > 4.9 and raw.measured_finish_s[1] > 4.9 and not close(raw.start, want["start"])


@pytest.mark.parametrize("posting", ["at_step", "rendezvous"])
def test_the_lowering_that_ran_is_recognised_and_predicted(posting: str) -> None:
    schedule, truth = known("1f1b", 4, 8)
    steps = log_of(schedule, truth, posting)
    programs = {option: lower(schedule, option) for option in ("ahead", "at_step", "rendezvous")}
    assert which_posting(steps[0], programs) == posting
    cal = calibrate(schedule, steps, truth.boundary_bytes)
    assert cal.posting == posting
    assert close(cal.forward, truth.forward) and close(cal.backward, truth.backward)
    assert predict(schedule, cal).step_s == pytest.approx(cal.measured_step_s, abs=1e-9)


def test_a_slower_transfer_is_seen_as_one() -> None:
    schedule, truth = known("1f1b", 4, 8)
    slow = Calibration(**{**truth.__dict__, "latency_s": 2e-3})
    cal = calibrate(schedule, log_of(schedule, slow, "ahead"), truth.boundary_bytes)
    assert cal.latency_s == pytest.approx(2e-3, abs=1e-9)
    assert predict(schedule, cal).step_s > predict(schedule, truth).step_s


def test_steps_that_follow_no_program_are_refused() -> None:
    schedule, truth = known("1f1b", 2, 4)
    steps = log_of(schedule, truth, "ahead")
    broken = [[RankStep(r.start, r.end, list(r.events)[1:]) for r in step] for step in steps]
    with pytest.raises(ValueError, match="none of 3 recorded steps"):
        calibrate(schedule, broken, truth.boundary_bytes)


def test_the_costs_survive_their_json() -> None:
    schedule, truth = known("1f1b", 2, 4)
    cal = calibrate(schedule, log_of(schedule, truth, "ahead"), truth.boundary_bytes, meta={"model": "x"})
    again = Calibration.from_json(cal.to_json())
    assert close(again.input_grad, cal.input_grad) and again.meta == {"model": "x"}
    assert again.to_json() == cal.to_json()


def costs_file(tmp_path, slow_stage0: float) -> str:
    """A 2-rank run's costs.json over 4 equal profiled layers (1 ms F, 1 + 1 ms B + W each) in
    which the run measured stage 0 (layers 0, 1) `slow_stage0` times slower than profiled."""
    from dataclasses import asdict

    from pipeflow.planning.profile import LayerProfile

    ms = 1e-3
    profiles = [LayerProfile(f"l{i}", 10, 40, ms, 2 * ms, 1000, ms, ms, 4096) for i in range(4)]
    k = slow_stage0
    cal = Calibration([2 * ms * k, 2 * ms], [NAN, NAN], [NAN, NAN], [4 * ms * k, 4 * ms], [0.0, 0.0], [1e-5, 1e-5],
                      [2e-5, 2e-5], 1e-4, 0.0, 1e-3, "at_step", [4096.0, 4096.0], 10, NAN, [],
                      meta={"num_ranks": 2, "microbatch_size": 2, "ranges": [[0, 2], [2, 4]], "schedule": "1f1b",
                            "num_microbatches": 4, "profiles": [asdict(p) for p in profiles]})
    (tmp_path / "costs.json").write_text(cal.to_json())
    return str(tmp_path)


def test_plan_calibration_ranks_layouts_with_the_measured_costs(tmp_path) -> None:
    from pipeflow.planning.measured_costs import calibrated_layers, read_costs
    from pipeflow.planning.profile import LayerProfile
    from pipeflow.commands.plan.command import compose_config, run_plan

    words = ["model=gpt", "model.n_layer=2", "data.batch_size=8", "parallel.pp=2", "plan.schedules=[1f1b]",
             "plan.microbatches=[4]", "plan.comm_latency_ms=0"]
    profiled = [LayerProfile(f"l{i}", 10, 40, 1e-3, 2e-3, 1000, 1e-3, 1e-3, 4096) for i in range(4)]
    fresh, _ = run_plan(compose_config(words), costs=lambda b: profiled)
    assert fresh.candidates[0].split_points == (2,)  # equal layers: two each
    path = costs_file(tmp_path, slow_stage0=5.0)
    layers = calibrated_layers(read_costs(path))
    assert [x.forward_s for x in layers] == pytest.approx([5e-3, 5e-3, 1e-3, 1e-3])
    calibrated, report = run_plan(compose_config([*words, f"plan.calibration={path}"]))
    assert calibrated.candidates[0].split_points == (1,)  # layers 0 and 1 measured 5x slower: one on stage 0
    assert f"costs measured by the run in {path}" in report and "posting at_step" in report
    best = calibrated.candidates[0]
    assert best.step_s == pytest.approx(predict_1f1b_step(layers, best.split_points[0]), rel=1e-9)


def predict_1f1b_step(layers, point: int) -> float:
    """The calibrated planner's step for 1f1b, p = 2, m = 4 at `point`, simulated directly."""
    from pipeflow.schedules import RuntimeCosts, simulate
    from pipeflow.schedules.ir import BACKWARD, FORWARD

    schedule = build_schedule("1f1b", 2, 4)
    stages = [layers[:point], layers[point:]]
    kind = {FORWARD: lambda x: x.forward_s, BACKWARD: lambda x: x.backward_s, "W": lambda x: 0.0}
    cost = lambda a: sum(kind[a.kind](x) for x in stages[a.stage])  # noqa: E731
    sim = simulate(schedule, lower(schedule, "at_step"), cost,
                   runtime=RuntimeCosts(lambda op: 1e-4, [1e-5, 1e-5], [2e-5, 2e-5]))
    return sim.makespan + 1e-3


def test_plan_calibration_refuses_a_run_of_another_pipeline(tmp_path) -> None:
    from pipeflow.errors import ConfigError
    from pipeflow.commands.plan.command import compose_config, run_plan

    path = costs_file(tmp_path, 1.0)
    cfg = compose_config(["model=gpt", "model.n_layer=2", "data.batch_size=8", "parallel.pp=4",
                          f"plan.calibration={path}"])
    with pytest.raises(ConfigError, match="measured 2 pipeline ranks"):
        run_plan(cfg)


def test_the_calibration_line_says_when_nothing_was_predicted_at_start() -> None:
    from pipeflow.observability.calibrated import calibration_line

    schedule, truth = known("1f1b", 4, 8, None)
    cal = calibrate(schedule, log_of(schedule, truth, "ahead"), truth.boundary_bytes)
    assert "predicted at start none (no profile), calibrated" in calibration_line(cal, 0.01, [0.01] * 4, math.nan, "c.json")
    assert "predicted at start 12.0 ms, calibrated" in calibration_line(cal, 0.01, [0.01] * 4, 0.012, "c.json")


def test_a_run_too_short_to_calibrate_says_so_without_a_warning(tmp_path, caplog) -> None:
    """A run of 2 steps (all warm-up) ended with ``WARNING no calibrated prediction: ValueError:
    none of 0 recorded steps follows the programs``, as if its schedule had misbehaved."""
    import logging

    from pipeflow.observability.calibrated import CalibrationLog
    from pipeflow.planning.calibration import calibrator

    schedule, truth = known("1f1b", 2, 4)
    records = CalibrationLog(calibrator(schedule, truth.boundary_bytes, meta={}), 0, 2, first_pipeline=True)
    with caplog.at_level(logging.INFO):
        out = records._calibrate([(0, []), (1, [])], schedule, str(tmp_path), math.nan)
    assert math.isnan(out["step_calibrated_s"]) and not (tmp_path / "costs.json").exists()
    assert [r.levelname for r in caplog.records] == ["INFO"], caplog.text
    assert "no full-size step after the first 2 (warm-up) was recorded" in caplog.text
