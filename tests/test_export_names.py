"""`python -m pipeflow.checkpoint export` writes the model's own names (issue 30, "back out").

Each checkpoint is written in-process by a one-rank gloo group (the Trainer of ``train.py``,
trained a few steps), then exported in the same process, no group needed:

- ``from_module`` models (the examples' GPT in the blocks form, a traced SkipNet whose skip crosses
  every split point): ``--format pt`` keys are the original module's ``state_dict`` names, it
  loads ``strict=True`` and gives the pipelined layers' outputs; the same names and values (to
  float64 rounding) from pp=2 and from dp=2 with ``parallel.shard=full`` (2 processes);
- ``--format hf`` with a spec of this file that sets ``save_config`` and ``export_name`` (so it
  does not depend on ``model=hf``): config.json, safetensors under the mapped names, the tie
  once, shards with Hugging Face's index beyond ``--max-shard-size``;
- named errors: an existing target, ``--format hf`` for a model without a Hugging Face form; a
  run without its config.yaml keeps ``<layer index>.<key>``;
- ``model=hf``: a tiny random Llama (tied head) trained 2 steps, exported ``--format hf``:
  ``AutoModelForCausalLM.from_pretrained`` gives the pipelined layers' logits; ``--format pt``
  loads ``strict=True`` into the ``LlamaForCausalLM``.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeflow.errors import CheckpointError, ConfigError
from pipeflow.models import LayerSpec, ModelSpec
from pipeflow.models.module_spec import cross_entropy
from pipeflow.models.spec import run_layers
from pipeflow.checkpoint import saving as ck
from pipeflow.run.builder import build_run
from pipeflow.commands.plan.command import compose_config
from pipeflow.runtime.stage import layers_by_index

GPT_ARGS = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trained(run_dir: Path, overrides: list[str], steps: int = 2,
             dtype: str = "float64") -> tuple[str, dict[int, nn.Module]]:
    """Train `steps` steps of the config's model in this process (pp=1), save; returns the
    checkpoint and the trained layers by index."""
    cfg = compose_config([
        *overrides, "pipeline.num_microbatches=2", "pipeline.profile=false", f"train.dtype={dtype}",
        "train.eval_every=0", "train.log_every=100", f"train.max_steps={steps}", f"train.run_dir={run_dir}",
        "metrics.memory_steps=[]"])
    trainer = build_run(cfg, torch.device("cpu"))
    for step in range(steps):
        trainer.train_step(step)
    path = trainer.save_checkpoint(steps)
    return path, layers_by_index(trainer.parts.stages, trainer.ranges)


def _gpt_overrides() -> list[str]:
    return ["model=module", "model.module._target_=examples.your_module.GPT",
            *[f"+model.module.{k}={v}" for k, v in GPT_ARGS.items()],
            "model.before=[tok_emb,pos_emb]", "model.before_fn={_target_:examples.your_module.embed,_partial_:true}",
            "model.blocks=blocks", "model.after=[ln_f,head]",
            f"data.vocab_size={GPT_ARGS['vocab_size']}", f"data.seq_len={GPT_ARGS['block_size']}", "data.batch_size=4"]


def test_from_module_blocks_form_exports_the_modules_own_state_dict(one_rank_group, tmp_path: Path) -> None:
    from examples.your_module import GPT

    path, layers = _trained(tmp_path / "run", _gpt_overrides())
    out = tmp_path / "gpt.pt"
    count = ck.export(path, str(out))
    state = torch.load(out, weights_only=True)
    module = GPT(**GPT_ARGS).double()
    assert sorted(state) == sorted(module.state_dict()) and count == len(state)  # both tied names, as the module has
    assert torch.equal(state["head.weight"], state["tok_emb.weight"])
    module.load_state_dict(state, strict=True)
    assert module.head.weight is module.tok_emb.weight  # still tied after the load
    x = torch.randint(GPT_ARGS["vocab_size"], (3, GPT_ARGS["block_size"]))
    with torch.no_grad():
        expected = run_layers([layers[i] for i in sorted(layers)], x)
        assert torch.equal(module(x), expected)
    assert not torch.equal(state["blocks.0.c_fc.weight"], GPT(**GPT_ARGS).double().blocks[0].c_fc.weight)  # trained


def test_from_module_traced_form_exports_the_modules_own_state_dict(one_rank_group, tmp_path: Path) -> None:
    from toy_models import SkipNet

    path, layers = _trained(tmp_path / "run", [
        "model=module", "model.module._target_=toy_models.SkipNet", "model.split_points=[b1,b2,b3]",
        "data=gaussian", "data.batch_size=8"])
    out = tmp_path / "skip.pt"
    ck.export(path, str(out))
    state = torch.load(out, weights_only=True)
    module = SkipNet().double()
    module.load_state_dict(state, strict=True)
    x = torch.randn(5, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(module(x), run_layers([layers[i] for i in sorted(layers)], x))


def _layout_case(run_dir: str, layout: list[str]) -> str | None:
    """In a 2-rank world: train the examples' GPT 2 steps in `layout`, save; rank 0 returns the checkpoint."""
    cfg = compose_config([*_gpt_overrides(), *layout, "pipeline.num_microbatches=2", "pipeline.profile=false",
                          "train.dtype=float64", "train.eval_every=0", "train.log_every=100", "train.max_steps=2",
                          f"train.run_dir={run_dir}", "metrics.memory_steps=[]"])
    trainer = build_run(cfg, torch.device("cpu"))
    for step in range(2):
        trainer.train_step(step)
    path = trainer.save_checkpoint(2)
    return path if dist.get_rank() == 0 else None


