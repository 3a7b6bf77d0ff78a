"""What a long pre-training run expects (issue 63): experiment trackers beside TensorBoard.

The multi-process cases run in one 4-process world (tests/long_run_cases.py); the tracker fan-out
and the config keys are pure tests.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mp_harness import run_cases, selected_cases  # noqa: E402

from pipeflow.errors import ConfigError  # noqa: E402
from pipeflow.observability import trackers  # noqa: E402
from pipeflow.config.schema import MetricsConfig  # noqa: E402


@pytest.fixture(scope="module")
def world4(request):
    import long_run_cases

    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    return run_cases(4, selected_cases(request, [("trackers", long_run_cases.trackers_across_a_resume),
                                                 ("ramp", long_run_cases.ramp_vs_unsplit),
                                                 ("spikes", long_run_cases.spikes_skipped_and_rolled_back)]))


def test_trackers_hold_the_consoles_losses_from_the_last_stage_across_a_resume(world4):
    """W&B (offline) and MLflow (the run directory's store) beside TensorBoard, pp 2 x dp 2: the
    loss series each holds is the console's and the last stage's (reduced over dp), steps 0-5
    over a resume that continues the same tracker runs; a tracker that cannot start is a
    TrackerError on every rank, before the first step."""
    results = world4["trackers"]
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
    main = results[0].value
    last_stage = [r.value["losses"] for r in results if r.value["pp_rank"] == 1]
    assert len(last_stage) == 2 and last_stage[0] == last_stage[1], last_stage  # dp-reduced: the replicas agree
    truth = sorted(last_stage[0].items())
    assert [step for step, _ in truth] == list(range(6)), truth
    assert [(s, round(v, 4)) for s, v in truth] == main["console"], (truth, main["console"])
    for name in ("wandb", "mlflow"):
        assert [s for s, _ in main[name]] == list(range(6)), (name, main[name])
        assert max(abs(a - b) for (_, a), (_, b) in zip(main[name], truth)) <= 1e-12 * max(1.0, truth[0][1]), name
    assert main["ids"][0] == main["ids"][1], main["ids"]  # the resume continued both tracker runs
    assert main["mlflow_runs"] == 1 and main["mlflow_status"] == "FINISHED", main
    assert main["mlflow_params"] == {"parallel.dp": "2", "train.save_every": "2"}, main["mlflow_params"]
    assert main["mlflow_checkpoint"].endswith("step_00000006") and main["tensorboard"], main
    for rank, result in enumerate(results):
        refused = result.value.get("refused", "")
        assert "metrics.trackers: mlflow could not start" in refused and "MLFLOW_TRACKING_URI" in refused, (rank, refused)


def test_a_ramped_batch_trains_as_the_unsplit_model_on_each_steps_batch_and_resumes_mid_ramp(world4):
    """train.batch_ramp 4 -> 8 -> 12 -> 16 on dp 2 x pp 2: each size runs its micro-batch count (the
    1F1B schedule re-lowered per count), each step's batch is what a run of that size trains, the
    lr follows the samples trained; loss and parameters equal the unsplit model's (float64); a
    checkpoint of step 3 (mid-ramp) resumes with the straight run's losses, and schedule=auto,
    synthesised again per count, trains them too."""
    for rank, result in enumerate(world4["ramp"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["counts"] == [1, 1, 2, 3, 4, 4, 4], v["counts"]
        assert all(sized for sized in v["sized"]), v["sized"]
        assert all(abs(got - want) <= 1e-15 for got, want in v["lr"]) and v["lr"][1][0] > v["lr"][0][0], v["lr"]
        assert v["compared"] > 0 and max(v["loss"], v["param"]) <= 1e-9, v
        assert v["resumed_steps"] == 7 and v["resumed"] <= 1e-12, v
        assert v["auto_counts"] == [1, 2, 3, 4] and v["auto"] <= 1e-10, v  # auto synthesised per count


def test_a_spike_is_skipped_or_rolled_back_alike_on_every_rank(world4):
    """train.spike on an injected spike (global rank 1's logits x 30 at step 12, pp 2 x dp 2): skip
    drops that step's update on every rank and flags no earlier step; rollback goes back to step
    8's checkpoint, skips batches 8..10 and ends as a run resumed there with them skipped ends (the
    count saved in its checkpoints); the cap stops the run with LossSpikeError on every rank."""
    for rank, result in enumerate(world4["spikes"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["skip_kept"], rank  # the step's update dropped on every rank
        assert "after 0 rollback(s) (train.spike.max_rollbacks=0)" in v.get("capped", ""), (rank, v.get("capped"))
        assert v["rollback_meta"] == 3 and v["rollback_equal"], (rank, v)
    main = world4["spikes"][0].value
    assert [r.value["injected"] for r in world4["spikes"]] == [False, True, False, False]  # rank 1: the last stage
    assert len(main["skip_lines"]) == 1 and main["skip_lines"][0].startswith("step 12: loss spike: loss "), main["skip_lines"]
    assert "its update was dropped (train.spike.action=skip)" in main["skip_lines"][0], main["skip_lines"]
    assert "gradient norm jumped most" in main["skip_lines"][0] and "training batch 12" in main["skip_lines"][0]
    assert any("rolled back to" in line and "(step 8) after the spike of step 10; batches 8..10 skipped" in line
               for line in main["rollback_lines"]), main["rollback_lines"]


@pytest.fixture(scope="module")
def world2(request):
    import long_run_cases

    return run_cases(2, selected_cases(request, [("stragglers", long_run_cases.stragglers_named)]))


def test_a_slowed_rank_is_named_within_three_intervals_and_a_clean_run_names_none(world2):
    """metrics.straggler_factor: on 2 ranks (pp 2), rank 1 slowed from step 15 (after the intervals
    its ratio is calibrated on) by a sleep several times its compute is named as a straggler by
    step 30 (three log intervals of 5 steps); an unthrottled run of ten intervals names no rank
    and no link."""
    for rank, result in enumerate(world2["stragglers"]):
        assert result.error is None, f"rank {rank}: {result.error}"
    main = world2["stragglers"][0].value
    assert main["clean"] == [], main["clean"]
    named = [line for line in main["slowed"] if "straggler: rank 1 compute" in line]
    assert named and 15 < int(named[0].split(":")[0].split()[1]) <= 30, main["slowed"]
    assert not any("straggler: rank 0" in line for line in main["slowed"]), main["slowed"]


def test_tensorboard_false_removes_it_from_the_trackers_and_unknown_names_are_refused():
    assert trackers.chosen_trackers(["tensorboard", "wandb", "wandb"], tensorboard=False) == ["wandb"]
    assert MetricsConfig().trackers == ["tensorboard"]
    with pytest.raises(ConfigError, match="metrics.trackers names 'neptune', which is no tracker; valid: tensorboard"):
        MetricsConfig(trackers=["neptune"])


class _Sink:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail, self.got = name, fail, []

    def scalars(self, values, step):
        if self.fail:
            raise OSError("disk full")
        self.got.append((step, dict(values)))

    def close(self, ok):
        self.got.append(("closed", ok))


def test_a_tracker_failing_mid_run_is_warned_about_once_and_the_others_go_on(caplog):
    good, bad = _Sink("tensorboard"), _Sink("mlflow", fail=True)
    fan = trackers.Trackers([good, bad])
    fan.add_scalar("train/loss", 2.0, 3)
    fan.add_scalar("train/lr", 0.1, 3)
    fan.add_scalar("memory/0/rss_mb", 7.0, 1)  # an earlier step's figure, handed over first
    with caplog.at_level(logging.WARNING, logger="pipeflow"):
        fan.flush()
        fan.add_scalar("train/loss", 1.0, 4)
        fan.close()
    assert good.got == [(1, {"memory/0/rss_mb": 7.0}), (3, {"train/loss": 2.0, "train/lr": 0.1}),
                        (4, {"train/loss": 1.0}), ("closed", True)]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["metrics.trackers: mlflow failed (scalars: OSError: disk full); training goes on without it"]
    assert fan.names == ["tensorboard"]


def test_a_resume_finds_the_tracker_ids_of_its_run_directory_or_of_the_checkpoints_run(tmp_path):
    (tmp_path / "a" / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "a" / "trackers.json").write_text('{"wandb": "w1", "mlflow": "m1"}')
    assert trackers.saved_ids(str(tmp_path / "b"), None) == {}
    assert trackers.saved_ids(str(tmp_path / "a"), "auto") == {"wandb": "w1", "mlflow": "m1"}
    assert trackers.saved_ids(str(tmp_path / "b"), str(tmp_path / "a" / "checkpoints" / "step_00000004"))["wandb"] == "w1"
    assert trackers.flat_params({"train": {"lr": 0.1, "steps": [1, 2]}, "x": None}) == {
        "train.lr": "0.1", "train.steps": "[1, 2]", "x": "null"}


def test_the_ramp_grows_the_batch_as_megatrons_rampup_batch_size_does():
    """Megatron's rule: start + floor(consumed / (samples / increments)) x increment, full once more
    than `samples` were trained; the lr schedule's clock is the full batches trained."""
    from pipeflow.data.batch_ramp import BatchRamp

    ramp = BatchRamp(start=4, increment=4, samples=24, full=16, dp=2, microbatches=4)
    assert [ramp.size(k) for k in range(7)] == [4, 4, 8, 12, 16, 16, 16]
    assert [ramp.consumed_before(k) for k in range(5)] == [0, 4, 8, 16, 28]
    assert [ramp.microbatches_at(k) for k in range(5)] == [1, 1, 2, 3, 4] and ramp.position(4) == 28 / 16
    assert ramp.describe() == ("4 -> 8 -> 12 -> 16 samples (micro-batches per replica 1 -> 2 -> 3 -> 4) from steps "
                               "0, 2, 3, 4; full after 24 samples")
    with pytest.raises(ConfigError, match="data.batch_size=16 - start=4 is no multiple of increment=5"):
        BatchRamp(start=4, increment=5, samples=24, full=16, dp=2, microbatches=4)
    with pytest.raises(ConfigError, match=r"batch sizes \[2, 6, 10, 14\] are no whole number of micro-batches on "
                                          r"each of dp=2 replicas .* multiples of 4"):
        BatchRamp(start=2, increment=2, samples=24, full=16, dp=2, microbatches=4)


def test_a_ramp_needs_its_three_keys_and_no_offload():
    from pipeflow.run.builder import batch_ramp
    from pipeflow.config.schema import BatchRampConfig
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match="train.batch_ramp needs start, increment and samples; "
                                          "train.batch_ramp.samples is not set"):
        BatchRampConfig(start=4, increment=4)
    cfg = OmegaConf.create({"train": {"batch_ramp": {"start": 4, "increment": 4, "samples": 8}},
                            "schedule": {"name": "auto"}, "pipeline": {"offload": "auto"}, "data": {"batch_size": 16}})
    with pytest.raises(ConfigError, match="train.batch_ramp does not run with pipeline.offload .* yet: change that"):
        batch_ramp(cfg, 1, 4)


