"""A model's config: named by its builder's import path (``_target_``), typed and defaulted by
the builder's own signature (one source of defaults), and no seed but data.seed and model.seed."""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method

from pipeflow.errors import ConfigError
from pipeflow.models import ModelSpec
from pipeflow.run import config
from pipeflow.run.config import model_schema, register_configs

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = [config.GPTModelConfig, config.MLPModelConfig, config.ResNetModelConfig, config.SleepModelConfig,
           config.TorchvisionModelConfig, config.ModuleModelConfig]


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def _builder_defaults(builder) -> dict:
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_a_schema_defaults_to_exactly_its_builders_defaults(schema: type) -> None:
    """Every built-in schema holds the builder's keyword arguments with the builder's defaults:
    one source, so `SleepModelConfig.num_layers` can no longer drift from `build_sleep`'s."""
    fields = {f.name: f.default for f in dataclasses.fields(schema)}
    builder = get_method(fields.pop("_target_"))
    assert fields == _builder_defaults(builder)


def test_a_users_builder_gets_its_schema_from_its_signature() -> None:
    def build_mine(width: int = 7, rate: float = 0.5, name: str = "x") -> ModelSpec:
        """My model."""
        raise AssertionError("not built here")

    schema = model_schema(build_mine)
    assert [(f.name, f.type, f.default) for f in dataclasses.fields(schema)][1:] == [
        ("width", int, 7), ("rate", float, 0.5), ("name", str, "x")]
    assert schema().width == 7 and schema(width=3).width == 3
    assert schema.__name__ == "BuildMineConfig" and schema.__doc__ == "My model."

    def build_undefaulted(width: int) -> ModelSpec:
        raise AssertionError("not built here")

    with pytest.raises(ConfigError, match=r"build_undefaulted\(width\) has no default"):
        model_schema(build_undefaulted)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs" / "model").glob("*.yaml")))
def test_every_model_group_names_its_builder_by_import_path(name: str) -> None:
    """`model=<name>` names its model by `_target_` alone, and every key is the builder's argument."""
    cfg = _compose(f"model={name}")
    keys = dict(cfg.model)
    builder = get_method(keys.pop("_target_"))
    assert set(keys) <= set(_builder_defaults(builder))


def test_train_seed_is_gone_and_the_effective_seeds_are_unchanged() -> None:
    """train.seed was parsed and never read: it is refused now; the seeds that act are
    data.seed (1234) and model.seed (0), as before."""
    cfg = _compose()
    assert cfg.data.seed == 1234 and cfg.model.seed == 0
    assert "seed" not in cfg.train
    with pytest.raises(ConfigCompositionException, match="seed"):
        _compose("train.seed=3")


@pytest.mark.parametrize("group", ["model", "optim", "pipeline", "metrics", "plan"])
def test_a_group_file_restates_no_default(group: str) -> None:
    """The schema (for models: the builder) is the one source of a default; a group's YAML sets
    only values that differ from it, so the two cannot drift. (What a preset is, ``arch:
    resnet18``, is stated whatever the default; data presets are exempt for the same reason: a
    dataset's facts, such as CIFAR-10's 10 classes.)"""
    import yaml
    from hydra.core.config_store import ConfigStore

    register_configs()
    for path in sorted((ROOT / "configs" / group).glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        (base,) = [d for d in values.pop("defaults") if isinstance(d, str) and d.startswith("base_")]
        schema = ConfigStore.instance().load(f"{group}/{base}.yaml").node
        restated = [key for key, value in values.items()
                    if key not in ("_target_", "arch") and key in schema and schema[key] == value]
        assert not restated, f"{path.relative_to(ROOT)} restates the defaults of {restated}"


def test_a_module_model_without_its_class_is_one_config_error() -> None:
    """`model=module` without `model.module._target_` used to end in a 34-frame traceback from
    Hydra's instantiate (MissingMandatoryValue): now check_config names the key to set."""
    cfg = _compose("model=module")
    with pytest.raises(ConfigError, match=r"^model.module._target_ is not set: model=module needs the import path of "
                                          r"your nn.Module's class, e.g. model.module._target_=examples.your_module.GPT"):
        config.check_config(cfg, world_size=4)
    cfg.model.module._target_ = "examples.your_module.GPT"
    assert config.check_config(cfg, world_size=4) == (1, 4)


def test_a_custom_model_config_without_target_is_one_config_error() -> None:
    """A model config (e.g. a user's YAML on the search path) that names no builder."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(_compose("model=mlp")))  # untyped, as a user's YAML
    del cfg.model["_target_"]
    with pytest.raises(ConfigError, match=r"^model has no _target_: .* set model._target_=<import path of a function "
                                          r"returning a pipeflow ModelSpec>"):
        config.check_config(cfg, world_size=4)