def test_from_module_exports_the_same_state_dict_from_pp2_and_dp2_full_shard(tmp_path: Path) -> None:
    """The names do not depend on the layout: pp=2, and dp=2 with parameters sharded (DTensors),
    export the module's own state dict, equal to the one-process run's (float64 rounding)."""
    import functools

    from mp_harness import run_cases

    from examples.your_module import GPT

    layouts = {"pp2": ["parallel.dp=1"], "dp2_full": ["parallel.dp=2", "parallel.shard=full"]}
    results = run_cases(2, [(name, functools.partial(_layout_case, str(tmp_path / name), layout))
                            for name, layout in layouts.items()])
    one_rank = _exported_alone(tmp_path / "pp1")
    names = sorted(GPT(**GPT_ARGS).state_dict())
    for name in layouts:
        assert all(r.error is None for r in results[name]), [r.error for r in results[name]]
        out = tmp_path / f"{name}.pt"
        ck.export(results[name][0].value, str(out))
        state = torch.load(out, weights_only=True)
        assert sorted(state) == names, name
        for key in names:
            torch.testing.assert_close(state[key], one_rank[key], rtol=1e-9, atol=1e-12, msg=f"{name}: {key}")


def _exported_alone(run_dir: Path) -> dict[str, torch.Tensor]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        path, _ = _trained(run_dir, _gpt_overrides())
    finally:
        dist.destroy_process_group()
    ck.export(path, str(run_dir / "model.pt"))
    return torch.load(run_dir / "model.pt", weights_only=True)


# ------------------------------------------------------------------ a model with a Hugging Face form


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)


class Head(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def fake_hf_name(index: int, key: str, n_layer: int = 2) -> str:
    """The names a Llama-like ``*ForCausalLM`` gives: model.embed_tokens, model.layers.<k>, model.norm, lm_head."""
    if index == 0:
        return f"model.{key}"
    if index <= n_layer:
        return f"model.layers.{index - 1}.{key}"
    return key if key.startswith("lm_head") else f"model.{key}"


def build_fake_hf(vocab_size: int = 32, width: int = 8, n_layer: int = 2, seed: int = 0, **_: Any) -> ModelSpec:
    """A tiny decoder-like spec with a tied head, ``save_config`` and ``export_name`` set (the
    model group's other keys are ignored)."""
    layers = [LayerSpec("embed", Embed, (vocab_size, width))]
    layers += [LayerSpec(f"layer.{k}", nn.Linear, (width, width)) for k in range(n_layer)]
    layers.append(LayerSpec("head", Head, (vocab_size, width)))
    spec = ModelSpec("fake_hf", layers, loss_fn=cross_entropy, seed=seed,
                     tied={"embed": [("embed", "embed_tokens.weight"), ("head", "lm_head.weight")]})

    def save_config(folder: str) -> None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"model_type": "fake", "vocab_size": vocab_size, "tie_word_embeddings": True}, f)

    spec.export_name = lambda index, key: fake_hf_name(index, key, n_layer)
    spec.save_config = save_config
    return spec