def test_a_spike_is_a_rise_far_beyond_the_windows_noise_and_a_falling_or_quiet_loss_is_not():
    from pipeflow.run.spikes import SpikeDetector

    falling = SpikeDetector(window=10, threshold=6.0, min_rise=0.1)
    assert all(falling.judge(k, 4.0 - 0.1 * k, 1.0) is None for k in range(30))  # training, not spiking
    quiet = SpikeDetector(window=10, threshold=6.0, min_rise=0.1)
    noise = [0.001 * ((-1) ** k) for k in range(10)]
    assert all(quiet.judge(k, 2.0 + n, 1.0) is None for k, n in enumerate(noise))
    assert quiet.judge(10, 2.05, 1.0) is None  # 50 deviations of noise, but only 2.5% above the median
    spike = quiet.judge(11, 9.0, 1.0)
    assert spike is not None and (spike.step, spike.figure) == (11, "loss") and spike.deviations > 1000
    assert quiet.judge(12, 2.0, 50.0).figure == "grad norm"  # a spike is not added to the window
    with pytest.raises(ConfigError, match="train.spike.action='sometimes' is unknown; valid: off, warn, skip, rollback"):
        from pipeflow.config.schema import SpikeConfig
        SpikeConfig(action="sometimes")


def test_the_planner_prices_its_pick_at_each_size_of_the_ramp():
    """python -m pipeflow.plan with train.batch_ramp: the pick (its schedule, split, v, tp) searched
    again at each size's micro-batch count, the same rows a micro-batch; a ramp the pick cannot
    realise is said so."""
    from omegaconf import OmegaConf

    from pipeflow.planning.search import Candidate, PlanResult, SearchSpace
    from pipeflow.commands.plan.command import ramp_steps

    pick = Candidate("1f1b", 4, 1, (3,), 0.040, 0.2, (1.0, 1.0), tp=2)
    asked = []

    def price(sub, space, batch):
        asked.append((tuple(sub.plan.tp_sizes), space.schedules, space.microbatches, space.chunks, batch))
        m = space.microbatches[0]
        return PlanResult([Candidate("1f1b", m, 1, (2,), 0.001, 0.0, ()), Candidate("1f1b", m, 1, (3,), 0.01 * m, 0.0, ())])

    cfg = OmegaConf.create({"train": {"batch_ramp": {"start": 8, "increment": 8, "samples": 100}},
                            "data": {"batch_size": 32}, "plan": {"tp_sizes": None}})
    phrase = ramp_steps(cfg, PlanResult([pick]), SearchSpace(("1f1b", "gpipe"), (2, 4)), 16, 2, price)
    assert phrase == ("; the pick's step as the batch ramps (train.batch_ramp): 8 samples (m 1) 10.00 ms, 16 samples "
                      "(m 2) 20.00 ms, 24 samples (m 3) 30.00 ms, 32 samples (m 4) 40.00 ms")
    assert asked[0] == ((2,), ("1f1b",), (1,), (1,), 4) and [a[4] for a in asked] == [4, 8, 12, 16]
    cfg.train.batch_ramp.start, cfg.train.batch_ramp.increment = 6, 2
    assert "the pick cannot ramp its batch" in ramp_steps(cfg, PlanResult([pick]), SearchSpace(("1f1b",), (4,)), 16,
                                                           2, price)
    assert ramp_steps(OmegaConf.create({"train": {}}), PlanResult([pick]), SearchSpace(("1f1b",), (4,)), 16, 2, price) == ""


