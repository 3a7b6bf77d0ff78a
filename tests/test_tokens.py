"""Token files (issue 30, ``data=tokens``): memory-mapped .bin of both dtypes and .npy shards,
batches fixed by (seed, step), documents packed at eos, every named error and the vocabulary
check; ``python -m pipeflow.data.prepare`` end to end with a tiny BPE trained here (offline); and
a short run of the real trainer on token files (one in-process gloo rank)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_cases  # noqa: E402
from pipeflow.data import build_batches, microbatch_inputs, shard  # noqa: E402
from pipeflow.data.prepare import main as prepare_main  # noqa: E402
from pipeflow.data.prepare import prepare, train_tokenizer  # noqa: E402
from pipeflow.data.tokens import TokenStream, document_ids, open_tokens, token_paths  # noqa: E402
from pipeflow.errors import ConfigError  # noqa: E402
from pipeflow.run.builder import build_run  # noqa: E402
from pipeflow.config.schema import TokensDataConfig  # noqa: E402
from pipeflow.commands.plan.command import compose_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def data_cfg(path: Path | str, **kw) -> TokensDataConfig:
    base = dict(name="tokens", path=str(path), token_dtype="uint16", pack_documents=False, eos_id=None,
                val_fraction=0.1, seq_len=8, batch_size=4, seed=1, variable_lengths=False, min_seq_len=None)
    return TokensDataConfig(**{**base, **kw})


def model(vocab: int = 1000) -> SimpleNamespace:
    return SimpleNamespace(vocab_size=vocab)


@pytest.mark.parametrize("kind", ["uint16", "uint32", "npy"])
def test_token_files_read_through_memory_maps(tmp_path, kind) -> None:
    tokens = np.arange(700) % 97
    if kind == "npy":
        np.save(tmp_path / "a.npy", tokens[:300].astype(np.int32))
        np.save(tmp_path / "b.npy", tokens[300:].astype(np.uint16))
    else:
        tokens[:300].astype(kind).tofile(tmp_path / "a.bin")
        tokens[300:].astype(kind).tofile(tmp_path / "b.bin")
    (tmp_path / "notes.txt").write_text("not a token file")
    paths = token_paths(tmp_path)
    assert [p.name for p in paths] == (["a.npy", "b.npy"] if kind == "npy" else ["a.bin", "b.bin"])
    maps = [open_tokens(p, "uint16" if kind == "npy" else kind) for p in paths]
    assert all(isinstance(m, np.memmap) for m in maps)
    stream = TokenStream(maps)
    assert np.array_equal(stream.read(290, 20), tokens[290:310])  # across the file boundary
    batches = build_batches(data_cfg(tmp_path, token_dtype="uint16" if kind == "npy" else kind), model())
    x, y = batches.train.get(0)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x) - 97 * (y < x))
    vx, _ = batches.val.get(0)
    assert int(vx.min()) >= 0 and bool(((vx - 630 % 97) % 97 < 70).all())  # from the last 70 tokens only
    assert token_paths(tmp_path / ("*.npy" if kind == "npy" else "a*")) == paths[:1 if kind != "npy" else 2]


def test_batches_are_fixed_by_seed_and_step(tmp_path) -> None:
    np.random.default_rng(0).integers(0, 500, 5000).astype(np.uint16).tofile(tmp_path / "t.bin")
    one, two = build_batches(data_cfg(tmp_path), model()), build_batches(data_cfg(tmp_path), model())
    for step in (0, 7, 3):
        assert all(torch.equal(a, b) for a, b in zip(one.train.get(step), two.train.get(step)))
    assert not torch.equal(one.train.get(0)[0], one.train.get(1)[0])
    other = build_batches(data_cfg(tmp_path, seed=2), model())
    assert not torch.equal(one.train.get(0)[0], other.train.get(0)[0])
    varied = build_batches(data_cfg(tmp_path, variable_lengths=True, min_seq_len=3), model(), chunks=2)
    xs, ys = varied.train.get(5)
    assert len(xs) == 2 and all(x.shape == y.shape and 3 <= x.shape[1] <= 8 for x, y in zip(xs, ys))
    assert all(torch.equal(a, b) for a, b in zip(xs, varied.train.get(5)[0]))


def test_packed_documents_split_at_eos(tmp_path) -> None:
    np.array([5, 6, 0, 7, 8, 9, 0, 4] * 50, dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert document_ids(torch.tensor([[5, 0, 7, 0, 0, 1]]), 0).tolist() == [[0, 1, 1, 2, 3, 3]]
    batches = build_batches(data_cfg(tmp_path, pack_documents=True, eos_id=0), model(10))
    (x, doc), y = batches.train.get(2)
    assert x.shape == doc.shape == y.shape and torch.equal(doc, (x == 0).long().cumsum(1))
    assert bool((doc[:, -1] >= 1).all())  # every window of 8 crosses an eos
    (xs, ys) = build_batches(data_cfg(tmp_path, pack_documents=True, eos_id=0, variable_lengths=True), model(10),
                             chunks=2).train.get(0)
    assert all(isinstance(x, tuple) and x[0].shape == x[1].shape == y.shape for x, y in zip(xs, ys))
    # the trainer's path: a dp share, then micro-batches of (tokens, document ids) as stage 0's inputs
    (sx, sdoc), sy = shard(((x, doc), y), 1, 2)
    assert torch.equal(sx, x[2:]) and torch.equal(sdoc, doc[2:]) and torch.equal(sy, y[2:])
    inputs = microbatch_inputs((sx, sdoc), 2, torch.device("cpu"), torch.float64)
    assert [tuple(t.tolist() for t in mb) for mb in inputs] == [(sx[i:i + 1].tolist(), sdoc[i:i + 1].tolist())
                                                                for i in range(2)]


def test_named_errors(tmp_path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=r"odd\.bin.*3 bytes, not a multiple of 2"):
        build_batches(data_cfg(tmp_path / "odd.bin"), model())
    (tmp_path / "six.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(ConfigError, match=r"six\.bin.*not a multiple of 4.*uint32"):
        build_batches(data_cfg(tmp_path / "six.bin", token_dtype="uint32"), model())
    with pytest.raises(ConfigError, match=r"matches no file"):
        build_batches(data_cfg(tmp_path / "missing*.bin"), model())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no \.bin or \.npy"):
        build_batches(data_cfg(tmp_path / "empty"), model())
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ConfigError, match=r"big\.bin.*id 299.*model\.vocab_size=256"):
        build_batches(data_cfg(tmp_path / "big.bin"), model(256))
    build_batches(data_cfg(tmp_path / "big.bin"), model(300))  # fits
    with pytest.raises(ConfigError, match=r"data\.eos_id=300 is outside"):
        build_batches(data_cfg(tmp_path / "big.bin", eos_id=300, pack_documents=True), model(300))
    with pytest.raises(ConfigError, match=r"needs data\.eos_id"):
        build_batches(data_cfg(tmp_path / "big.bin", pack_documents=True), model(300))
    with pytest.raises(ConfigError, match=r"token_dtype='int8'"):
        build_batches(data_cfg(tmp_path / "big.bin", token_dtype="int8"), model(300))


def test_uint32_ids_read_as_uint16_are_named_and_real_uint16_data_is_not(tmp_path) -> None:
    """Issue 38 item 4: a uint32 file read with data.token_dtype=uint16 trained on interleaved zeros."""
    rng = np.random.default_rng(4)
    rng.integers(1, 900, 3000).astype(np.uint32).tofile(tmp_path / "u32.bin")
    with pytest.raises(ConfigError, match=r"u32\.bin.*looks like uint32 tokens read as data\.token_dtype=uint16.*"
                                          r"set data\.token_dtype=uint32"):
        build_batches(data_cfg(tmp_path / "u32.bin"), model())
    build_batches(data_cfg(tmp_path / "u32.bin", token_dtype="uint32"), model())  # the right dtype: fine
    wide = rng.integers(1, 200_000, 3000).astype(np.uint32)  # ids above 2**16: high halves 0..3
    wide.tofile(tmp_path / "wide.bin")
    with pytest.raises(ConfigError, match=r"wide\.bin.*looks like uint32"):
        build_batches(data_cfg(tmp_path / "wide.bin"), model(65536))
    for name, tokens in (("eos.bin", np.where(rng.random(6000) < 0.4, 0, rng.integers(1, 900, 6000))),
                         ("even0.bin", np.stack([np.zeros(3000), rng.integers(1, 900, 3000)], 1).ravel()),
                         ("tiny.bin", rng.integers(0, 5, 6000))):  # zeros and tiny vocabularies: real uint16
        tokens.astype(np.uint16).tofile(tmp_path / name)
        build_batches(data_cfg(tmp_path / name), model())


def test_a_negative_id_is_named_with_its_file_and_position(tmp_path) -> None:
    """Issue 38 item 4: negative ids in an int64 .npy reached the embedding (an IndexError blamed on the layer)."""
    tokens = np.arange(500, dtype=np.int64) % 97
    tokens[123] = -7
    np.save(tmp_path / "neg.npy", tokens)
    with pytest.raises(ConfigError, match=r"neg\.npy' holds a negative id: -7 at position 123 \(of 500, int64\)"):
        build_batches(data_cfg(tmp_path / "neg.npy"), model())


def test_model_hf_vocabulary_is_read_from_its_config_json(tmp_path) -> None:
    """model=hf has no model.vocab_size: the check reads vocab_size from <model.path>/config.json."""
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    hf = SimpleNamespace(_target_="pipeflow.models.hf.build_hf", path=str(folder), seed=0)
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ConfigError, match=r"big\.bin.*id 299.*vocab_size in .*llama/config\.json=256"):
        build_batches(data_cfg(tmp_path / "big.bin"), hf)
    np.arange(256, dtype=np.uint16).tofile(tmp_path / "fits.bin")
    build_batches(data_cfg(tmp_path / "fits.bin"), hf)
    with pytest.raises(ConfigError, match=r"data\.eos_id=256 is outside.*config\.json=256"):
        build_batches(data_cfg(tmp_path / "fits.bin", eos_id=256, pack_documents=True), hf)
    shipped = SimpleNamespace(path=str(ROOT / "configs" / "hf" / "llama_tiny"))  # experiment=llama_tiny_pp4's
    with pytest.raises(ConfigError, match=r"llama_tiny/config\.json=512"):
        build_batches(data_cfg(tmp_path / "fits.bin", eos_id=512, pack_documents=True), shipped)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("corpus")
    words = "the cat sat on a mat and the dog ran to the park while small birds sang".split()
    rng = np.random.default_rng(0)
    story = " ".join(rng.choice(words, 400))
    (folder / "story.txt").write_text(story)
    lines = [f"note {i}: " + " ".join(words[i % 7:]) for i in range(12)]
    (folder / "notes.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in lines))
    return folder, [story] + lines


def test_prepare_round_trip_with_a_trained_tokenizer(corpus, tmp_path, capsys) -> None:
    folder, texts = corpus
    files = [folder / "story.txt", folder / "notes.jsonl"]
    assert prepare_main([str(f) for f in files] + ["--train-tokenizer", "300", "--text-key", "body",
                                                   "--out", str(tmp_path), "--shard-tokens", "250",
                                                   "--no-progress"]) == 0
    line = capsys.readouterr().out
    summary = json.loads((tmp_path / "prepare.json").read_text())
    assert f"prepared 13 documents, {summary['tokens']} tokens, {summary['shards']} shards (uint16)" in line
    assert summary["shards"] == -(-summary["tokens"] // 250) > 1
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = np.concatenate([np.load(p) for p in token_paths(tmp_path)]).tolist()
    eos = summary["eos_id"]
    assert ids.count(eos) == 13 and ids[-1] == eos
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == eos:
            docs.append(tokenizer.decode(ids[start:i]))
            start = i + 1
    assert docs == texts  # decode of the shards is the corpus, document by document
    batches = build_batches(data_cfg(tmp_path, pack_documents=True, eos_id=eos), model(300))
    assert batches.train.get(0)[0][0].shape == (4, 8)


def test_prepare_errors_and_help(corpus, tmp_path, capsys) -> None:
    folder, _ = corpus
    tokenizer = train_tokenizer([folder / "story.txt"], 260)
    with pytest.raises(ConfigError, match="no string field 'text'"):
        prepare([folder / "notes.jsonl"], tokenizer, 0, tmp_path, progress=False)
    with pytest.raises(ConfigError, match="does not exist"):
        prepare([folder / "nope.txt"], tokenizer, 0, tmp_path, progress=False)
    with pytest.raises(ConfigError, match="at least 257"):
        train_tokenizer([folder / "story.txt"], 100)
    assert prepare_main([str(folder / "story.txt"), "--out", str(tmp_path)]) == 2  # no tokenizer named
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        prepare_main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "usage: python -m pipeflow.data.prepare" in out and "--shard-tokens" in out
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, pipeflow, pipeflow.data, pipeflow.data.tokens; print(sorted(sys.modules))"],
        capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    assert "'pipeflow.data.tokens'" in imported and "tokenizers" not in imported and "transformers" not in imported


def test_the_trainer_learns_from_token_files(one_rank_group, tmp_path) -> None:
    rng = np.random.default_rng(0)
    phrases = [rng.integers(1, 32, 6) for _ in range(4)]  # a corpus of 4 repeated phrases
    np.concatenate([phrases[i] for i in rng.integers(0, 4, 600)]).astype(np.uint16).tofile(tmp_path / "c.bin")
    cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=str(tmp_path / "run"), data__name="tokens",
                                  data__path=str(tmp_path / "c.bin"), optim__lr=3e-2, train__max_steps=20)
    trainer = build_run(cfg, torch.device("cpu"))
    losses = [trainer.train_step(step)[0] for step in range(20)]
    assert losses[0] > 3.0 and sum(losses[-3:]) / 3 < 0.6 * losses[0], losses


def test_the_trainer_takes_packed_documents(one_rank_group, tmp_path) -> None:
    np.array([5, 6, 0, 7, 8, 9, 0, 4] * 50, dtype=np.uint16).tofile(tmp_path / "c.bin")
    first = {}
    for packed in (False, True):
        cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=str(tmp_path / f"run{packed}"), data__name="tokens",
                                      data__path=str(tmp_path / "c.bin"), data__pack_documents=packed, data__eos_id=0,
                                      data__variable_lengths=True, train__eval_batches=2)
        trainer = build_run(cfg, torch.device("cpu"))
        first[packed] = [trainer.train_step(step)[0] for step in range(2)] + [trainer.evaluate()]
    assert all(np.isfinite(first[True])) and first[True][0] != first[False][0]  # the documents reached attention


def test_data_eval_path_holds_out_a_file_and_evaluations_report_perplexity(one_rank_group, tmp_path, caplog) -> None:
    """data.eval_path: the validation batches are the held-out file's (data.path trained on whole);
    train.eval_every's log lines and fit() give the perplexity, exp of the held-out loss."""
    import logging
    import math
    import re

    (np.arange(400) % 17).astype(np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(60) % 7 + 20).astype(np.uint16).tofile(tmp_path / "held.bin")  # ids 20..26: only here
    batches = build_batches(data_cfg(tmp_path / "train.bin", eval_path=str(tmp_path / "held.bin")), model())
    assert len(batches.train.tokens) == 400 and len(batches.val.tokens) == 60  # no val_fraction cut
    assert int(batches.val.get(0)[0].min()) >= 20 and int(batches.train.get(3)[0].max()) < 17
    with pytest.raises(ConfigError, match=r"data.eval_path='.*nothing' matches no file"):
        build_batches(data_cfg(tmp_path / "train.bin", eval_path=str(tmp_path / "nothing")), model())
    with pytest.raises(Exception, match="data=markov has no key eval_path"):  # its own batches: refused composing
        compose_config(["data.eval_path=x.txt"])
    (tmp_path / "a.txt").write_text("abcabcabd" * 20)
    (tmp_path / "b.txt").write_text("dcba" * 10)
    text = build_batches(SimpleNamespace(**{**vars(data_cfg(tmp_path / "a.txt")), "name": "text", "level": "char",
                                            "eval_path": str(tmp_path / "b.txt")}), model())
    assert len(text.train.tokens) == 180 and text.val.tokens[:4].tolist() == [3, 2, 1, 0]  # a.txt's vocabulary
    with pytest.raises(ConfigError, match=r"characters the training text has not \(\['z'\]\)"):
        (tmp_path / "c.txt").write_text("abz" * 10)
        build_batches(SimpleNamespace(**{**vars(data_cfg(tmp_path / "a.txt")), "name": "text", "level": "char",
                                         "eval_path": str(tmp_path / "c.txt")}), model())
    cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=str(tmp_path / "run"), data__name="tokens",
                                  data__path=str(tmp_path / "train.bin"), data__eval_path=str(tmp_path / "held.bin"),
                                  train__max_steps=4, train__eval_every=2, train__eval_batches=2)
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        result = build_run(cfg, torch.device("cpu")).fit()
    loss, ppl = map(float, re.search(r"step +2 \| held-out loss (\S+) \| perplexity (\S+)", caplog.text).groups())
    assert abs(ppl - math.exp(loss)) <= 0.01 * ppl
    assert result["val_perplexity"] == pytest.approx(math.exp(result["val_loss"]))
    assert re.search(r"held-out perplexity [\d.]+ -> [\d.]+", caplog.text)