@pytest.fixture()
def fake_hf_checkpoint(one_rank_group, tmp_path: Path) -> tuple[str, dict[int, nn.Module]]:
    return _trained(tmp_path / "run", ["model._target_=test_export_names.build_fake_hf", "model.n_layer=2",
                                       "data.vocab_size=32", "data.seq_len=8", "data.batch_size=4"])


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {k: v for f in files for k, v in load_file(folder / f).items()}


def test_format_hf_writes_config_and_safetensors_under_the_models_names_tie_once(fake_hf_checkpoint, tmp_path: Path,
                                                                                   capsys) -> None:
    path, layers = fake_hf_checkpoint
    out = tmp_path / "hf"
    assert ck.main(["export", "--format", "hf", path, str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "fake"
    got = _read_safetensors(out)
    expected = {"model.embed_tokens.weight": layers[0].embed_tokens.weight, "model.norm.weight": layers[3].norm.weight,
                "model.norm.bias": layers[3].norm.bias,
                **{f"model.layers.{k}.{n}": p for k in range(2) for n, p in layers[k + 1].named_parameters()}}
    assert sorted(got) == sorted(expected)  # lm_head.weight, tied to the embedding, is not written (as save_pretrained)
    assert all(torch.equal(got[k], v.detach()) for k, v in expected.items())
    assert f"wrote {len(expected)} tensors" in capsys.readouterr().out
    # the pt format of the same model: every name, the tie under both
    ck.export(path, str(tmp_path / "m.pt"))
    assert sorted(torch.load(tmp_path / "m.pt", weights_only=True)) == sorted([*expected, "lm_head.weight"])


def test_format_hf_shards_beyond_the_size_limit_with_hugging_faces_index(fake_hf_checkpoint, tmp_path: Path) -> None:
    path, _ = fake_hf_checkpoint
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    ck.export(path, str(whole), format="hf")
    assert ck.main(["export", "--format", "hf", "--max-shard-size", "1KB", path, str(sharded)]) == 0
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    a, b = _read_safetensors(whole), _read_safetensors(sharded)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in a.values())


def test_an_existing_target_is_a_named_error_and_force_replaces_an_earlier_export(fake_hf_checkpoint,
                                                                                  tmp_path: Path, capsys) -> None:
    path, _ = fake_hf_checkpoint
    out = tmp_path / "hf"
    ck.export(path, str(out), format="hf")
    with pytest.raises(CheckpointError, match=rf"export target {out} exists.*--force"):
        ck.export(path, str(out), format="hf")
    assert ck.main(["export", "--format", "hf", path, str(out)]) == 1
    assert f"error: CheckpointError: export target {out} exists" in capsys.readouterr().err
    (out / "model.safetensors").write_bytes(b"stale")
    assert ck.export(path, str(out), format="hf", force=True) > 0 and len(_read_safetensors(out)) > 0
    (out / "notes.txt").write_text("mine")  # --force never removes what an export did not write
    with pytest.raises(CheckpointError, match=r"holds \['notes.txt'\].*replaces an earlier export only"):
        ck.export(path, str(out), format="hf", force=True)
    pt = tmp_path / "m.pt"
    pt.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=rf"export target {pt} exists"):
        ck.export(path, str(pt))
    ck.export(path, str(pt), force=True)
    assert "lm_head.weight" in torch.load(pt, weights_only=True)


def test_format_hf_for_a_model_without_a_hugging_face_form_is_a_named_error(one_rank_group, tmp_path: Path) -> None:
    path, _ = _trained(tmp_path / "run", _gpt_overrides(), steps=1)
    with pytest.raises(ConfigError, match=r"model 'gpt' .* has no Hugging Face form .* --format pt"):
        ck.export(path, str(tmp_path / "hf"), format="hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.part").exists()
    # without the run's config.yaml: <layer index>.<key>, and a note says why
    alone = tmp_path / "alone" / "step_00000001"
    shutil.copytree(path, alone)
    with pytest.raises(CheckpointError, match=r"--format hf needs the model .*config.yaml does not exist"):
        ck.export(str(alone), str(tmp_path / "hf"), format="hf")
    ck.export(str(alone), str(tmp_path / "plain.pt"))
    state = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert "0.tok_emb.weight" in state and "3.head.weight" in state


