"""Renamed config keys (pipeflow.config.renames): an old name that was published works and
warns naming the new key; a removed name is an error naming what to write; a run directory
written under the old names resumes; the typed config checks each section once."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeflow.errors import ConfigError, DeprecatedKeyWarning
from pipeflow.config import renames as config_renames
from pipeflow.run import discover
from pipeflow.config.schema import Config, RecvPosting, ShapeMode, TrainConfig, check_values, typed_config
from pipeflow.config.renames import RENAMES, KeyRename
from pipeflow.config.saved import upgrade_saved
from pipeflow.run.guard import flatten_config
from pipeflow.commands.plan.command import compose_config

OLD_RUN_CONFIG = Path(__file__).parent / "fixtures" / "config_before_renames.yaml"

# (old override, new key, the new key's value): one per published alias
ALIASES = [
    ("train.dtype=float64", "train.param_dtype", "float64"),
    ("comm.dynamic_shapes=true", "comm.shapes", "per_step"),
    ("comm.variable_shapes=true", "comm.shapes", "per_microbatch"),
    ("comm.recvs_ahead=false", "comm.post_recvs", "at_step"),
    ("pipeline.max_activations=3", "schedule.max_inflight_microbatches", 3.0),
    ("pipeline.stages_per_rank=3", "schedule.stages_per_rank", 3),
    ("pipeline.placement=v", "schedule.placement", "v"),
    ("pipeline.stage_to_rank=[1,0]", "schedule.stage_to_rank", [1, 0]),
    ("plan.tp=[1,2]", "plan.tp_sizes", [1, 2]),
    ("plan.offload=[none,auto]", "plan.offload_modes", ["none", "auto"]),
    ("metrics.log_every=5", "train.log_every", 5),
]


def test_every_rename_has_an_alias_case() -> None:
    assert {old.partition("=")[0] for old, _, _ in ALIASES} == {r.old for r in RENAMES}


@pytest.mark.parametrize(("override", "key", "value"), ALIASES, ids=[a[0].partition("=")[0] for a in ALIASES])
def test_a_published_old_key_warns_naming_the_new_one_and_works(override: str, key: str, value: object) -> None:
    with pytest.warns(DeprecatedKeyWarning, match=rf"{override.partition('=')[0]}=.* is deprecated: write {key}="):
        cfg = compose_config([override])
    got = OmegaConf.select(cfg, key)
    assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value
    assert override.partition("=")[0] not in OmegaConf.to_yaml(cfg)  # --cfg job shows the new key only


def test_two_old_booleans_make_one_shapes_mode_and_false_never_lowers_it() -> None:
    with pytest.warns(DeprecatedKeyWarning):
        both = compose_config(["comm.variable_shapes=true", "comm.dynamic_shapes=false"])
        assert both.comm.shapes == "per_microbatch"
        assert compose_config(["comm.dynamic_shapes=true", "comm.variable_shapes=false"]).comm.shapes == "per_step"
    assert compose_config([]).comm.shapes is ShapeMode.static


def test_one_logging_interval_key_and_saved_runs_keep_theirs() -> None:
    with pytest.warns(DeprecatedKeyWarning):
        assert compose_config(["metrics.log_every=null", "train.log_every=7"]).train.log_every == 7  # null: unset
        assert compose_config(["train.log_every=7", "metrics.log_every=3"]).train.log_every == 3
    for saved, kept in (({"log_every": None}, 25), ({"log_every": 4}, 4)):  # it won where set, as before
        cfg = OmegaConf.create({"train": {"log_every": 25}, "metrics": saved})
        config_renames.rename_keys(cfg, warn=False)
        assert cfg.train.log_every == kept and "log_every" not in cfg.metrics


def test_an_old_key_keeps_its_old_value_check() -> None:
    with pytest.raises(ConfigError, match=r"comm.recvs_ahead=1 must be true, false or auto; .*comm.post_recvs="):
        compose_config(["comm.recvs_ahead=1"])


def test_a_choice_refuses_other_words_naming_the_allowed_ones() -> None:
    with pytest.raises(Exception, match="comm.shapes=dynamic") as info:
        compose_config(["comm.shapes=dynamic"])
    assert "static, per_step, per_microbatch" in str(info.value.__cause__)
    assert compose_config(["comm.post_recvs=at_step"]).comm.post_recvs is RecvPosting.at_step
    with pytest.raises(Exception, match="schedule.placement=zigzag") as info:
        compose_config(["schedule.placement=zigzag"])
    assert "loop, v" in str(info.value.__cause__)


def test_a_removed_group_or_name_is_an_error_naming_what_to_write(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"pipeline=default: pipeline is no longer a config group .* pipeline.<key>="):
        compose_config(["pipeline=default"])
    gone = KeyRename("train.precision_mode", "train.precision", deprecated=False)
    monkeypatch.setitem(config_renames.BY_OLD, gone.old, gone)
    with pytest.raises(ConfigError, match=r"^train.precision_mode was renamed train.precision: write "
                                          r"train.precision=bf16"):
        compose_config(["train.precision_mode=bf16"])


def test_an_old_key_in_a_yaml_file_is_read_under_its_new_name(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\ntrain:\n  dtype: float64\n"
                                                      "pipeline:\n  stages_per_rank: 3\n")
    with pytest.warns(DeprecatedKeyWarning) as warned:
        cfg = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "experiment=old"])
    named = sorted(str(w.message).split(" is ")[0] for w in warned)
    assert named == ["pipeline.stages_per_rank=3", "train.dtype=float64"]
    assert {w.filename for w in warned} == {"experiment/old.yaml"}
    assert cfg.train.param_dtype == "float64" and cfg.schedule.stages_per_rank == 3


def test_a_run_dir_written_under_old_keys_resumes(tmp_path: Path, caplog) -> None:
    run = tmp_path / "old_run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    shutil.copy(OLD_RUN_CONFIG, run / "config.yaml")
    (run / "checkpoints" / "step_3" / "meta.json").write_text(json.dumps({"step": 3}))
    saved = upgrade_saved(OmegaConf.load(run / "config.yaml"), str(run / "config.yaml"))
    assert saved.train.param_dtype == "float32" and saved.comm.shapes == "static" and "dtype" not in saved.train
    now = compose_config(["train.resume=auto"])
    differ = discover.differences(flatten_config(saved), flatten_config(now))
    assert [d for d in differ if not discover.ignored(d[0])] == []
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        assert discover.find_run(str(tmp_path), now) == str(run)
    assert "train.dtype -> train.param_dtype" in caplog.text


def test_generate_reads_an_old_run_config_and_old_overrides(tmp_path: Path) -> None:
    from pipeflow.commands.generate import run_config

    run = tmp_path / "old_run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    shutil.copy(OLD_RUN_CONFIG, run / "config.yaml")
    (run / "checkpoints" / "step_3" / "meta.json").write_text(json.dumps({"step": 3}))
    with pytest.warns(DeprecatedKeyWarning, match="write comm.shapes=per_step"):
        cfg, path = run_config([f"train.resume={run / 'checkpoints' / 'step_3'}", "comm.dynamic_shapes=true"])
    assert path.endswith("step_3") and cfg.train.param_dtype == "float32" and cfg.comm.shapes == "per_step"


def test_the_typed_config_checks_each_section_once() -> None:
    typed = check_values(compose_config(["train.param_dtype=float64"]))
    assert isinstance(typed, Config) and isinstance(typed.train, TrainConfig) and typed.train.param_dtype == "float64"
    assert typed.model["n_layer"] == 6 and typed.comm.shapes is ShapeMode.static
    with pytest.raises(ConfigError, match=r"^train.param_dtype='fp8' is not one of"):
        TrainConfig(param_dtype="fp8")  # a section checks itself when built, as Hydra's composing does not
    untyped = OmegaConf.create({"train": {"max_steps": 0}})  # a user's YAML read without the schemas
    with pytest.raises(ConfigError, match=r"^train.max_steps=0 must be at least 1"):
        typed_config(untyped)
    with pytest.raises(ConfigError, match=r"schedule.path is not set"):
        typed_config(compose_config(["schedule=custom", "schedule.path=???"]))
