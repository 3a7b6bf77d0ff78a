"""`torchrun train.py` end to end, and the errors a user sees for bad configuration."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeflow.config.schema import check_config, register_configs
from pipeflow.errors import ConfigError, PartitionError, ScheduleError
from pipeflow.planning.partition import partition_layers
from pipeflow.schedules import build_schedule

import warm

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layer=2", "model.n_embd=32", "data.batch_size=16", "data.num_tokens=20000", "train.eval_batches=2"]


def torchrun(nproc: int, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """train.py on `nproc` ranks with the environment torchrun gives them, each rank a fork of the
    suite's warm server (tests/warm.py: no interpreter start, no imports); what subprocess.run returns."""
    return warm.launch(["train.py", *overrides], nproc, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       timeout=timeout)


def compose_config(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_torchrun_two_processes_trains_and_loss_falls(tmp_path: Path) -> None:
    run = torchrun(2, *SMALL, "train.max_steps=60", "train.eval_every=0", "schedule=gpipe",
                   "pipeline.num_microbatches=4", f"train.run_dir={tmp_path}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    match = re.search(r"loss ([\d.]+) -> ([\d.]+) \| held-out loss ([\d.]+) -> ([\d.]+)", run.stdout)
    assert match, run.stdout[-3000:]
    first, last, val_first, val_last = map(float, match.groups())
    assert last < first - 0.5 and val_last < val_first - 0.5
    assert (tmp_path / "config.yaml").read_text().count("num_microbatches: 4") == 1
    assert "schedule=gpipe" in run.stdout and "predicted bubble" in run.stdout
    # comm.post_recvs=auto decides within the first quarter of a run, on every rank alike
    assert re.search(r"comm.post_recvs=auto: recvs posted (a step ahead|at their step)", run.stdout)


def test_custom_model_example_runs_under_torchrun_with_balance_and_placement(tmp_path: Path) -> None:
    """examples/custom_model.py selected by its own config outside pipeflow (Hydra search path),
    balanced by profiled time, stages placed by hand (stage 0 on rank 1); an explicit
    hydra.run.dir is the run directory (pipeflow.run.run_dir)."""
    run = torchrun(2, "hydra.searchpath=[file://examples/configs]", "model=residual_mlp", "data=gaussian",
                   "train.max_steps=40", "train.eval_every=0", "pipeline.balance=time",
                   "pipeline.stage_to_rank=[1,0]", f"hydra.run.dir={tmp_path / 'run'}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"run directory: {tmp_path / 'run'}" in run.stdout
    assert "residual_mlp" in (tmp_path / "run" / "config.yaml").read_text()
    assert "fwd+bwd (ms)" in run.stdout and "memory (MB)" in run.stdout and "predicted bubble" in run.stdout
    rows = re.findall(r"^(\d) +\| (\d) +\| (\S+) ", run.stdout, re.M)
    assert [(stage, rank) for stage, rank, _ in rows] == [("0", "1"), ("1", "0")], run.stdout
    assert rows[0][2].startswith("input") and rows[1][2].endswith("head")
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", run.stdout).groups())
    assert last < first / 2


def test_a_torchvision_model_through_the_config_group_trains_under_torchrun(tmp_path: Path) -> None:
    """model=torchvision: torchvision's resnet18, unmodified, split by from_module, each rank
    materialising only its own layers."""
    run = torchrun(2, "model=torchvision", "model.name=resnet18", "data=fakedata", "data.fake_size=16",
                   "data.batch_size=8", "pipeline.num_microbatches=2", "train.max_steps=16", "train.eval_every=0",
                   "train.log_every=5", "optim.warmup_steps=3", "pipeline.profile=false", "metrics.tensorboard=false",
                   f"train.run_dir={tmp_path}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^0 +\| 0 +\| stem\.\.", run.stdout, re.M) and re.search(r"\.\.head +\|", run.stdout), run.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", run.stdout).groups())
    assert last < first / 2


def test_your_module_example_trains_under_torchrun_with_no_arguments(tmp_path: Path) -> None:
    """examples/your_module.py: a plain GPT nn.Module split by from_module, no arguments."""
    run = warm.launch([str(ROOT / "examples" / "your_module.py")], 2, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^0 +\| 0 +\| before\.\.blocks\.1 ", run.stdout, re.M), run.stdout  # the partition table
    assert re.search(r"^1 +\| 1 +\| blocks\.2\.\.after ", run.stdout, re.M), run.stdout
    first, last, val_first, val_last = map(float, re.search(
        r"loss ([\d.]+) -> ([\d.]+) \| held-out loss ([\d.]+) -> ([\d.]+)", run.stdout).groups())
    assert last < first - 1.5 and val_last < val_first - 1.5


def test_torchrun_with_a_world_size_that_does_not_fit_exits_with_a_clear_error(tmp_path: Path) -> None:
    run = torchrun(2, *SMALL, "parallel.pp=4", f"train.run_dir={tmp_path}", timeout=120)
    assert run.returncode != 0
    assert "parallel.dp=1 x parallel.pp=4 = 4 processes, but the world size is 2" in run.stdout + run.stderr


def test_world_size_must_equal_dp_times_pp() -> None:
    cfg = compose_config("parallel.pp=3")
    with pytest.raises(ConfigError, match=r"parallel.pp=3.*world size is 4.*--nproc-per-node 3"):
        check_config(cfg, world_size=4)


def test_batch_needs_a_row_for_every_microbatch_and_may_split_unevenly() -> None:
    """A batch that does not divide into m equal micro-batches is split into sizes that differ by
    at most one row (issue 23; it used to be refused); fewer rows than micro-batches is refused."""
    assert check_config(compose_config("data.batch_size=30", "pipeline.num_microbatches=4"), world_size=4) == (1, 4)
    cfg = compose_config("data.batch_size=6", "pipeline.num_microbatches=4", "parallel.dp=2")
    with pytest.raises(ConfigError, match=r"data.batch_size=6.*pipeline.num_microbatches=4.*parallel.dp=2.*at least 8"):
        check_config(cfg, world_size=4)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(PartitionError, match=r"3.*4|4.*3"):
        partition_layers(3, 4)


def test_unknown_schedule_lists_the_valid_ones() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'.*1f1b.*gpipe"):
        build_schedule("zigzag", 2, 4)


def test_default_config_composes_with_overrides() -> None:
    cfg = compose_config("schedule=gpipe", "pipeline.num_microbatches=4", "pipeline.split_points=[2,4,6]")
    assert cfg.schedule.name == "gpipe" and cfg.pipeline.num_microbatches == 4
    assert list(cfg.pipeline.split_points) == [2, 4, 6]
    assert check_config(cfg, world_size=4) == (1, 4)


def test_a_misspelt_key_is_rejected_by_the_schema() -> None:
    with pytest.raises(Exception, match="num_microbatch"):
        compose_config("pipeline.num_microbatch=4")


@pytest.mark.parametrize(("typo", "meant"), [
    ("pipeline.num_microbatch=4", "pipeline.num_microbatches=4"),  # a key of a group
    ("pipline.num_microbatches=4", "pipeline.num_microbatches=4"),  # its parent misspelt
    ("train.max_step=3", "train.max_steps=3"),
    ("model.n_layers=3", "model.n_layer=3"),  # the chosen model's own keys
])
def test_a_misspelt_key_gets_a_did_you_mean(typo: str, meant: str) -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as caught:
        compose_config(typo)
    key = typo.partition("=")[0]
    assert str(caught.value).startswith(f"Could not override '{key}': the config has no such key. Did you mean {meant}")
    assert f"(To add a new key anyway: +{typo})" in str(caught.value)


def test_an_unknown_key_like_no_other_keeps_hydras_message() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"^Could not override 'zzz'.\nTo append to your config use \+zzz=1"):
        compose_config("zzz=1")


def test_train_py_says_did_you_mean_for_a_misspelt_key() -> None:
    """What the user sees from @hydra.main (the override step Hydra runs before main)."""
    run = warm.run_python(["train.py", "pipeline.num_microbatch=4"], cwd=ROOT, timeout=120)
    assert run.returncode != 0
    assert "Did you mean pipeline.num_microbatches=4?" in run.stderr, run.stderr[-2000:]


def _schedule_from(cfg, pp: int = 4):
    return build_schedule(cfg.schedule.name, pp, cfg.pipeline.num_microbatches, cfg.schedule.stages_per_rank,
                          cfg.schedule.placement, cfg.schedule.path)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs" / "schedule").glob("*.yaml") if p.stem != "custom"))
def test_every_schedule_config_builds(name: str) -> None:
    schedule = _schedule_from(compose_config(f"schedule={name}"))
    assert schedule.name == name and schedule.num_microbatches == 8


def test_layout_overrides_reach_the_schedule(tmp_path: Path) -> None:
    schedule = _schedule_from(compose_config("schedule=interleaved_1f1b", "pipeline.stages_per_rank=3"))
    assert schedule.num_stages == 12
    with pytest.raises(ScheduleError, match=r"'zbv' needs schedule.stages_per_rank=2"):
        _schedule_from(compose_config("schedule=zbv", "pipeline.stages_per_rank=3"))
    with pytest.raises(ScheduleError, match=r"'1f1b' cannot use schedule.placement=v"):
        _schedule_from(compose_config("schedule=1f1b", "pipeline.placement=v"))
    with pytest.raises(ScheduleError, match=r"schedule.path"):
        _schedule_from(compose_config("schedule=custom", "schedule.path=null"))
    path = tmp_path / "mine.txt"
    path.write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    custom = _schedule_from(compose_config("schedule=custom", f"schedule.path={path}", "pipeline.num_microbatches=2"), pp=2)
    assert custom.num_ranks == 2 and custom.num_microbatches == 2


def test_torchrun_dp2_pp2_full_shard_matches_the_unsharded_loss_step_for_step(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 4 train.py parallel.dp=2 parallel.pp=2 parallel.shard=full` trains,
    its per-step losses (TensorBoard, float32) equal those of parallel.shard=none and =optimizer
    (those two run as one sweep, `-m`: shard modes composed with the sweep's shared process
    group), and its trace shows each rank's gather and reduction of its stage."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = [*SMALL, "train.max_steps=6", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1"]
    full = torchrun(4, "parallel.dp=2", "parallel.pp=2", "parallel.shard=full", *common, "metrics.trace_steps=[2]",
                    f"train.run_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert "mesh: dp=2 x pp=2, shard=full," in full.stdout
    sweep = torchrun(4, "-m", "parallel.dp=2", "parallel.pp=2", "parallel.shard=none,optimizer", *common,
                     f"train.run_dir={tmp_path / 'sweep'}")
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    assert "sweep: 2 jobs run, 0 skipped" in sweep.stdout + sweep.stderr
    runs = {"full": tmp_path / "full", "none": tmp_path / "sweep" / "0_parallel.shard=none",
            "optimizer": tmp_path / "sweep" / "1_parallel.shard=optimizer"}
    losses = {}
    for shard, run_dir in runs.items():
        events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
        events.Reload()
        losses[shard] = [e.value for e in events.Scalars("train/loss")]
    assert len(losses["full"]) == 6 and losses["full"][-1] < losses["full"][0]
    for shard in ("full", "optimizer"):
        for step, (loss, none) in enumerate(zip(losses[shard], losses["none"], strict=True)):
            assert abs(loss - none) <= 1e-5 * abs(none), f"step {step}: shard={shard} loss {loss} vs shard=none {none}"
    trace = json.loads((tmp_path / "full" / "trace.json").read_text())["traceEvents"]
    shard_events = sorted((e["pid"], e["name"]) for e in trace if e.get("cat") == "shard")
    expected = [(r, f"{what} {r % 2}") for r in range(4) for what in ("unshard", "reduce-scatter + reshard")]
    assert shard_events == sorted(expected)