def test_help_documents_both_formats(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        ck.main(["export", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--format {pt,hf,peft}" in out and "--merge-lora" in out and "from_pretrained" in out and "--force" in out and "state_dict names" in out


def test_a_trained_tiny_llama_exports_to_what_from_pretrained_loads_with_the_same_logits(one_rank_group,
                                                                                        tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = tmp_path / "tiny-llama"
    LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True).save_pretrained(source)
    path, layers = _trained(tmp_path / "run", ["model=hf", f"model.path={source}", "data.vocab_size=32",
                                               "data.seq_len=8", "data.batch_size=4"], dtype="float32")
    out = tmp_path / "exported"
    assert ck.main(["export", "--format", "hf", path, str(out)]) == 0
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert "lm_head.weight" not in _read_safetensors(out)  # tied: written once, as save_pretrained does
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(32, (3, 8))
    with torch.no_grad():
        expected = run_layers([layers[i] for i in sorted(layers)], x)
        got = model(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    ck.export(path, str(tmp_path / "llama.pt"))  # --format pt: the *ForCausalLM's own state dict, strict
    twin = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(source)).eval()
    twin.load_state_dict(torch.load(tmp_path / "llama.pt", weights_only=True), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(twin(x).logits, expected, rtol=1e-5, atol=1e-6)
    from pipeflow.models.hf import build_hf

    initial = build_hf(str(source)).build_layers([0])[0]
    assert not torch.equal(model.model.embed_tokens.weight, initial.model.embed_tokens.weight)  # trained, not init


def test_a_trained_tiny_moe_exports_its_experts_as_the_hub_stores_them(one_rank_group, tmp_path: Path) -> None:
    """Issue 58: a Qwen3-MoE folder (per-expert tensors on disk) trained on the pipeline exports its
    experts as the hub stores them (each expert's tensors apart, transformers' conversion mapping
    reversed), which from_pretrained loads with the same logits."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    source = tmp_path / "tiny-moe"
    Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   max_position_embeddings=16).save_pretrained(source)
    path, layers = _trained(tmp_path / "run", ["model=hf", f"model.path={source}", "data.vocab_size=32",
                                               "data.seq_len=8", "data.batch_size=4"], dtype="float32")
    out = tmp_path / "exported"
    assert ck.main(["export", "--format", "hf", path, str(out)]) == 0
    stored = _read_safetensors(out)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in stored  # as the hub stores experts, one by one
    assert not any(name.endswith("gate_up_proj") for name in stored)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(32, (3, 8))
    with torch.no_grad():
        expected = run_layers([layers[i] for i in sorted(layers)], x)
        torch.testing.assert_close(model(x).logits, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("fmt", "call", "code"), [
    ("pt", "replace", errno.EROFS), ("hf", "makedirs", errno.EROFS), ("hf", "rename", errno.EBUSY),
    ("pt", "replace", errno.EBUSY)], ids=["pt-read-only", "hf-read-only", "hf-busy", "pt-busy"])
def test_a_target_that_cannot_be_written_is_one_error_line_naming_it(fake_hf_checkpoint, tmp_path: Path, capsys,
                                                                      monkeypatch, fmt: str, call: str,
                                                                      code: int) -> None:
    """Issue 38 item 5: a read-only or busy target printed a 16-line OSError traceback.  Tests run as
    root, which chmod does not stop: the write itself is made to fail."""
    path, _ = fake_hf_checkpoint
    out = tmp_path / ("m.pt" if fmt == "pt" else "hf")
    real = getattr(os, call)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        if str(args[0]).endswith(".part"):
            raise OSError(code, os.strerror(code), str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, refuse)
    assert ck.main(["export", "--format", fmt, "--force", path, str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: CheckpointError: export target {out} not written: "
                                               f"{os.strerror(code)} [{errno.errorcode[code]}]"), err
    assert ("read-only: export to a writable path" if code == errno.EROFS else "cannot be replaced") in err[0]
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no .part left behind


def test_force_onto_a_mount_point_is_refused_before_anything_is_removed(fake_hf_checkpoint, tmp_path: Path,
                                                                         monkeypatch) -> None:
    path, _ = fake_hf_checkpoint
    out = tmp_path / "mnt"
    ck.export(path, str(out), format="hf")
    before = sorted(os.listdir(out))
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(out))
    with pytest.raises(CheckpointError, match=rf"export target {out} is a mount point, which --force cannot replace"):
        ck.export(path, str(out), format="hf", force=True)
    assert sorted(os.listdir(out)) == before
