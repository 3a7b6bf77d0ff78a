"""data=chat: conversations tokenised with the model's chat template, assistant turns trained
(with their end-of-turn token), everything else masked, packed into rows with document ids;
``prepare --chat``; named errors.  A tiny tokenizer made here (tests/chat_fixtures.py).

The Trainer on data=chat against the unsplit model (dp x pp) runs in test_scale's gloo world
(tests/masked_cases.py).
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import chat_fixtures as fx  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.data import build_batches  # noqa: E402
from pipeflow.data.chat import load_chat_tokenizer, tokenize_conversation  # noqa: E402
from pipeflow.data.chat_rows import ChatBatches, pack_rows, tokenize_conversations  # noqa: E402
from pipeflow.data.prepare import main as prepare_main  # noqa: E402
from pipeflow.errors import ChatDataError, ConfigError  # noqa: E402
from pipeflow.config.schema import ChatDataConfig  # noqa: E402


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny tokenizer with and without {% generation %} markers: {name: (folder, tokenizer)}."""
    made = {}
    for name, markers in (("marked", True), ("plain", False)):
        folder = fx.write_tokenizer(tmp_path_factory.mktemp(name), markers)
        made[name] = (folder, load_chat_tokenizer(folder))
    return made


def _trained_tokens(tokenizer, conversation) -> list[str]:
    ids, trained = tokenize_conversation(tokenizer, conversation, "test")
    return [t for t, keep in zip(tokenizer.convert_ids_to_tokens(ids), trained) if keep]


@pytest.mark.parametrize("kind", ["marked", "plain"])
def test_assistant_turns_are_trained_with_their_end_of_turn_token_the_rest_masked(tokenizers, kind: str) -> None:
    """The template's own mask ({% generation %}), or without markers the prefix renderings, mark
    exactly the assistant contents and each turn's end-of-turn token (system and user turns,
    the template's headers: masked)."""
    _, tokenizer = tokenizers[kind]
    assert _trained_tokens(tokenizer, fx.CONVERSATIONS[1]) == ["five", fx.END, "sure", fx.END]
    assert _trained_tokens(tokenizer, fx.CONVERSATIONS[3]) == ["hi", "how", "are", "you", fx.END, "bye", fx.END]
    marked = [tokenize_conversation(tokenizers["marked"][1], c, "t") for c in fx.CONVERSATIONS]
    assert [tokenize_conversation(tokenizer, c, "t") for c in fx.CONVERSATIONS] == marked


