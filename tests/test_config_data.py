"""One structured config per data source (issue 49): ``data=<source>`` composes into its own
schema, a key another source takes is refused while composing (naming this source's keys), a
word outside a choice names the allowed ones, and a run saved under the old union of every
source's keys still reads and resumes."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeflow.errors import ConfigError
from pipeflow.config.schema import (DATA_SCHEMAS, ChatDataConfig, Overlong, TextLevel, check_values, typed_config,
                                 typed_data)
from pipeflow.config.data import data_keys
from pipeflow.commands.plan.command import compose_config
from pipeflow.config.saved import upgrade_saved

OLD_RUN_CONFIG = Path(__file__).parent / "fixtures" / "config_before_renames.yaml"


def test_each_source_composes_into_its_own_schema() -> None:
    for source, schema in DATA_SCHEMAS.items():
        cfg = compose_config([f"data={source}"])
        assert OmegaConf.get_type(cfg.data) is schema and list(cfg.data) == data_keys(source), source
    typed = check_values(compose_config(["data=gaussian", "model=mlp"])).data  # checked once, typed
    assert type(typed) is DATA_SCHEMAS["gaussian"] and (typed.name, typed.in_features) == ("gaussian", 32)


def test_a_key_of_another_source_is_refused_naming_this_sources_keys() -> None:
    with pytest.raises(Exception, match=r"'data.level': data=chat has no key level; its keys: name, batch_size, .*"
                                        r"tokenizer, pack_documents, overlong"):
        compose_config(["data=chat", "data.level=byte"])
    with pytest.raises(Exception, match=r"Did you mean data.overlong=drop\?"):  # a near miss: the nearest key
        compose_config(["data=chat", "data.overlng=drop"])
    # issue 57: the previous release took data.vocab_size with data=tokens; the error suggested data.batch_size
    with pytest.raises(Exception, match=r"'data.vocab_size': data=tokens has no key vocab_size; it is the model's "
                                        r"here: model.vocab_size=64. data=tokens's keys: name, batch_size, .*path"):
        compose_config(["data=tokens", "data.vocab_size=64"])
    with pytest.raises(ConfigError, match=r"^data.level is not a key of data=markov; its keys: name, batch_size"):
        typed_data(OmegaConf.create({"name": "markov", "level": "byte"}))  # a plain YAML, read without the schemas
    # a sweep over sources (-m data=markov,text data.path=x.txt): each job takes the keys its source has
    with pytest.warns(UserWarning, match="data.path=x.txt left out of the jobs with data=markov"):
        swept = compose_config(["data=markov", "data.path=x.txt", "hydra.mode=MULTIRUN"])
    assert list(swept.data) == data_keys("markov")


def test_a_choice_names_its_words_and_the_typed_object_holds_the_enum() -> None:
    for override, words in (("data.level=word", "byte, char"), ("data.overlong=cut", "drop, truncate, error"),
                            ("data.token_dtype=int8", "uint16, uint32")):
        source = {"level": "text", "overlong": "chat", "token_dtype": "tokens"}[override[5:].partition("=")[0]]
        with pytest.raises(Exception, match=override) as info:
            compose_config([f"data={source}", override])
        assert f"expected one of [{words}]" in str(info.value.__cause__)
    chat = typed_data(compose_config(["data=chat", "data.path=c.jsonl", "data.overlong=truncate"]).data)
    assert isinstance(chat, ChatDataConfig) and chat.overlong is Overlong.truncate and chat.overlong == "truncate"
    assert typed_data(compose_config(["data=text", "data.path=t.txt"]).data).level is TextLevel.byte


def test_a_model_reading_a_key_its_data_lacks_is_named_and_optim_is_a_section() -> None:
    with pytest.raises(ConfigError, match=r"^model.num_classes=\$\{data.num_classes\} but data=markov has no "
                                          r"num_classes: choose data that has it \(data=gaussian, cifar10"):
        check_values(compose_config(["model=resnet18"]))
    with pytest.raises(ConfigError, match=r"^model.vocab_size=\$\{data.vocab_size\} but data=chat has no vocabulary "
                                          r"of its own: its token ids are its tokenizer's .* use model=hf model.path="):
        check_values(compose_config(["data=chat"]))  # issue 57: it said "choose data that has it"
    with pytest.raises(ConfigError, match=r"optim=adamw: optim is no longer a config group .* optim.<key>="):
        compose_config(["optim=adamw"])
    assert compose_config(["optim.lr=0.5"]).optim.lr == 0.5


def test_a_saved_union_config_is_read_with_its_sources_keys_and_resumes(tmp_path: Path) -> None:
    saved = upgrade_saved(OmegaConf.load(OLD_RUN_CONFIG), str(OLD_RUN_CONFIG))  # markov, every source's keys
    assert list(saved.data) == data_keys("markov") and typed_config(saved).data.num_tokens == 200000
    chat_run = OmegaConf.load(OLD_RUN_CONFIG)
    chat_run.data.update(name="chat", path="c.jsonl", overlong="truncate", pack_documents=True)
    chat = upgrade_saved(chat_run, "config.yaml")
    assert list(chat.data) == data_keys("chat") and OmegaConf.get_type(chat.data) is ChatDataConfig
    assert typed_data(chat.data).overlong is Overlong.truncate and "level" not in chat.data
    gone = OmegaConf.load(OLD_RUN_CONFIG)
    gone.data.name = "imagenet"  # a source unknown today: read as saved, not refused
    assert upgrade_saved(gone, "config.yaml").data.level == "byte"
