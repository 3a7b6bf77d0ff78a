"""model.lora (issue 42): LoRA through peft on model=hf, its checkpoints and exports, one process.

The float64 equalities of a pipelined LoRA run against the unsplit peft model (every schedule kind,
dp, FSDP2, recomputation) run in test_hf's process worlds (tests/lora_cases.py). Here, in a
one-rank gloo group: a tiny random Llama fine-tuned 2 steps with LoRA, its checkpoint (adapters
and their AdamW state, the base named by path and digest), ``export --format peft`` (what
``peft.PeftModel.from_pretrained`` loads onto the base: the pipelined logits), ``--format hf
--merge-lora`` (peft's merged weights, loaded by ``from_pretrained``), resuming, and the named errors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pipeflow.errors import CheckpointError, ConfigError, LoraError  # noqa: E402
from pipeflow.models.hf import build_hf  # noqa: E402
from pipeflow.models.lora import describe, lora_settings  # noqa: E402
from pipeflow.runtime.parallel.tensor_parallel_lora import is_lora_linear, lora_split  # noqa: E402
from pipeflow.models.spec import run_layers  # noqa: E402
from pipeflow.checkpoint import saving as ck  # noqa: E402
from pipeflow.run.builder import build_run  # noqa: E402
from pipeflow.checkpoint.exporting import export  # noqa: E402
from pipeflow.commands.plan.command import compose_config  # noqa: E402
from pipeflow.runtime.stage import layers_by_index  # noqa: E402

TINY = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16)
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,*up_proj]"]  # a glob: a pattern


def _base(folder: Path) -> Path:
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(folder)
    return folder


def _config(source: Path, run_dir: Path, *extra: str, lora: bool = True):
    return compose_config(["model=hf", f"model.path={source}", *(LORA if lora else []), "data.vocab_size=32", "data.seq_len=8",
                           "data.batch_size=4", "pipeline.num_microbatches=2", "pipeline.profile=false",
                           "train.dtype=float64", "train.eval_every=0", "train.log_every=100", "train.max_steps=2",
                           "optim.lr=0.05", f"train.run_dir={run_dir}", "metrics.memory_steps=[]", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA run of 2 steps on a tiny random Llama, once for the module, in a one-rank gloo group of
    its own (gone on return): (base folder, checkpoint, trained layers, trainer)."""
    import datetime

    import torch.distributed as dist
    from mp_harness import _free_port

    tmp_path = tmp_path_factory.mktemp("lora")
    source = _base(tmp_path / "base")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        trainer = build_run(_config(source, tmp_path / "run"), torch.device("cpu"))
        for step in range(2):
            trainer.train_step(step)
        path = trainer.save_checkpoint(2)
    finally:
        dist.destroy_process_group()
    return source, path, layers_by_index(trainer.parts.stages, trainer.ranges), trainer