def test_named_errors_name_the_file_and_line(tokenizers, tmp_path) -> None:
    _, tokenizer = tokenizers["marked"]
    path = fx.write_jsonl(tmp_path / "bad.jsonl", fx.CONVERSATIONS[:1], extra=[{"text": "no messages here"}])
    with pytest.raises(ChatDataError, match=r"bad.jsonl:2: no conversation: a row needs \"messages\""):
        tokenize_conversations([path], tokenizer)
    fx.write_jsonl(path, [[{"content": "who am I"}]])
    with pytest.raises(ChatDataError, match="bad.jsonl:1: message 0 .* needs a string \"role\""):
        tokenize_conversations([path], tokenizer)
    fx.write_jsonl(path, [[{"role": "user", "content": "hi"}, {"role": "asistant", "content": "ok"}]])
    with pytest.raises(ChatDataError, match=r"bad.jsonl:1: message 1 has role 'asistant'; the roles are system, user, "
                                            r"assistant, tool"):  # issue 57: trained on nothing, silently
        tokenize_conversations([path], tokenizer)
    fx.write_jsonl(path, [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]])
    with pytest.raises(ChatDataError, match=r"bad.jsonl:1: message 1 \(assistant\) has content None; a message's "
                                            r"content is text"):
        tokenize_conversations([path], tokenizer)
    fx.write_jsonl(path, [[{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]])
    with pytest.raises(ChatDataError, match=r"bad.jsonl:1: the chat template refuses .*\['tool', 'assistant'\].*"
                                            r"role tool is not supported"):
        tokenize_conversations([path], tokenizer)
    path.write_text("{not json\n")
    with pytest.raises(ChatDataError, match="bad.jsonl:1 is not a JSON line"):
        tokenize_conversations([path], tokenizer)
    (tmp_path / "bare").mkdir()
    fx.write_tokenizer(tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink()
    with pytest.raises(ChatDataError, match="has no chat template"):
        load_chat_tokenizer(tmp_path / "bare")


@pytest.fixture(scope="module")
def conversations(tokenizers, tmp_path_factory):
    path = fx.write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl")
    return tokenize_conversations([path], tokenizers["marked"][1])


def test_packed_rows_keep_conversations_apart_and_train_only_assistant_tokens(conversations) -> None:
    rows, counts = pack_rows(conversations, 24, "drop", pad_id=0)
    assert counts["dropped"] == counts["truncated"] == 0 and counts["rows"] < len(conversations)  # packed
    x, doc, y = rows.inputs, rows.documents, rows.targets
    same = doc[:, 1:] == doc[:, :-1]
    kept = y[:, :-1] != -100
    assert torch.equal(y[:, :-1][kept & same], x[:, 1:][kept & same])  # the next token of the same conversation
    assert bool((doc[:, 1:] >= doc[:, :-1]).all())  # ids grow along a row: attention is block-diagonal
    # every trained token but a conversation's first is a target once
    firsts = conversations.trained[conversations.starts[:-1]].sum()
    assert counts["targets"] == int(kept.sum() + (y[:, -1] != -100).sum()) == conversations.trained.sum() - firsts
    assert bool((x[y == -100].numel() > 0)) and bool((y[x == 0] == -100).all())  # padding (pad id 0) masked


def test_a_conversation_longer_than_a_row_is_dropped_truncated_or_refused(conversations) -> None:
    longest = int(max(torch.tensor(conversations.starts).diff()))
    rows, counts = pack_rows(conversations, longest - 3, "drop")
    assert counts["dropped"] == 1 and counts["truncated"] == 0
    rows, counts = pack_rows(conversations, longest - 3, "truncate")
    assert counts["dropped"] == 0 and counts["truncated"] == 1
    with pytest.raises(ChatDataError, match=rf"chats.jsonl:2: a conversation of {longest} tokens is longer than a row "
                                            rf"\(data.seq_len={longest - 3}.*data.overlong=drop or truncate"):
        pack_rows(conversations, longest - 3, "error")
    with pytest.raises(ConfigError, match="data.overlong='cut' is unknown"):
        pack_rows(conversations, 32, "cut")
    rows, counts = pack_rows(conversations, 32, pack=False)  # one conversation a row
    assert counts["rows"] == len(conversations) and bool((rows.documents <= 1).all())


def test_batches_visit_every_row_once_an_epoch_the_same_on_every_call(conversations) -> None:
    rows, counts = pack_rows(conversations, 16, "truncate")
    batches = ChatBatches(rows, 2, seed=5)
    (x, doc), y = batches.get(0)
    assert x.shape == doc.shape == y.shape == (2, 16) and x.dtype == torch.long
    epoch = torch.cat([ChatBatches(rows, 1, seed=5).get(k)[0][0] for k in range(counts["rows"])])
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, rows.inputs.tolist()))
    assert torch.equal(ChatBatches(rows, 2, seed=5).get(3)[1], batches.get(3)[1])


def _chat_config(**keys) -> object:
    return OmegaConf.merge(OmegaConf.structured(ChatDataConfig), {"name": "chat", "seq_len": 24, "batch_size": 2, "pack_documents": False,
                                                              "val_fraction": 0.25, **keys})


