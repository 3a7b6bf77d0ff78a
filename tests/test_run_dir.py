"""Where a run writes (pipeflow.run.run_dir): train.run_dir, else an explicit hydra.run.dir /
hydra.sweep.dir, else outputs/<time>; one choice, rank 0's, for every rank.  In-process Hydra
composition; the real launches are in test_cli.py (hydra.run.dir) and test_sweep.py (hydra.sweep.dir)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from pipeflow.run import run_dir
from pipeflow.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hydra_job() -> Iterator:
    """Set the running Hydra job's config as `@hydra.main` would, from overrides; reset after."""
    def start(*overrides: str, config_dir: Path = ROOT / "configs") -> None:
        register_configs()
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)

    yield start
    HydraConfig.instance().cfg = None


def test_config_yaml_leaves_the_choice_to_pipeflow() -> None:
    """The defaults in configs/config.yaml are the ones run_dir treats as "not set by the user"."""
    hydra = OmegaConf.load(ROOT / "configs" / "config.yaml").hydra
    assert hydra.run.dir == run_dir.HYDRA_DEFAULTS["run.dir"]
    assert hydra.sweep.dir == run_dir.HYDRA_DEFAULTS["sweep.dir"] and hydra.sweep.subdir == "."
    assert hydra.job.chdir is False and hydra.output_subdir is None


def test_without_hydra_or_explicit_dirs_the_run_goes_to_outputs_time(hydra_job) -> None:
    assert run_dir.agree_run_dir(None).startswith("outputs/20")
    hydra_job()
    assert run_dir.explicit_hydra_dir("run.dir") is None
    assert run_dir.agree_run_dir(None).startswith("outputs/20")
    assert run_dir.agree_run_dir("runs/a") == "runs/a"


def test_an_explicit_hydra_run_dir_is_the_run_dir_unless_train_run_dir_is_set(hydra_job) -> None:
    hydra_job("hydra.run.dir=runs/mine")
    assert run_dir.agree_run_dir(None) == "runs/mine"
    assert run_dir.agree_run_dir("runs/a") == "runs/a"
    hydra_job("hydra.run.dir=.")  # the default's value, but named on the command line: honoured
    assert run_dir.agree_run_dir(None) == "."


def test_a_hydra_run_dir_set_in_a_users_config_counts_too(hydra_job, tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  run:\n    dir: runs/from_config\n")
    hydra_job(f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine")
    assert run_dir.agree_run_dir(None) == "runs/from_config"


def test_an_explicit_hydra_sweep_dir_is_the_sweep_dir_of_a_multirun(hydra_job) -> None:
    hydra_job("hydra.mode=MULTIRUN")
    assert run_dir.agree_sweep_dir(None).startswith("outputs/sweep_20")
    hydra_job("hydra.mode=MULTIRUN", "hydra.sweep.dir=sweeps/mine", "hydra.run.dir=runs/ignored")
    assert run_dir.agree_sweep_dir(None) == "sweeps/mine"
    assert run_dir.agree_sweep_dir("runs/a") == "runs/a"
    assert run_dir.explicit_hydra_dir("run.dir") is None  # a job's run dir is <sweep dir>/<k>_<overrides>
    hydra_job("hydra.sweep.dir=sweeps/ignored")  # a single run has no sweep directory
    assert run_dir.explicit_hydra_dir("sweep.dir") is None


def test_a_rank_whose_now_resolved_differently_takes_rank_0s_and_removes_its_own(
        hydra_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra#2070: ${now:} resolves per rank; this rank's clock said 12-00-01, rank 0's 12-00-00."""
    ours, rank0 = tmp_path / "runs" / "12-00-01", tmp_path / "runs" / "12-00-00"
    ours.mkdir(parents=True)  # what Hydra made for this rank before the job started
    rank0.mkdir()
    hydra_job(f"hydra.run.dir={ours}")

    def broadcast(objects: list, src: int) -> None:
        objects[:] = [str(rank0), str(rank0)]

    monkeypatch.setattr(run_dir.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(run_dir.dist, "broadcast_object_list", broadcast)
    assert run_dir.agree_run_dir(None) == str(rank0)
    assert not ours.exists() and rank0.is_dir()


def test_discard_stray_removes_only_what_hydra_left(tmp_path: Path) -> None:
    keep = tmp_path / "sweeps" / "a"
    keep.mkdir(parents=True)
    stray = tmp_path / "sweeps" / "b"
    stray.mkdir()
    (stray / "multirun.yaml").write_text("{}")
    run_dir.discard_stray(str(stray), str(keep))
    assert not stray.exists() and keep.is_dir()  # sweeps/ holds keep: stays
    busy = tmp_path / "c"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    run_dir.discard_stray(str(busy), str(keep))
    assert (busy / "notes.txt").exists()
    run_dir.discard_stray(str(tmp_path / "missing"), str(keep))  # a peer rank removed it first
