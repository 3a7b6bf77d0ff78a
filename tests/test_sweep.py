"""Sweeps: `torchrun train.py -m ...` runs every combination in one launch, skips invalid ones,
and writes the comparison table; plus the pure pieces (job names, swept keys, the table).  That
the ranks agree to skip a job one of them failed to build runs in tests/test_faults.py's world."""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from pipeflow.commands.sweep import JobRecord, SweepState, format_table, job_label, swept_keys
from test_cli import SMALL, torchrun

FIGURES = ("samples_per_s", "tokens_per_s", "step_time_ms", "predicted_step_ms", "calibrated_step_ms", "bubble_measured",
           "bubble_predicted", "final_loss")


def test_a_2x2_sweep_on_two_processes_runs_four_jobs_and_skips_the_invalid_ones(tmp_path: Path) -> None:
    """schedule x m x stages_per_rank: the four jobs with stages_per_rank=3 are invalid for 1f1b and
    zbv (ScheduleError on every rank); the other four run, each in its own sub-directory of the
    explicit hydra.sweep.dir (pipeflow.run.run_dir), beside Hydra's multirun.yaml."""
    run = torchrun(2, "-m", *SMALL, "train.max_steps=4", "train.eval_every=0", "schedule=1f1b,zbv",
                   "pipeline.num_microbatches=2,4", "pipeline.stages_per_rank=null,3", f"hydra.sweep.dir={tmp_path}",
                   timeout=420)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert (tmp_path / "multirun.yaml").is_file()
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert jobs == [
        "0_schedule=1f1b,pipeline.num_microbatches=2,pipeline.stages_per_rank=null",
        "2_schedule=1f1b,pipeline.num_microbatches=4,pipeline.stages_per_rank=null",
        "4_schedule=zbv,pipeline.num_microbatches=2,pipeline.stages_per_rank=null",
        "6_schedule=zbv,pipeline.num_microbatches=4,pipeline.stages_per_rank=null",
    ], out[-4000:]
    for job in jobs:  # each job's config is its own combination, each job its own TensorBoard run
        config = (tmp_path / job / "config.yaml").read_text()
        assert list((tmp_path / job / "tb").glob("events.out.tfevents.*")), job
        name, m = re.match(r"\d+_schedule=(\w+),pipeline.num_microbatches=(\d+)", job).groups()
        assert f"name: {name}" in config and f"num_microbatches: {m}" in config
    skipped = re.findall(r"sweep job (\d) \(schedule=\w+ pipeline.num_microbatches=\d "
                         r"pipeline.stages_per_rank=3\) skipped: ScheduleError: .*stages_per_rank", run.stdout)
    assert skipped == ["1", "3", "5", "7"], out[-4000:]
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["job"]) for r in rows) == [0, 2, 4, 6]
    for row in rows:
        assert all(math.isfinite(float(row[k])) for k in FIGURES), row
        assert float(row["samples_per_s"]) > 0 and 0 <= float(row["bubble_predicted"]) < 1
        for key in ("peak_memory_mb", "rss_mb", "tensor_mb", "predicted_memory_mb"):  # one per pipeline rank
            values = [float(x) for x in row[key].split(";")]
            assert len(values) == 2 and all(math.isfinite(x) and x > 0 for x in values), (key, row)
        tensor, predicted = ([float(x) for x in row[k].split(";")] for k in ("tensor_mb", "predicted_memory_mb"))
        assert all(abs(p / t - 1) < 0.1 for t, p in zip(tensor, predicted)), row  # one quantity, both sides
    speeds = [float(r["samples_per_s"]) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    table = (tmp_path / "sweep.md").read_text()
    assert table.count("| `schedule=") == 4 and table.count("skipped job") == 4
    assert "sweep: 4 jobs run, 4 skipped" in run.stdout


def test_swept_keys_are_the_overrides_with_several_values() -> None:
    argv = ["-m", "schedule=1f1b,zbv", "train.max_steps=20", "pipeline.num_microbatches=range(4,9,4)",
            "pipeline.split_points=[1,2]", "+x=1,2"]
    assert swept_keys(argv) == {"schedule", "pipeline.num_microbatches", "x"}


def test_job_label_names_the_job_by_its_swept_overrides() -> None:
    overrides = ["train.max_steps=20", "schedule=zbv", "pipeline.split_points=[1, 2]", "data.path=/a b/c.txt"]
    text, name = job_label(3, overrides, {"schedule", "pipeline.split_points", "data.path"})
    assert text == "schedule=zbv pipeline.split_points=[1, 2] data.path=/a b/c.txt"
    assert name == "3_schedule=zbv,pipeline.split_points=[1,_2],data.path=_a_b_c.txt"
    assert job_label(0, ["a=1"], set()) == ("a=1", "0_a=1")  # nothing swept: all overrides


def test_table_sorts_by_throughput_and_lists_skipped_jobs() -> None:
    def record(job: int, speed: float) -> JobRecord:
        return JobRecord(job, f"schedule=s{job}", "d", speed, math.nan, 1.0, math.nan, 0.25, 2.0, [], [1.5, 2.5], 3.0)

    state = SweepState("d", [record(0, 10.0), record(1, 30.0), record(2, 20.0)], [(3, "schedule=x", "ScheduleError: no")])
    lines = format_table(state).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| 1", "| 2", "| 0"]
    assert "| 25.0% | - | 1.50/2.50 | - | 3.0000 |" in lines[2]  # tensor MB measured, predicted; RSS
    assert "| tensor MB/rank measured | tensor MB/rank predicted | process RSS MB/rank | final loss |" in lines[0]
    assert "| step (ms) | predicted step (ms) | calibrated step (ms) |" in lines[0]
    state.records[1].calibrated_step_ms = 1.25
    assert "| 30.0 | 1.0 | 2.0 | 1.2 | - |" in format_table(state).splitlines()[2]
    assert lines[-1] == "skipped job 3 (`schedule=x`): ScheduleError: no"