def _logits(layers: dict, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return run_layers([layers[i] for i in sorted(layers)], x)


def test_the_checkpoint_holds_adapters_and_their_state_and_names_the_base(trained) -> None:
    source, path, layers, trainer = trained
    entries = ck.SafeReader(path).read_metadata().state_dict_metadata
    model = [k for k in entries if k.startswith("model.")]
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model)  # no frozen weight copied
    assert {k.split(".")[-1] for k in entries if k.startswith("optim.")} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(".lora_" in k for k in entries if k.startswith("optim."))
    base = json.load(open(os.path.join(path, "meta.json")))["lora_base"]
    assert base["path"] == str(source) and len(base["digest"]) == 64
    frozen = [p for stage in trainer.parts.stages.values() for p in stage.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    held = {id(p) for group in trainer.loop.update.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in held for p in frozen) and all(p.requires_grad for p in trainer.parts.params)
    assert "model.lora: rank 4, alpha 8" in trainer.describe() and "trainable" in trainer.describe()


def test_export_peft_loads_in_peft_with_the_pipelined_logits_and_merge_lora_equals_peft_merged(
        trained, tmp_path: Path) -> None:
    source, path, layers, _ = trained
    x = torch.randint(32, (3, 8))
    expected = _logits(layers, x)
    adapter = tmp_path / "adapter"
    assert ck.main(["export", "--format", "peft", path, str(adapter)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    config = json.load(open(adapter / "adapter_config.json"))
    assert isinstance(config["target_modules"], str) and config["base_model_name_or_path"] == str(source)
    base = transformers.AutoModelForCausalLM.from_pretrained(source).to(torch.float64).eval()
    with torch.no_grad():
        assert (base(x).logits - expected).abs().max() > 1e-3  # the adapters changed the model
    tuned = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(tuned(x).logits, expected, rtol=1e-10, atol=1e-12)
    merged_by_peft = tuned.merge_and_unload().state_dict()
    out = tmp_path / "merged"
    assert ck.main(["export", "--format", "hf", "--merge-lora", path, str(out)]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(value, merged_by_peft[name], rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ConfigError, match="LoRA adapters only.*--format peft.*--merge-lora"):
        ck.export(path, str(tmp_path / "plain"), format="hf")


def test_resume_loads_the_adapters_and_refuses_another_base(trained, one_rank_group, tmp_path: Path) -> None:
    source, path, layers, _ = trained
    again = build_run(_config(source, tmp_path / "run2", f"train.resume={path}"), torch.device("cpu"))
    assert again.resume() == 2
    for i, layer in layers_by_index(again.parts.stages, again.ranges).items():
        for name, p in layer.named_parameters():
            torch.testing.assert_close(p, layers[i].get_parameter(name), rtol=0, atol=0)
    assert len(again.loop.update.optimizer.state) > 0  # the adapters' AdamW state came back
    other = _base(tmp_path / "other")  # same config, other weights
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(other)
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
        model.save_pretrained(other)
    moved = build_run(_config(other, tmp_path / "run3", f"train.resume={path}"), torch.device("cpu"))
    with pytest.raises(CheckpointError, match="LoRA adapters trained on the base .* other weights"):
        moved.resume()
    # issue 57: into a run without model.lora it said "has no ...weight ... saved from another model"
    full = build_run(_config(source, tmp_path / "run4", f"train.resume={path}", lora=False), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"holds LoRA adapters only \(the base they were trained on is named in its "
                                          r"meta.json, not saved\), and this run has no model.lora: resume it with"):
        full.resume()
    # ... and exporting adapters from a run that has none said it "holds LoRA adapters"; peft + merge was rc 0
    plain = build_run(_config(source, tmp_path / "run5", "train.save_every=2", lora=False), torch.device("cpu"))
    plain.fit()
    saved = f"{plain.checkpoint_root}/step_00000002"
    for words in ({"format": "peft"}, {"format": "pt", "merge_lora": True}):
        with pytest.raises(ConfigError, match=r"was not saved by a LoRA run \(its meta.json names no base model\): "
                                              r"--(format peft|merge-lora) needs adapters"):
            export(saved, str(tmp_path / "out"), **words)
    with pytest.raises(ConfigError, match=r"^--merge-lora merges the adapters into the base: use it with --format hf"):
        export(path, str(tmp_path / "out"), format="peft", merge_lora=True)


def test_named_errors(tmp_path: Path) -> None:
    source = _base(tmp_path / "base")
    with pytest.raises(LoraError, match="out of scope"):
        build_hf(str(source), lora={"rank": 4, "targets": ["embed_tokens"]})
    with pytest.raises(LoraError, match="lm_head .the output head.*out of scope"):
        build_hf(str(source), lora={"rank": 4, "targets": ["*_proj", "lm_head"]})
    with pytest.raises(LoraError, match="match no Linear.*q_proj"):
        build_hf(str(source), lora={"rank": 4, "targets": ["qproj"]})
    with pytest.raises(LoraError, match="QLoRA .* out of scope"):
        lora_settings({"rank": 4, "load_in_4bit": True})
    with pytest.raises(LoraError, match="no key.*'ranks'"):
        lora_settings({"ranks": 4})
    assert lora_settings({"rank": 0, "targets": ["q_proj"]}) is None and lora_settings(None) is None
    spec = build_hf(str(source), lora={"rank": 2, "targets": ["model.layers.1.*.q_proj"]})
    layers = spec.build_all()  # a dotted glob: the whole path; only layer 1's q_proj adapted
    adapted = [n for layer in layers for n, p in layer.named_parameters() if p.requires_grad]
    assert adapted and all(n.startswith("model.layers.1.self_attn.q_proj.lora_") for n in adapted)
    assert describe(4_200_000, 1_100_000_000) == "trainable 4.2 M of 1.1 B"
    wrapped = next(m for layer in layers for n, m in layer.named_modules() if n.endswith("q_proj") and is_lora_linear(m))
    assert is_lora_linear(wrapped) and not is_lora_linear(wrapped.base_layer)
    with pytest.raises(LoraError, match="layer 'h', module 'lm_head'.* as 'colwise_out'"):  # tp: no split for the head's
        lora_split("colwise_out", None, "layer 'h', module 'lm_head'")


def test_the_memory_prediction_counts_gradients_and_adamw_state_of_what_trains_only() -> None:
    from pipeflow.schedules import build_schedule
    from pipeflow.schedules.memory import StageBytes, tensor_memory

    schedule = build_schedule("1f1b", 1, 2)
    full = tensor_memory(schedule, [StageBytes(1000.0, 10.0)])[0].resident
    lora = tensor_memory(schedule, [StageBytes(1000.0, 10.0, trainable=10.0)])[0].resident
    assert (full.params, full.grads, full.optimizer) == (1000.0, 1000.0, 2000.0)
    assert (lora.params, lora.grads, lora.optimizer) == (1000.0, 10.0, 20.0)
    sharded = tensor_memory(schedule, [StageBytes(1000.0, 10.0, trainable=10.0)], dp=2, shard="full")[0].resident
    assert (sharded.params, sharded.grads, sharded.optimizer) == (500.0, 5.0, 10.0)


def test_a_profiled_lora_run_predicts_the_adapters_state(one_rank_group, tmp_path: Path) -> None:
    source = _base(tmp_path / "base")
    trainer = build_run(_config(source, tmp_path / "run", "pipeline.profile=true"), torch.device("cpu"))
    profiles = trainer.plan.layout.profiles
    assert all(p.trainable_bytes is not None and p.trainable_bytes < p.param_bytes for p in profiles)
    assert profiles[0].trainable_bytes == 0  # the embedding: frozen
    resident = trainer.plan.layout.prediction.memory[0].resident
    assert 0 < resident.grads < resident.params / 5 and resident.optimizer == 2 * resident.grads


def test_the_built_in_gpt_takes_lora_by_module_names_and_merges_back(one_rank_group, tmp_path: Path) -> None:
    """model=gpt: adapters in c_attn/c_proj; the merged export (pt: ``<layer index>.<key>``) loads into
    the plain GPT's layers and gives the LoRA model's logits; --format peft needs Hugging Face names."""
    from pipeflow.models.gpt import build_gpt

    cfg = compose_config(["model.lora.rank=2", "model.n_layer=2", "model.n_embd=16", "model.n_head=2",
                          "data.vocab_size=32", "data.seq_len=8", "data.batch_size=4", "pipeline.num_microbatches=2",
                          "pipeline.profile=false", "train.dtype=float64", "train.eval_every=0", "train.log_every=100",
                          "train.max_steps=2", "optim.lr=0.05", f"train.run_dir={tmp_path / 'run'}",
                          "metrics.memory_steps=[]"])
    trainer = build_run(cfg, torch.device("cpu"))
    for step in range(2):
        trainer.train_step(step)
    path = trainer.save_checkpoint(2)
    layers = layers_by_index(trainer.parts.stages, trainer.ranges)
    assert ck.export(path, str(tmp_path / "merged.pt"), merge_lora=True) > 0
    plain = build_gpt(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16).build_all(dtype=torch.float64)
    merged = torch.load(tmp_path / "merged.pt", weights_only=True)
    for i, layer in enumerate(plain):
        layer.load_state_dict({k.partition(".")[2]: v for k, v in merged.items() if k.split(".")[0] == str(i)})
    x = torch.randint(32, (3, 8))
    with torch.no_grad():
        torch.testing.assert_close(run_layers(plain, x), _logits(layers, x), rtol=1e-10, atol=1e-12)
    with pytest.raises(ConfigError, match="--format peft .* has none"):
        ck.export(path, str(tmp_path / "adapter"), format="peft")


def test_fused_experts_adapted_export_to_peft_and_merge_back_with_the_pipelined_logits(tmp_path: Path) -> None:
    """Issue 58: a Qwen3-MoE whose fused experts are adapted (peft's target_parameters) trains, exports
    an adapter folder peft loads onto the base (the pipelined logits), and merges back."""
    import datetime

    import torch.distributed as dist
    from mp_harness import _free_port

    config = transformers.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "base")
    targets = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,gate_up_proj,down_proj]"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        trainer = build_run(_config(tmp_path / "base", tmp_path / "run", *targets, lora=False), torch.device("cpu"))
        for step in range(2):
            trainer.train_step(step)
        path = trainer.save_checkpoint(2)
    finally:
        dist.destroy_process_group()
    layers = layers_by_index(trainer.parts.stages, trainer.ranges)
    x = torch.randint(32, (3, 8))
    expected = _logits(layers, x)
    assert ck.main(["export", "--format", "peft", path, str(tmp_path / "adapter")]) == 0
    config = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert config["target_parameters"] == [f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                           for w in ("gate_up_proj", "down_proj")]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", experts_implementation="eager")
    base = base.to(torch.float64).eval()
    with torch.no_grad():
        assert (base(x).logits - expected).abs().max() > 1e-3  # the adapters changed the model
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(tuned(x).logits, expected, rtol=1e-10, atol=1e-12)
    assert ck.main(["export", "--format", "hf", "--merge-lora", path, str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64,
                                                              experts_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, expected, rtol=1e-10, atol=1e-12)