def test_prepare_chat_writes_what_data_chat_reads_and_parquet_reads_as_jsonl(tokenizers, tmp_path, capsys) -> None:
    folder, _ = tokenizers["marked"]
    jsonl = fx.write_jsonl(tmp_path / "chats.jsonl")
    assert prepare_main(["--chat", str(jsonl), "--tokenizer", str(folder), "--out", str(tmp_path / "out"),
                         "--no-progress"]) == 0
    assert "prepared 4 conversations" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["format"] == "chat"
    model = OmegaConf.create({"vocab_size": 64})
    direct = build_batches(_chat_config(path=str(jsonl), tokenizer=str(folder)), model)
    prepared = build_batches(_chat_config(path=str(tmp_path / "out")), model)
    pytest.importorskip("datasets")
    import pandas

    pandas.DataFrame({"messages": fx.CONVERSATIONS}).to_parquet(tmp_path / "chats.parquet")
    parquet = build_batches(_chat_config(path=str(tmp_path / "chats.parquet"), tokenizer=str(folder)), model)
    for step in range(3):
        for other in (prepared, parquet):
            (a, da), ya = direct.train.get(step)
            (b, db), yb = other.train.get(step)
            assert torch.equal(a, b) and torch.equal(da, db) and torch.equal(ya, yb)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        build_batches(_chat_config(path=str(jsonl), tokenizer=str(folder)), OmegaConf.create({"vocab_size": 8}))
    with pytest.raises(ConfigError, match="set model.path"):
        build_batches(_chat_config(path=str(jsonl)), model)
    with pytest.raises(ConfigError, match="data.variable_lengths=false"):
        build_batches(_chat_config(path=str(jsonl), variable_lengths=True), model)
    # the model's own folder (model=hf's model.path) holds the tokenizer and its chat template
    model_folder = OmegaConf.create({"path": str(folder)})
    from_model = build_batches(_chat_config(path=str(jsonl), pack_documents=False), model_folder)
    x, y = from_model.train.get(0)
    assert x.shape == y.shape == (2, 24) and torch.is_tensor(x)  # one conversation a row: tokens alone


def test_data_eval_path_holds_out_other_conversations(tokenizers, tmp_path) -> None:
    """data=chat with data.eval_path: data.path's conversations all trained, the held-out file's
    (tokenised with the same tokenizer, or a prepared folder) the validation rows."""
    folder, _ = tokenizers["marked"]
    jsonl = fx.write_jsonl(tmp_path / "chats.jsonl")
    held = fx.write_jsonl(tmp_path / "held.jsonl", fx.CONVERSATIONS[:1])
    model = OmegaConf.create({"vocab_size": 64})
    split = build_batches(_chat_config(path=str(jsonl), tokenizer=str(folder), pack_documents=False), model)
    both = build_batches(_chat_config(path=str(jsonl), tokenizer=str(folder), pack_documents=False,
                                      eval_path=str(held)), model)
    assert len(split.train.rows.inputs) == 3 and len(both.train.rows.inputs) == 4  # val_fraction 0.25 not cut
    assert len(both.val.rows.inputs) == 1 and torch.equal(both.val.rows.inputs[0], both.train.rows.inputs[0])
    with pytest.raises(ChatDataError, match="data.eval_path="):
        build_batches(_chat_config(path=str(jsonl), tokenizer=str(folder), eval_path=str(tmp_path / "none")), model)


def test_training_data_with_nothing_to_learn_is_named_as_the_training_data(tokenizers, tmp_path) -> None:
    """No assistant turn, or truncation that cuts every answer: data.path named with the fix, not
    an AllTargetsMaskedError blaming the evaluation's batches (issue 57, item 10)."""
    folder, _ = tokenizers["marked"]
    model = OmegaConf.create({"vocab_size": 64})
    prompts = fx.write_jsonl(tmp_path / "prompts.jsonl", [[{"role": "user", "content": "hello how are you"}]] * 4)
    with pytest.raises(ChatDataError, match=r"the 3 trained conversations of data.path=.*prompts.jsonl have no "
                                            r"assistant turn: every token is prompt"):
        build_batches(_chat_config(path=str(prompts), tokenizer=str(folder)), model)
    long_prompt = [{"role": "user", "content": "hello how are you " * 8}, {"role": "assistant", "content": "fine"}]
    cut = fx.write_jsonl(tmp_path / "cut.jsonl", [long_prompt] * 4)
    with pytest.raises(ChatDataError, match=r"keep no assistant token in rows of data.seq_len=24 "
                                            r"\(data.overlong=truncate drops or cuts every answer\): raise data.seq_len"):
        build_batches(_chat_config(path=str(cut), tokenizer=str(folder), overlong="truncate"), model)