def test_a_tracker_not_installed_is_named_with_what_to_install(monkeypatch, tmp_path):
    from pipeflow.errors import TrackerError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(TrackerError, match=r"metrics.trackers names wandb, which is not installed .*pip install "
                                           r"'pipeflow\[wandb\]', or drop it from metrics.trackers"):
        trackers.open_trackers(["tensorboard", "wandb"], str(tmp_path), None, {}, None)
    assert not (tmp_path / "trackers.json").exists()


def test_a_named_link_is_named_again_when_it_falls_behind_by_the_factor_again(monkeypatch):
    """A link named slow (a busy host's core waits) and then throttled says so again; one that stays
    as slow as when named is not repeated; recovered, it is named afresh."""
    from pipeflow.observability.stragglers import StragglerWatch

    watch = StragglerWatch(1.5, None, None, lambda a, b, r: "0-1", lambda g: "")
    script = iter([3.0, 3.0, 3.2, 3.1, 10.0, 10.0, 10.5, 1.0, 2.0, 2.0])  # the link's ratio, interval by interval
    monkeypatch.setattr(watch, "_slow_links", lambda samples: [
        ("link/0-1/measured_mbps", "slow link" if (r := next(script)) > 1.5 else None, 1.0 / r, r)])
    named = [step for step in range(0, 50, 5) if watch.judge(step, [])[0]]
    assert named == [5, 25, 45], named  # the second interval off; the factor again twice; after recovering
