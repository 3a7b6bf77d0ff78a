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
from pipeflow.run.config import MetricsConfig  # noqa: E402


@pytest.fixture(scope="module")
def world4(request):
    import long_run_cases

    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    return run_cases(4, selected_cases(request, [("trackers", long_run_cases.trackers_across_a_resume)]))


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
