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
from pipeflow.config import schema as config
from pipeflow.config.schema import model_schema, register_configs

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
    fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # a nested config
              for f in dataclasses.fields(schema)}
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
    """`model=<name>` names its model by `_target_` alone, and every key is the builder's argument
    (on data with the keys it reads: a classifier's classes)."""
    data = {"mlp": ["data=gaussian"], "resnet18": ["data=fakedata"], "resnet50": ["data=fakedata"],
            "torchvision": ["data=fakedata"]}.get(name, [])
    cfg = _compose(f"model={name}", *data)
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


@pytest.mark.parametrize("group", ["model", "schedule"])
def test_a_group_file_restates_no_default(group: str) -> None:
    """The schema (for models: the builder) is the one source of a default; a group's YAML sets
    only values that differ from it, so the two cannot drift. (What a preset is, ``arch:
    resnet18``, ``name: 1f1b``, is stated whatever the default; data presets are exempt for the
    same reason: a dataset's facts, such as CIFAR-10's 10 classes.)"""
    import yaml
    from hydra.core.config_store import ConfigStore

    register_configs()
    for path in sorted((ROOT / "configs" / group).glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        (base,) = [d for d in values.pop("defaults") if isinstance(d, str) and d.startswith("base_")]
        schema = ConfigStore.instance().load(f"{group}/{base}.yaml").node
        restated = [key for key, value in values.items()
                    if key not in ("_target_", "arch", "name") and key in schema and schema[key] == value]
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

    cfg = OmegaConf.create(OmegaConf.to_container(_compose("model=mlp", "data=gaussian")))  # untyped, as a user's YAML
    del cfg.model["_target_"]
    with pytest.raises(ConfigError, match=r"^model has no _target_: .* set model._target_=<import path of a function "
                                          r"returning a pipeflow ModelSpec>"):
        config.check_config(cfg, world_size=4)


@pytest.mark.parametrize("name", ["mlp", "gpt", "sleep"])
def test_model_init_from_loads_every_built_in_model_from_its_export(tmp_path: Path, name: str) -> None:
    """Issue 38: ``model.init_from`` was refused for model=gpt|mlp|sleep with Hydra's
    ``+model.init_from`` hint, which then failed inside the builder. Every model takes it now; the
    built-in ones read ``<layer index>.<key>``, what ``python -m pipeflow.checkpoint export``
    writes for them, each layer its own keys."""
    import torch
    from pipeflow.run.builder import build_spec

    extra = ["data=gaussian"] if name == "mlp" else ["model.tie_embeddings=true"] if name == "gpt" else []
    spec = build_spec(_compose(f"model={name}", *extra).model)
    state = {key: value + 1 for key, value in torch.nn.ModuleList(spec.build_all()).state_dict().items()}
    torch.save(state, tmp_path / "export.pt")
    cfg = _compose(f"model={name}", *extra, f"model.init_from={tmp_path / 'export.pt'}")
    loaded = torch.nn.ModuleList(build_spec(cfg.model).build_all()).state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    last = max(int(key.split(".")[0]) for key in state)
    torch.save({k: v for k, v in state.items() if not k.startswith(f"{last}.")}, tmp_path / "part.pt")
    cfg.model.init_from = str(tmp_path / "part.pt")
    with pytest.raises(ConfigError, match=rf"^layer '[\w.]+': model.init_from='.*part.pt' has no '{last}\.[\w.]+'; it must "
                                          r"hold the keys <layer index>.<key> .* as python -m pipeflow.checkpoint export"):
        build_spec(cfg.model).build_layers([last])


def test_a_builder_that_cannot_be_imported_is_named_in_one_line() -> None:
    """Issue 57: model._target_=no.such.module.build gave Hydra's InstantiationException text,
    naming no key."""
    from omegaconf import OmegaConf
    from pipeflow.run.builder import build_spec

    with pytest.raises(ConfigError, match=r"^model._target_='no.such.module.build' cannot be imported \(.*'no'.*\): "
                                          r"give the import path of a builder"):
        build_spec(OmegaConf.create({"_target_": "no.such.module.build"}))


def test_a_builders_own_error_is_its_one_line_not_hydras_wrapper(tmp_path: Path) -> None:
    """Issue 38: every model=hf ConfigError arrived inside Hydra's InstantiationException (the
    builder's line buried in a traceback); build_spec raises the builder's own error, Hydra's
    wrapper kept as its context."""
    from hydra.errors import InstantiationException
    from pipeflow.run.builder import build_spec

    with pytest.raises(ConfigError, match=r"^model=hf needs model.path=") as caught:
        build_spec(_compose("model=hf").model)
    assert isinstance(caught.value.__context__, InstantiationException)
    with pytest.raises(ConfigError, match=rf"^model.path='{tmp_path}/none' does not exist"):
        build_spec(_compose("model=hf", f"model.path={tmp_path}/none").model)


def test_a_key_the_builder_does_not_take_is_one_config_error() -> None:
    """``+model.foo=1`` (Hydra's own hint for an unknown key) used to reach the builder as a
    TypeError inside Hydra's traceback: it is one line naming the key and the builder's arguments."""
    from pipeflow.run.builder import build_spec

    cfg = _compose("model=mlp", "data=gaussian", "+model.width=3")
    with pytest.raises(ConfigError, match=r"^model.width is not an argument of pipeflow.models.mlp.build_mlp, which takes: "
                                          r"in_features, hidden, num_layers, num_classes, seed, init_from; remove model.width"):
        build_spec(cfg.model)


def test_a_users_builder_on_a_built_in_schema_is_not_passed_its_null_keys() -> None:
    """examples/configs/model/residual_mlp.yaml builds with its own builder on ``base_mlp``, which
    gained ``init_from`` (null): a null key the builder does not take is not passed to it; set,
    it is one line naming the builder's arguments."""
    from pipeflow.run.builder import build_spec

    overrides = (f"hydra.searchpath=[file://{ROOT / 'examples' / 'configs'}]", "model=residual_mlp", "data=gaussian")
    assert build_spec(_compose(*overrides).model).name
    with pytest.raises(ConfigError, match=r"^model.init_from is not an argument of examples.custom_model.build_residual_mlp"):
        build_spec(_compose(*overrides, "model.init_from=x.pt").model)


def test_rows_longer_than_the_models_positions_are_refused_naming_both_keys() -> None:
    """Issue 57: model.block_size=8 data.seq_len=16 stopped in the first step with a StageError
    (an index error in the position embedding), no key named."""
    from pipeflow.config.schema import check_config

    with pytest.raises(ConfigError, match=r"^data.seq_len=16 is longer than model.block_size=8, the positions the "
                                          r"model has: set model.block_size=16 \(or more\), or data.seq_len=8$"):
        check_config(_compose("model.block_size=8", "data.seq_len=16"), 1)
    assert check_config(_compose("model.block_size=16", "data.seq_len=16"), 1) == (1, 1)
