"""model=hf: Hugging Face decoders (Llama, Mistral, Qwen2) as pipeline layers, exact against
Hugging Face's own forward; tiny random configs written here (no download).

The multi-process cases run in one module-scoped 2-process and one 4-process gloo world
(tests/mp_harness.py): the pipeline alone (pipeline_cases), and the real Trainer (``build_run``
with model=hf, as tests/scale_cases.py builds it) on dp x pp meshes, shard modes, zbv,
activation checkpointing, variable lengths, float32 and bf16, against Hugging Face's model on
the global batch.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import chat_cases  # noqa: E402
import generate_cases  # noqa: E402
import lora_cases  # noqa: E402
from mp_harness import CaseResult, run_cases, selected_cases  # noqa: E402
from pipeflow.errors import ConfigError  # noqa: E402
from pipeflow.models.hf import build_hf  # noqa: E402
from pipeflow.models.hf_experts import expert_shard  # noqa: E402
from pipeflow.models.spec import run_layers  # noqa: E402
from pipeflow.runtime.tied import tie_in_place  # noqa: E402

TOLERANCE = 1e-12  # float64: per-tensor |a - b| / |b|
FLOAT32_KEPT = ("mlp.gate.weight",)  # parameters a family computes with in float32 (DeepSeek-V3's router)
FLOAT32_TOLERANCE = 1e-5
# families whose RMSNorm computes in float32 whatever the input: its weight's gradient, a sum over
# tokens in float32, depends on how the batch is split into micro-batches at float32 precision
FLOAT32_NORMS = ("helium", "gemma", "gemma2", "gemma3_text")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# DeepSeek-style routers: group-limited top-k over 8 experts, the first layer dense
_GROUPED = {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1, "n_group": 2,
            "topk_group": 1}
KINDS = {  # name -> (config class, model class, config keys beyond SMALL)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),  # window < T = 12
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # issue 58's first families beyond those three: sliding windows where the family has them
    "qwen3_window": ("Qwen3Config", "Qwen3ForCausalLM", {"sliding_window": 5, "use_sliding_window": True,
                                                         "max_window_layers": 1}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 8}),
    "exaone4_window": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 5}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "ministral_window": ("MinistralConfig", "MinistralForCausalLM", {"sliding_window": 5, "head_dim": 8}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    # Gemma: the embedding scaled by a non-persistent buffer, Gemma 2's soft-capped attention and logits
    # with sliding layers, Gemma 3's local and global rotary embeddings per layer type
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 5,
                                                    "final_logit_softcapping": 3.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 5,
                                                              "sliding_window_pattern": 2,
                                                              "final_logit_softcapping": 3.0}),
    # mixtures of experts (issue 58): saved with per-expert tensors, loaded into fused experts through
    # transformers' conversion mapping; routers top-k softmax, shared experts, DeepSeek-V3's group-limited
    # routing with its correction bias and a dense first layer, gpt-oss's biased experts and sinks
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": 5}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 16,
                                                            "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 8, "q_lora_rank": 16,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "num_key_value_heads": 4}),  # MLA: kv = q heads
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                                                      "sliding_window": 5,
                                                      "layer_types": ["sliding_attention", "full_attention"] * 2}),
    # more families with the standard layout (pad_token_id 0: their defaults lie outside a 64-token vocabulary)
    # Phi-3 and Mixtral slide every layer's window once sliding_window is set (Mistral's forward), not by layer_types
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "sliding_window": 5}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": 0}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"pad_token_id": 0, "head_dim": 8}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"pad_token_id": 0, "head_dim": 8}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"pad_token_id": 0, "head_dim": 8}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"pad_token_id": 0, "head_dim": 8}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        **_GROUPED, "n_routed_experts": 8, "n_shared_experts": 1, "head_dim": 8, "pad_token_id": 0}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_GROUPED, "n_routed_experts": 8, "n_shared_experts": 1, "kv_lora_rank": 8, "q_lora_rank": 16,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "num_key_value_heads": 4, "pad_token_id": 0}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {
        "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16, "head_dim": 8, "pad_token_id": 0}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"num_experts": 4, "moe_topk": 2,
                                                                         "head_dim": 8, "pad_token_id": 0}),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", {**_GROUPED, "n_routed_experts": 8, "n_shared_experts": 1,
                                                 "head_dim": 8, "pad_token_id": 0}),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "pad_token_id": 0}),
}

# families taken by the form of their forwards (pipeflow.models.hf_forms), not by name; each made from
# its own config class with SMALL's sizes on 2 layers and the keys below where the class has them
BY_FORM = ("aria_text", "axk1", "bitnet", "diffllama", "exaone_moe", "flint", "glm4_moe_lite", "jais2", "kolibri1",
           "minicpm5_moe", "ministral3", "phimoe", "seed_oss", "solar_open", "vaultgemma", "youtu")
_BY_FORM_KEYS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "head_dim": 8,
                 "shared_expert_intermediate_size": 32, "kv_lora_rank": 8, "q_lora_rank": 16, "qk_rope_head_dim": 4,
                 "qk_nope_head_dim": 4, "v_head_dim": 8, "sliding_window": 5}
_MLA = {"num_key_value_heads": 4, "head_dim": 4}  # multi-head latent attention: kv = q heads, rotary on qk_rope_head_dim


def reference(kind: str, folder: str) -> torch.nn.Module:
    """Hugging Face's own model of `kind` from `folder`; experts looped one by one (transformers'
    "eager"), since torch's grouped_mm takes no float64."""
    return getattr(transformers, KINDS[kind][1]).from_pretrained(folder, experts_implementation="eager")


def write_model(folder: str, kind: str, weights: bool = True) -> torch.nn.Module:
    """A tiny random model of `kind` saved into `folder` (config.json [+ model.safetensors])."""
    config_cls, model_cls, extra = KINDS[kind]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra}, experts_implementation="eager")
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(config)
    if weights:
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return model


def _grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, zeros where it has none (an expert that no token was routed to)."""
    return param.grad if param.grad is not None else torch.zeros_like(param)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius), |a - b| when b is zero."""
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale > 0 else (a - b).norm().item()


# --------------------------------------------------------------------------- multi-process cases
def _pipelined_vs_hf(folder: str, kind: str, schedule: str, m: int, steps: int = 2, packed: bool = False) -> dict:
    """Train `steps` SGD steps pipelined and with Hugging Face's model on the whole batch; with
    `packed`, each row holds documents (ids passed beside the tokens; Hugging Face is given the
    positions restarting per document, which its mask utilities read as packed sequences)."""
    from pipeflow.models.gpt import document_positions
    from pipeflow.runtime.stage import as_tuple

    import torch.distributed as dist

    import pipeline_cases as cases
    from pipeflow.schedules import build_schedule

    spec = build_hf(folder)
    plan = build_schedule(schedule, dist.get_world_size(), m)
    pipe, ranges, tied = cases.build_pipeline(spec, plan)
    ref = reference(kind, folder).to(torch.float64)
    named = [(name, mine, ref.get_parameter(name)) for stage in pipe.stages.values()
             for layer in stage.module for name, mine in layer.named_parameters()]
    pairs = [(mine, theirs) for _, mine, theirs in named]
    params = list({id(p): p for p, _ in pairs}.values())
    opt, opt_ref = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = {"loss": 0.0, "grad": 0.0, "compared": len(pairs)}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randint(64, (8, 12), generator=gen), torch.randint(64, (8, 12), generator=gen)
        inputs, targets = cases.split_batch(pipe, x, y, m)
        if packed:  # documents of 1..6 tokens
            doc = (torch.rand(8, 12, generator=gen) < 0.25).cumsum(1)
            # without a cache: Hugging Face reads packed position ids only then (training)
            loss_ref = spec.loss_fn(ref(x, position_ids=document_positions(doc), use_cache=False).logits, y)
            inputs = [as_tuple(mb) for mb in zip(x.chunk(m), doc.chunk(m))] if inputs is not None else None
        else:
            loss_ref = spec.loss_fn(ref(x).logits, y)
        loss_ref.backward()
        loss = pipe.run(inputs, targets)
        tied.reduce_grads()
        if loss is not None:
            worst["loss"] = max(worst["loss"], rel(loss.detach(), loss_ref.detach()))
        for name, mine, theirs in named:
            kept = name.endswith(FLOAT32_KEPT) or (kind in FLOAT32_NORMS and "norm" in name.rsplit(".", 2)[-2])
            key = "grad_float32" if kept else "grad"  # what the family computes in float32
            worst[key] = max(worst.get(key, 0.0), rel(_grad(mine), _grad(theirs)))  # an expert no token chose: none
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    return worst


def _every_moe_ep2(folders: dict) -> dict:
    """Every mixture-of-experts kind not among TRAINER_CASES_4 through the Trainer on dp 2 x pp 2
    with its experts split over ep 2 (1F1B, one AdamW step): {kind: worst differences}."""
    return {kind: _trainer_vs_hf(folders[kind], kind, os.path.join(folders["runs"], f"ep2-{kind}"), 2, "1f1b",
                                 steps=1, parallel__ep=2) for kind in EVERY_MOE}


def _every_family(folders: dict) -> dict:
    """Every kind not among MP_CASES pipelined over the 2 ranks (1F1B, 2 micro-batches, one SGD
    step) against transformers on the whole batch: {kind: worst differences}."""
    return {kind: _pipelined_vs_hf(folders[kind], kind, "1f1b", 2, steps=1) for kind in EVERY_FAMILY}


# --------------------------------------------------------------------------- through the Trainer
def _trainer_config(folder: str, run_dir: str, dp: int, schedule: str, m: int, **overrides):
    """scale_cases.make_config with model=hf (the saved tiny model in `folder`) instead of the GPT."""
    from omegaconf import OmegaConf
    from pipeflow.config.schema import HFModelConfig

    import scale_cases

    cfg = scale_cases.make_config(dp, schedule, m, train__run_dir=run_dir, **overrides)
    cfg.model = OmegaConf.structured(HFModelConfig(path=folder))
    return cfg


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # a collective over the tensor's mesh (dp replicas with FSDP2, a stage's tp ranks with tp): every rank calls it
    return t.full_tensor() if isinstance(t, DTensor) else t


class _Slice:
    """The rows of a reference parameter that a rank holds of a tensor split along its experts
    (``parallel.ep``): ``.grad`` and ``.detach()`` as the parameter's own, sliced."""

    def __init__(self, param: torch.nn.Parameter, rows: slice) -> None:
        self.param, self.rows = param, rows

    @property
    def grad(self) -> torch.Tensor:
        return _grad(self.param)[self.rows]

    def detach(self) -> torch.Tensor:
        return self.param.detach()[self.rows]


def _ref_slice(mine: torch.Tensor, theirs: torch.nn.Parameter):
    """`theirs`, or the slice of it `mine` holds where ``parallel.ep`` split it along the experts."""
    import torch.distributed as dist

    shard = expert_shard(mine)
    if shard is None:
        return theirs
    per = mine.shape[0]
    start = dist.get_rank(shard[0]) * per
    return _Slice(theirs, slice(start, start + per))


def _trainer_vs_hf(folder: str, kind: str, run_dir: str, dp: int, schedule: str, m: int = 2, steps: int = 2,
                   resume_ep1: bool = False, **overrides) -> dict:
    """The real Trainer (``build_run``, model=hf) on a dp x pp mesh against Hugging Face's model on
    the global batch, both with the same AdamW and lr schedule: worst per-tensor relative
    differences (Frobenius) of the loss, every gradient (dp-reduced) and every parameter after
    each step. A batch of micro-batches of different lengths (data.variable_lengths) counts every
    token alike, as scale_cases.Reference does."""
    from pipeflow.data import build_batches
    from pipeflow.models.module_spec import cross_entropy
    from pipeflow.run.builder import build_run
    from pipeflow.run.trainer import lr_at

    import torch.distributed as dist

    cfg = _trainer_config(folder, f"{run_dir}-{dist.get_world_size()}", dp, schedule, m, **overrides)
    trainer = build_run(cfg, torch.device("cpu"))
    ref = reference(kind, folder).to(getattr(torch, cfg.train.param_dtype))
    o = cfg.optim
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    batches = build_batches(cfg.data, cfg.model, chunks=dp * m)
    named = [(name, mine, _ref_slice(mine, ref.get_parameter(name))) for stage in trainer.parts.stages.values()
             for layer in stage.module for name, mine in layer.named_parameters()]
    both = [(mine, theirs) for name, mine, theirs in named if not name.endswith(FLOAT32_KEPT)]
    float32 = [(mine, theirs) for name, mine, theirs in named if name.endswith(FLOAT32_KEPT)]
    from torch.distributed.tensor import DTensor

    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "compared": len(named), "lengths": set(),
             "sharded": sum(isinstance(mine, DTensor) for _, mine, _ in named),
             "ep_split": sum(expert_shard(mine) is not None for mine, _ in both)}
    for step in range(steps):
        for group in trainer.loop.update.optimizer.param_groups + opt_ref.param_groups:
            group["lr"] = lr_at(step, o, cfg.train.max_steps)
        loss, _ = trainer.forward_backward(step)
        x, y = batches.train.get(step)
        if isinstance(x, list):
            total = sum(t.numel() for t in y)
            loss_ref = sum(t.numel() / total * cross_entropy(ref(a).logits, t) for a, t in zip(x, y))
            worst["lengths"].update(a.shape[1] for a in x)
        else:
            loss_ref = cross_entropy(ref(x).logits, y)
        loss_ref.backward()
        worst["loss"] = max(worst["loss"], abs(loss - loss_ref.item()) / abs(loss_ref.item()))
        worst["grad"] = max([worst["grad"]] + [rel(_full(_grad(a)), _grad(b)) for a, b in both])  # b: maybe a view's
        worst["grad_float32"] = max([worst.get("grad_float32", 0.0)]
                                    + [rel(_full(_grad(a)), _grad(b)) for a, b in float32])  # routers in float32
        trainer.loop.update.optimizer.step()
        trainer.loop.update.optimizer.zero_grad(set_to_none=True)
        opt_ref.step()
        opt_ref.zero_grad()
        worst["param"] = max([worst["param"]] + [rel(_full(a.detach()), b.detach()) for a, b in both])
        worst["param_float32"] = max([worst.get("param_float32", 0.0)]
                                     + [rel(_full(a.detach()), b.detach()) for a, b in float32])
    worst["compile"] = None if trainer.parts.compiled is None else trainer.parts.compiled.summary()  # train.compile
    if resume_ep1:  # the checkpoint resumed at ep 1, dp = world, pp 1: every rank every expert, and AdamW's moments
        path = trainer.save_checkpoint(steps)
        cfg.parallel.dp, cfg.parallel.ep, cfg.train.resume = dist.get_world_size(), 1, path
        cfg.train.run_dir = f"{cfg.train.run_dir}-resumed"
        again = build_run(cfg, torch.device("cpu"))
        worst["resumed_step"] = again.resume()
        for group in again.loop.update.optimizer.param_groups + opt_ref.param_groups:
            group["lr"] = lr_at(steps, o, cfg.train.max_steps)
        again.forward_backward(steps)
        x, y = batches.train.get(steps)
        cross_entropy(ref(x).logits, y).backward()
        again.loop.update.optimizer.step()
        opt_ref.step()
        back = [(p, ref.get_parameter(n)) for stage in again.parts.stages.values() for layer in stage.module
                for n, p in layer.named_parameters()]
        worst["resumed"] = max(rel(a.detach(), b.detach()) for a, b in back)
        worst["resumed_compared"] = len(back)
    return worst


def _bf16_vs_fp32(folder: str, run_dir: str, dp: int, schedule: str, m: int = 2) -> dict:
    """One step's gradients under train.precision=bf16 (float32 weights) against fp32's, as
    scale_cases.precision_vs_fp32 does for the GPT; and the dtypes that crossed stage boundaries."""
    from pipeflow.run.builder import build_run

    import torch.distributed as dist

    out, grads = {}, {}
    for prec in ("fp32", "bf16"):
        cfg = _trainer_config(folder, f"{run_dir}-{prec}-{dist.get_world_size()}", dp, schedule, m,
                              train__param_dtype="float32", train__precision=prec)
        trainer = build_run(cfg, torch.device("cpu"))
        trainer.forward_backward(0)
        grads[prec] = [_full(p.grad).clone() for p in trainer.parts.params]
        out[f"edges_{prec}"] = sorted({str(meta.dtype) for plan in trainer.loop.pipeline.shapes.edges.values()
                                       for metas in plan for meta in metas})
    out["grad"] = max(rel(a, b) for a, b in zip(grads["bf16"], grads["fp32"]))
    return out


MP_CASES = (("llama", "1f1b"), ("llama", "zb_h1"), ("llama_tied", "1f1b"), ("llama_tied", "zb_h1"),
            ("mistral_window", "1f1b"), ("qwen2_tied", "zb_h1"), ("llama_packed", "1f1b"), ("qwen3_window", "1f1b"),
            ("qwen3_moe", "1f1b"), ("deepseek_v3", "zb_h1"))
EVERY_FAMILY = [kind for kind in KINDS if kind not in {k for k, _ in MP_CASES}]  # the case "every-family"
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}


def is_moe(kind: str) -> bool:
    """Whether `kind`'s tiny config routes tokens to experts."""
    return bool(KINDS[kind][2].keys() & EXPERT_KEYS)


EVERY_MOE = [k for k in KINDS if is_moe(k) and k not in ("qwen3_moe", "mixtral")]  # the case "every-moe-ep2"
MP_CASES_4 = (("llama_tied", "zb_h1"),)  # the tie spans ranks 0 and 3; split backward


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved tiny model of each kind (config.json + model.safetensors)."""
    made = {}
    for kind in KINDS:
        made[kind] = str(tmp_path_factory.mktemp(kind))
        write_model(made[kind], kind)
    made["runs"] = str(tmp_path_factory.mktemp("runs"))  # the Trainer cases' run directories
    return made


# the real Trainer (model=hf) against Hugging Face's model: name -> (kind, dp, schedule, m, overrides, tolerance)
TRAINER_CASES = {
    "ckpt-varlen-tied-1f1b": ("llama_tied", 1, "1f1b", 2, {"pipeline__checkpoint_activations": True,
                                                           "data__variable_lengths": True}, TOLERANCE),
    "float32-1f1b": ("llama", 1, "1f1b", 2, {"train__param_dtype": "float32"}, 1e-5),
    # train.compile: every decoder layer compiled whole (aot_eager), the backward split for ZB-H1
    "compiled-zb_h1": ("llama_tied", 1, "zb_h1", 2, {"train__compile": True, "train__compile_backend": "aot_eager"},
                       TOLERANCE),
}
TRAINER_CASES_4 = {  # dp2 x pp2
    # issue 58: a Hugging Face MoE family's fused experts split over ep 2 (tokens by all_to_all), and
    # DualPipeV's overlapped pairs handing over at those exchanges, its attention compiled
    "ep2-qwen3_moe-1f1b": ("qwen3_moe", 2, "1f1b", 2, {"parallel__ep": 2, "resume_ep1": True}, TOLERANCE),
    "ep2-mixtral-dualpipev-compiled": ("mixtral", 2, "dualpipev", 4, {
        "parallel__ep": 2, "train__compile": True, "train__compile_backend": "aot_eager"}, TOLERANCE),
    "full-shard-tied-1f1b": ("llama_tied", 2, "1f1b", 2, {"parallel__shard": "full"}, TOLERANCE),
    "full-shard-qwen3_moe-zbv": ("qwen3_moe", 2, "zbv", 2, {"parallel__shard": "full"}, TOLERANCE),  # experts whole
    # issue 59: context parallelism through transformers' AttentionInterface (ring attention), windows too
    "cp2-pp2-llama-1f1b": ("llama", 1, "1f1b", 2, {"parallel__cp": 2}, TOLERANCE),
    "cp2-dp2-qwen3_window-1f1b": ("qwen3_window", 2, "1f1b", 2, {"parallel__cp": 2, "parallel__pp": 1}, TOLERANCE),
    "zbv-tied-zero1": ("llama_tied", 2, "zbv", 2, {"parallel__shard": "optimizer"}, TOLERANCE),  # tie on rank 0
    "zbv-tied-full-shard": ("llama_tied", 2, "zbv", 2, {"parallel__shard": "full"}, TOLERANCE),
}
TP_CASES_4 = {  # dp1 x pp2 x tp2: each stage's layers split by the config's base_model_tp_plan
    "pp2-tp2-mixtral-1f1b": ("mixtral", 1, "1f1b", 2, {"parallel__tp": 2}, TOLERANCE),
    "pp2-tp2-tied-1f1b": ("llama_tied", 1, "1f1b", 2, {"parallel__tp": 2}, TOLERANCE),
    "pp2-tp2-tied-zbv": ("llama_tied", 1, "zbv", 2, {"parallel__tp": 2}, TOLERANCE),  # tied pair on one stage
    "pp2-tp2-tied-1f1b-sp": ("llama_tied", 1, "1f1b", 2, {"parallel__tp": 2, "parallel__sequence_parallel": True},
                             TOLERANCE),  # RMSNorms on sequence slices, gathered before the projections
}
# model.lora (peft) through the real Trainer against the unsplit peft model (tests/lora_cases.py):
# name -> (kind, dp, schedule, m, overrides); a compiled split backward; activation checkpointing with
# a tied (frozen) pair; dp2 x pp2 FSDP2 with zbv, where rank 0's stages (embedding, head) train nothing
LORA_CASES = {"lora-zb_h1-compiled": ("llama", 1, "zb_h1", 2, {"resume_dp": True, "train__compile": True,  # then
                                                                 "train__compile_backend": "aot_eager"}),  # dp2 x pp1
              "lora-tied-1f1b-ckpt": ("llama_tied", 1, "1f1b", 2, {"pipeline__checkpoint_activations": True}),
              # issue 58: Qwen2-MoE's fused experts adapted (peft's target_parameters) beside its Linear modules
              "lora-qwen2_moe-experts-1f1b": ("qwen2_moe", 1, "1f1b", 2, {
                  "resume_dp": True, "lora_targets": ("q_proj", "gate_up_proj", "down_proj")})}
LORA_CASES_4 = {  # issue 58: DeepSeek-V3's latent attention adapted, its experts split over ep 2, DualPipeV's pairs
                "lora-deepseek_v3-ep2-dualpipev": ("deepseek_v3", 2, "dualpipev", 4, {
                    "parallel__ep": 2, "lora_targets": ("q_b_proj", "kv_b_proj", "o_proj")}),
                "lora-dp2-zbv-tied-full-shard": ("llama_tied", 2, "zbv", 2, {"parallel__shard": "full",
                                                                             "resume_dp": True}),  # then dp4 x pp1
                # pp2 x tp2, sequence parallel, split backward: q/v adapters split by rows, down_proj's by columns
                "lora-pp2-tp2-sp-zb_h1": ("llama", 1, "zb_h1", 2, {"parallel__tp": 2, "parallel__sequence_parallel": True,
                                                               "resume_dp": True})}  # then dp4 x pp1 x tp1


GENERATE_KINDS = ("llama", "mistral_window", "qwen3_moe", "deepseek_v3", "gemma3_text")  # tests/generate_cases.py


def _world(request: pytest.FixtureRequest, folders: dict, world_size: int, pairs: tuple, trainer_cases: dict) -> dict:
    cases = [(f"{kind}-{schedule}", functools.partial(_pipelined_vs_hf, folders[kind.removesuffix("_packed")],
                                                      kind.removesuffix("_packed"), schedule, 4,
                                                      packed=kind.endswith("_packed")))
             for kind, schedule in pairs]
    cases += [(name, functools.partial(_trainer_vs_hf, folders[kind], kind, os.path.join(folders["runs"], name), dp,
                                       schedule, m, **overrides))
              for name, (kind, dp, schedule, m, overrides, _) in trainer_cases.items()]
    cases += [(name, functools.partial(lora_cases.trainer_vs_peft, folders[kind], kind,
                                       os.path.join(folders["runs"], name), dp, schedule, m, **overrides))
              for name, (kind, dp, schedule, m, overrides) in (LORA_CASES if world_size == 2 else LORA_CASES_4).items()]
    if world_size == 4:
        cases.append(("every-moe-ep2", functools.partial(_every_moe_ep2, folders)))
        cases.append(("chat-cp2", functools.partial(chat_cases.trainer_on_chat_vs_hf, folders["llama"], "llama",
                                                    os.path.join(folders["runs"], "chat-cp2"), 1, "1f1b",
                                                    parallel__cp=2)))
    if world_size == 2:
        cases.append(("every-family", functools.partial(_every_family, folders)))
        cases.append(("bf16", functools.partial(_bf16_vs_fp32, folders["llama"], os.path.join(folders["runs"], "bf16"),
                                                1, "1f1b")))
        cases.append(("chat", functools.partial(chat_cases.trainer_on_chat_vs_hf, folders["llama"], "llama",
                                                os.path.join(folders["runs"], "chat"))))
        cases += [(f"generate-{kind}", functools.partial(generate_cases.pipeline_vs_hf_generate, folders[kind], kind))
                  for kind in GENERATE_KINDS]
        cases.append(("generate-command", functools.partial(generate_cases.generate_command_from_checkpoint,
                                                            folders["llama"], os.path.join(folders["runs"], "gen"))))
        cases.append(("generate-lora", functools.partial(generate_cases.generate_from_a_lora_checkpoint,
                                                         folders["llama"], os.path.join(folders["runs"], "gen-lora"))))
    return run_cases(world_size, selected_cases(request, cases))


@pytest.fixture(scope="module")
def world2(request, folders):
    """Every 2-process case, run once in one 2-process world."""
    return _world(request, folders, 2, MP_CASES, TRAINER_CASES)


@pytest.fixture(scope="module")
def world4(request, folders):
    """Every 4-process case (each rank one decoder layer, the embedding and head with the ends)."""
    return _world(request, folders, 4, MP_CASES_4, {**TRAINER_CASES_4, **TP_CASES_4})


def _check(results: list) -> None:
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
        assert result.value["compared"] > 0
        assert result.value["grad"] <= TOLERANCE, (rank, result.value)
        assert result.value.get("grad_float32", 0.0) <= FLOAT32_TOLERANCE, (rank, result.value)
        assert result.value["loss"] <= TOLERANCE, (rank, result.value)


@pytest.mark.parametrize("kind,schedule", MP_CASES)
def test_pipelined_equals_hugging_face_on_2_processes(world2, kind, schedule):
    _check(world2[f"{kind}-{schedule}"])


@pytest.mark.parametrize("kind", EVERY_FAMILY)
def test_every_family_pipelined_on_2_processes_equals_hugging_face(world2, kind):
    """Issue 58: each family's loss and every gradient on 2 pipeline ranks equal transformers' own
    model on the whole batch (float64; routers computed in float32 within FLOAT32_TOLERANCE)."""
    _check([CaseResult(value=r.value[kind]) if r.error is None else r for r in world2["every-family"]])


@pytest.mark.parametrize("kind,schedule", MP_CASES_4)
def test_pipelined_equals_hugging_face_on_4_processes(world4, kind, schedule):
    _check(world4[f"{kind}-{schedule}"])


def _check_trainer(results: list, tolerance: float) -> None:
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
        assert result.value["compared"] > 0
        for key in ("loss", "grad", "param"):
            assert result.value[key] <= tolerance, (rank, key, result.value)
        for key in ("grad_float32", "param_float32"):  # what a family computes in float32 (routers)
            assert result.value.get(key, 0.0) <= max(tolerance, FLOAT32_TOLERANCE), (rank, key, result.value)


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_trainer_equals_hugging_face_on_2_processes(world2, name):
    """build_run(model=hf) with activation checkpointing and variable lengths (float64), in float32,
    and compiled."""
    _check_trainer(world2[name], TRAINER_CASES[name][-1])
    if "varlen" in name:
        assert len(world2[name][0].value["lengths"]) > 1  # the micro-batches really differed in length
    for result in world2[name]:
        compiled = result.value["compile"]
        assert (compiled is not None) == ("compiled" in name)
        if compiled is not None:  # every layer of the rank compiled whole
            assert compiled["layers"] > 0 and compiled["eager_layers"] == {}, compiled


@pytest.mark.parametrize("kind", EVERY_MOE)
def test_every_moe_family_with_its_experts_split_over_ep2_equals_hugging_face(world4, kind):
    """Issue 58: each mixture-of-experts family through the Trainer on dp 2 x pp 2 x ep 2 (its fused
    experts split by the config's base_model_ep_plan) against transformers on the whole batch."""
    results = [CaseResult(value=r.value[kind]) if r.error is None else r for r in world4["every-moe-ep2"]]
    _check_trainer(results, TOLERANCE)
    assert sum(r.value["ep_split"] for r in results) > 0


@pytest.mark.parametrize("name", list(TRAINER_CASES_4))
def test_trainer_equals_hugging_face_on_dp2_pp2(world4, name):
    """dp2 x pp2: FSDP2 (parallel.shard=full) with 1f1b and zbv (a MoE's fused experts and float32
    routers sharded too); zbv (V placement: embedding and head, so the tie, on pipeline rank 0) with
    ZeRO-1 too; Hugging Face MoE families with ep 2."""
    _check_trainer(world4[name], TRAINER_CASES_4[name][-1])
    full = TRAINER_CASES_4[name][4].get("parallel__shard") == "full"
    assert all((r.value["sharded"] == r.value["compared"]) == full for r in world4[name])  # FSDP2's DTensors
    for result in world4[name]:  # compiled: every layer, a decoder whose experts are split by its attention
        compiled = result.value["compile"]
        assert (compiled is not None and compiled["eager_layers"] == {}) == ("compiled" in name), compiled
    split = sum(r.value["ep_split"] for r in world4[name])  # issue 58: each rank holds half of every layer's experts
    assert (split > 0) == name.startswith("ep2"), split
    if TRAINER_CASES_4[name][4].get("resume_ep1"):  # its checkpoint holds each expert once, whole at ep 1
        assert all(r.value["resumed_step"] == 2 and r.value["resumed_compared"] > 0 for r in world4[name])
        assert max(r.value["resumed"] for r in world4[name]) <= TRAINER_CASES_4[name][-1], world4[name][0].value


@pytest.mark.parametrize("name", list(TP_CASES_4))
def test_trainer_equals_hugging_face_on_pp2_tp2(world4, name):
    """pp2 x tp2 (parallel.tp=2): attention heads, MLP, and the tied embedding and head's vocabulary split
    over two ranks per stage, with 1f1b and zbv, and 1f1b with sequence parallelism, equal to Hugging
    Face's unsplit model (float64)."""
    _check_trainer(world4[name], TP_CASES_4[name][-1])
    for result in world4[name]:  # linear and embedding weights split (DTensors), the norms whole on every tp rank
        sharded, compared = result.value["sharded"], result.value["compared"]  # (with sequence parallelism the
        assert 0 < sharded <= compared if name.endswith("-sp") else 0 < sharded < compared, result.value  # norms too)


def _check_lora(results: list) -> None:
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, (rank, key, v)
        assert v["frozen"] > 0 and v["frozen_grads"] == 0 and v["frozen_in_optimizer"] == 0, (rank, v)
    assert sum(r.value["compared"] for r in results) > 0  # adapters trained somewhere
    assert all(len(r.value["report"]) == 1 and "trainable" in r.value["report"][0] for r in results)
    for r in results:  # the checkpoint resumed at dp = world x pp1: every adapter as trained, on every rank
        assert r.value["adapters"] >= 2 * SMALL["num_hidden_layers"]  # lora_A and lora_B of a target in every layer
        assert "resumed" not in r.value or (r.value["resumed_step"] == 2 and r.value["resumed"] <= TOLERANCE
                                            and r.value["resumed_compared"] == r.value["adapters"]), r.value


@pytest.mark.parametrize("name", list(LORA_CASES))
def test_lora_trainer_equals_the_unsplit_peft_model_on_2_processes(world2, name):
    """model.lora: loss, adapter gradients and updates equal peft's unsplit model (float64); the
    frozen base has no gradient and no AdamW state, with a compiled split backward and with recomputation."""
    _check_lora(world2[name])
    assert (sum(r.value["expert_adapters"] for r in world2[name]) > 0) == ("experts" in name)
    compiled = world2[name][0].value["compile"]
    assert (compiled is not None and compiled["eager_layers"] == {}) == ("compiled" in name), compiled


@pytest.mark.parametrize("name", list(LORA_CASES_4))
def test_lora_trainer_equals_the_unsplit_peft_model_on_4_processes(world4, name):
    """model.lora with FSDP2 over dp2 and zbv (a rank whose stages hold only frozen weights trains
    nothing); with pp2 x tp2 and sequence parallelism, each adapter split with the Linear it wraps;
    DeepSeek-V3's latent attention adapted while its frozen experts are split over ep 2 (no
    gradient reaches them) under DualPipeV."""
    _check_lora(world4[name])
    if "full-shard" in name or "ep2" in name:
        assert min(r.value["compared"] for r in world4[name]) == 0
    else:  # tp: the adapters of the split Linear modules are DTensors too
        assert all(r.value["sharded"] > 0 for r in world4[name]), [r.value for r in world4[name]]


def test_bf16_gradients_agree_with_fp32(world2):
    """train.precision=bf16 (float32 weights): gradients near fp32's, activations sent in bfloat16."""
    for rank, result in enumerate(world2["bf16"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert 0 < v["grad"] < 0.05, (rank, v)
        assert v["edges_fp32"] == ["torch.float32", "torch.int64"], (rank, v)  # hidden states, position ids
        assert v["edges_bf16"] == ["torch.bfloat16", "torch.int64"], (rank, v)


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", list(KINDS))
def test_layers_in_sequence_equal_the_model_forward(tmp_path, kind):
    """Loaded from safetensors: the layers run in order give Hugging Face's logits (float64)."""
    model = write_model(str(tmp_path), kind)
    spec = build_hf(str(tmp_path))
    assert len(spec) == SMALL["num_hidden_layers"] + 2
    assert bool(spec.tied) == bool(model.config.tie_word_embeddings)  # llama_tied, and Gemma's by default
    layers = spec.build_all(dtype=torch.float64)
    tie_in_place(spec, dict(enumerate(layers)))
    ref = reference(kind, str(tmp_path)).to(torch.float64)
    x = torch.randint(64, (3, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(run_layers(layers, x), ref(x).logits)
    # the export names are Hugging Face's own: every parameter maps onto one of the model's
    names = {spec.export_name(i, key) for i, layer in enumerate(layers) for key in layer.state_dict()}
    assert names == set(ref.state_dict())


def has_experts(model_type: str) -> bool:
    """Whether a family taken by form is a mixture of experts (its config class routes experts)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(vars(CONFIG_MAPPING[model_type]()).keys() & EXPERT_KEYS)


def _by_form_model(folder: str, model_type: str) -> torch.nn.Module:
    """A tiny random model of a family taken by form, saved into `folder`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from pipeflow.models.hf_forms import causal_lm_classes

    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls()
    extra = {key: value for key, value in _BY_FORM_KEYS.items() if hasattr(defaults, key)}
    extra.update(_MLA if "kv_lora_rank" in extra else {})
    config = config_cls(**{**SMALL, "num_hidden_layers": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                           **extra}, experts_implementation="eager")
    torch.manual_seed(1)
    model = getattr(transformers, causal_lm_classes()[model_type])(config)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("model_type", BY_FORM)
def test_a_family_taken_by_the_form_of_its_forwards_trains_as_its_own_model(tmp_path, model_type):
    """Issue 58: a family no test names (PhiMoE, Seed-OSS, VaultGemma ...) is cut because its forwards
    are a tested family's: its layers in sequence give its own model's logits and gradients in
    training mode (dropout and router jitter drawn alike: one seed, one process), float64."""
    _by_form_model(str(tmp_path), model_type)
    spec = build_hf(str(tmp_path))
    layers = spec.build_all(dtype=torch.float64)
    tie_in_place(spec, dict(enumerate(layers)))
    from pipeflow.models.hf_forms import family

    kind = family(transformers.AutoConfig.from_pretrained(str(tmp_path)))
    assert not kind.tested
    ref = kind.cls.from_pretrained(str(tmp_path), experts_implementation="eager").to(torch.float64).train()
    x = torch.randint(64, (3, 12), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(3, 12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    (run_layers(layers, x) * weights).sum().backward()
    torch.manual_seed(5)
    logits = ref(x).logits
    (logits * weights).sum().backward()
    mine = {key: p for layer in layers for key, p in layer.named_parameters()}
    theirs = dict(ref.named_parameters(remove_duplicate=False))  # a tied head under its own name too
    assert mine.keys() == theirs.keys()
    for key, param in mine.items():
        tolerance = FLOAT32_TOLERANCE if key.endswith(FLOAT32_KEPT) else TOLERANCE
        assert rel(_grad(param), _grad(theirs[key])) <= tolerance, key


def test_the_forms_a_family_is_taken_by_are_the_tested_families_forms():
    """Every tested family's forwards are among hf_forms' forms (one family stands for each), and
    a tested family of Mistral's form slides every layer by sliding_window."""
    from pipeflow.models import hf_forms
    from pipeflow.models.hf_forms import TESTED

    for which, forms in (("base", hf_forms.BASE_FORMS), ("head", hf_forms.HEAD_FORMS)):
        known = {hf_forms._form(kind, which) for kind in forms}
        assert {kind for kind in TESTED if hf_forms._form(kind, which) not in known} == set()
        assert len(known) == len(forms)  # no form stood for twice
    assert [k for k in TESTED if hf_forms._window_mask(k)] == ["mistral", "phi3", "mixtral", "qwen3_moe"]


def test_a_checkpoint_with_per_expert_tensors_loads_into_fused_experts(tmp_path):
    """Issue 58: Mixtral stores experts.<e>.w1/w3/w2 under block_sparse_moe; transformers' conversion
    mapping renames and fuses them into mlp.experts.gate_up_proj (w1 then w3 per expert) and
    down_proj, and a layer reads only its own experts' tensors."""
    from safetensors import safe_open

    from pipeflow.models.hf_convert import Fused

    write_model(str(tmp_path), "mixtral")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in stored  # as the hub stores it
    layer = build_hf(str(tmp_path)).layers[2].build()  # decoder layer 1
    fused = layer.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    w1 = [stored[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"] for e in range(4)]
    w3 = [stored[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"] for e in range(4)]
    assert torch.equal(fused, torch.cat([torch.stack(w1), torch.stack(w3)], 1))
    assert torch.equal(layer.get_parameter("model.layers.1.mlp.gate.weight"),
                       stored["model.layers.1.block_sparse_moe.gate.weight"])
    read = Fused(((("a", "b")),), (("stack", 0), ("cat", 1)))
    assert read.shape({"a": [2, 3], "b": [2, 3]}) == [2, 2, 3]


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_an_ep_rank_holds_and_reads_only_its_own_experts(tmp_path, monkeypatch, kind):
    """Issue 58: under parallel.ep a layer is built holding only its ep rank's experts and reads only
    their tensors: Mixtral's per-expert ones (experts 2, 3 of 4 on ep rank 1 of 2), gpt-oss's fused
    ones as rows of the stored tensor."""
    import safetensors

    from pipeflow.models.hf_experts import NARROWED, reading_experts_of

    model = write_model(str(tmp_path), kind)
    read: list[tuple[str, object]] = []
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, name):
            read.append((name, None))
            return self.file.get_tensor(name)

        def get_slice(self, name):  # a header's shape, or rows read by indexing
            part = self.file.get_slice(name)

            class Rows:
                def __getitem__(self, index):
                    read.append((name, "rows"))
                    return part[index]

                def __getattr__(self, attr):
                    return getattr(part, attr)
            return Rows()

        def __getattr__(self, name):  # keys(), metadata(): the header
            return getattr(self.file, name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    with reading_experts_of(1, 2):
        layer = build_hf(str(tmp_path)).layers[2].build()  # decoder layer 1
    experts = layer.get_submodule("model.layers.1.mlp.experts")
    assert getattr(experts, NARROWED) == (1, 2, 4)
    whole = dict(model.named_parameters())
    for name, param in experts.named_parameters():
        assert torch.equal(param, whole[f"model.layers.1.mlp.experts.{name}"][2:4]), name
    names = [name for name, _ in read if ".experts." in name]
    if kind == "mixtral":
        assert names and all(".experts.2." in n or ".experts.3." in n for n in names), names
    else:
        assert names and all(how == "rows" for name, how in read if ".experts." in name), read


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_each_moe_layer_adds_its_own_balancing_loss_and_counts_its_experts(tmp_path, kind):
    """Issue 58: with output_router_logits and router_aux_loss_coef, each MoE layer's loss is the
    family's load_balancing_loss_func of its own router logits (per layer, not transformers' one
    loss over every layer's logits concatenated), attached for backward where the layer runs: the
    gradients equal cross entropy + coef x the sum of those per-layer losses (float64), and the
    step's figures hold each layer's tokens per expert and weighted loss."""
    import importlib

    from pipeflow.models.aux_loss import aux_loss_scope
    from pipeflow.models.hf import ROUTERS
    from pipeflow.models.module_spec import cross_entropy

    write_model(str(tmp_path), kind)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=0.05)
    (tmp_path / "config.json").write_text(json.dumps(config))
    layers = build_hf(str(tmp_path)).build_all(dtype=torch.float64)
    ref = reference(kind, str(tmp_path)).to(torch.float64)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(64, (3, 12), generator=gen), torch.randint(64, (3, 12), generator=gen)
    with aux_loss_scope(1.0):
        loss = cross_entropy(run_layers(layers, x), y)
    loss.backward()
    out = ref(x, output_router_logits=True)
    balance = importlib.import_module(type(ref).__module__).load_balancing_loss_func
    E, k = int(config.get("num_local_experts") or config["num_experts"]), config["num_experts_per_tok"]
    per_layer = [0.05 * balance((logits,), E, k, None) for logits in out.router_logits]
    (cross_entropy(out.logits, y) + sum(per_layer)).backward()
    pairs = [(p, ref.get_parameter(n)) for layer in layers for n, p in layer.named_parameters()]
    assert max(rel(a.grad, b.grad) for a, b in pairs) <= TOLERANCE
    routers = [r for layer in layers for r in getattr(layer, ROUTERS, ())]
    assert len(routers) == SMALL["num_hidden_layers"]
    for router, logits, aux in zip(routers, out.router_logits, per_layer):
        stats = router.take_stats()
        chosen = torch.topk(logits.softmax(-1), k, dim=-1).indices
        assert stats[:E].tolist() == torch.bincount(chosen.flatten(), minlength=E).double().tolist()
        assert abs(stats[-1].item() - aux.item()) <= 1e-12 * abs(aux.item())


def test_deepseek_v3s_correction_bias_moves_towards_the_mean_load_after_each_step(tmp_path):
    """Issue 58: aux-loss-free balancing. The step's tokens per expert (summed in the step's packet,
    as over micro-batches and ranks) move each MoE layer's e_score_correction_bias by
    model.moe.bias_update_rate x sign(mean - load), outside the optimizer; 0 leaves it."""
    from pipeflow.models.aux_loss import aux_loss_scope
    from pipeflow.runtime.parallel.routing import RoutingSync

    write_model(str(tmp_path), "deepseek_v3")
    for rate in (0.01, 0.0):
        spec = build_hf(str(tmp_path), moe={"bias_update_rate": rate})
        layers = spec.build_all(dtype=torch.float64)
        sync = RoutingSync(dict(enumerate(layers)), len(layers), spec.routed_experts)
        assert sorted(sync.routers) == [2, 3, 4]  # decoder layers 1-3 (first_k_dense_replace=1 keeps layer 0 dense)
        before = {i: r.bias.clone() for i, r in sync.routers.items()}
        with aux_loss_scope(1.0):
            run_layers(layers, torch.randint(64, (3, 12), generator=torch.Generator().manual_seed(0)))
        packet = sync.packet(torch.device("cpu"))
        sync.balance(packet)
        block = packet.view(len(layers), -1)
        for i, router in sync.routers.items():
            load = block[i, :8]
            assert load.sum() == 3 * 12 * 2  # every token's two experts counted
            expected = before[i] + rate * torch.sign(load.mean() - load).to(before[i].dtype)
            assert torch.equal(router.bias, expected) and router.bias.dtype == before[i].dtype
    with pytest.raises(ConfigError, match=r"model.moe.bias_update_rate=-1.0 must be >= 0"):
        build_hf(str(tmp_path), moe={"bias_update_rate": -1.0})


def test_quantized_weights_are_refused_by_name(tmp_path):
    write_model(str(tmp_path), "llama", weights=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"holds quantized weights \(quantization_config: fp8\); model=hf trains "
                                          r"unquantized weights only: dequantize"):
        build_hf(str(tmp_path))


def test_packed_documents_equal_each_document_alone(tmp_path):
    """(tokens, document ids): positions restart per document, attention stays inside it."""
    write_model(str(tmp_path), "llama")
    spec = build_hf(str(tmp_path))
    layers = spec.build_all(dtype=torch.float64)
    x = torch.randint(64, (1, 10), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    packed = run_layers(layers, (x, doc))
    assert torch.allclose(packed[:, :4], run_layers(layers, x[:, :4]), rtol=0, atol=1e-12)
    assert torch.allclose(packed[:, 4:], run_layers(layers, x[:, 4:]), rtol=0, atol=1e-12)


def test_random_init_is_seeded_and_follows_the_config(tmp_path):
    """Without safetensors: the model's own _init_weights (normal(0, initializer_range), norms at
    one), the same on every build, different for another seed."""
    write_model(str(tmp_path), "llama", weights=False)
    a = build_hf(str(tmp_path)).build_layers([1])[0].state_dict()
    b = build_hf(str(tmp_path)).build_layers([1])[0].state_dict()
    c = build_hf(str(tmp_path), seed=3).build_layers([1])[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(a["model.layers.0.input_layernorm.weight"], torch.ones(SMALL["hidden_size"]))
    std = a["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.003


def test_save_config_writes_the_models_config(tmp_path):
    write_model(str(tmp_path / "in"), "mistral_window")
    build_hf(str(tmp_path / "in")).save_config(str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 5


def test_named_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        build_hf(None)
    with pytest.raises(ConfigError, match="no config.json"):
        build_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"^model=hf does not support GPT2LMHeadModel \(model_type 'gpt2'\): "
                                          r"GPT2LMHeadModel.forward computes outside its layers"):
        build_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    with pytest.raises(ConfigError, match=r"^model=hf does not support T5Model \(model_type 't5', .*config.json\): "
                                          r"transformers has no \*ForCausalLM of that model_type"):
        build_hf(str(tmp_path))


def test_lora_targets_naming_fused_experts_adapt_them_through_peft_target_parameters(tmp_path):
    """Issue 58: Qwen2-MoE's down_proj is both its shared expert's Linear and its routed experts' fused
    tensor: both are adapted, the fused ones as peft's target_parameters (each expert its rank-r
    factors), and the run refuses by name what they do not run with."""
    from peft.tuners.lora import ParamWrapper

    from pipeflow.errors import LoraError
    from pipeflow.models.lora import LoraConfig, check_fused_targets

    write_model(str(tmp_path), "qwen2_moe", weights=False)
    spec = build_hf(str(tmp_path), lora=LoraConfig(rank=4, targets=["q_proj", "down_proj"]))
    assert spec.lora.parameters == tuple(f"model.layers.{i}.mlp.experts.down_proj" for i in range(4))
    layer = spec.build_layers([2])[0]  # decoder layer 1, its adapters injected
    assert isinstance(layer.get_submodule("model.layers.1.mlp.experts"), ParamWrapper)
    trainable = {name for name, p in layer.named_parameters() if p.requires_grad}
    assert {"model.layers.1.mlp.experts.lora_A.default.weight", "model.layers.1.mlp.shared_expert.down_proj."
            "lora_A.default.weight", "model.layers.1.self_attn.q_proj.lora_B.default.weight"} <= trainable
    assert not any("base_layer" in name for name in trainable)
    check_fused_targets(spec.lora, 1, 1, "optimizer")
    for ep, tp, shard, why in ((2, 1, "none", "parallel.ep=2"), (1, 2, "none", "parallel.tp=2"),
                               (1, 1, "full", "parallel.shard=full")):
        with pytest.raises(LoraError, match=f"adapt the fused expert weights model.layers.0.mlp.experts.down_proj, "
                                            f".* does not run with {why}"):
            check_fused_targets(spec.lora, ep, tp, shard)
    only_linear = build_hf(str(tmp_path), lora=LoraConfig(rank=4, targets=["q_proj", "model.layers.*.shared_expert.*"]))
    assert only_linear.lora.parameters == ()


def _damaged_tensors(folder, change) -> None:
    """Rewrite `folder`'s model.safetensors after `change(tensors)`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_missing_or_misshaped_tensor_is_named_by_build_hf_on_every_rank(tmp_path):
    """Issue 38: a tensor missing from the safetensors files, or of another shape, was named only
    by the rank that built its layer; build_hf (which every rank runs before any collective) now
    checks the files' headers against every tensor of the model."""
    write_model(str(tmp_path / "a"), "llama")
    write_model(str(tmp_path / "b"), "llama")
    _damaged_tensors(tmp_path / "a", lambda t: t.pop("model.norm.weight"))
    _damaged_tensors(tmp_path / "b", lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}))
    with pytest.raises(ConfigError, match=r"^1 tensor\(s\) of the model .*/a/config.json describes are in none of the "
                                          r"safetensors files in .*\['model.safetensors'\]\): 'model.norm.weight'; .*"
                                          r"re-download or re-export the model folder$"):
        build_hf(str(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"^tensor 'model.layers.1.mlp.up_proj.weight' in .*/b/model.safetensors has "
                                          r"shape \[3, 3\], the model's is \[64, 32\]: the weights do not match"):
        build_hf(str(tmp_path / "b"))


def _truncate(folder, keep) -> None:
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep(len(data))])


DAMAGES = {  # damage -> the one line build_hf raises
    "no-folder": r"^model.path='.*/nowhere' does not exist; give a local Hugging Face model folder",
    "a-file": (r"^model.path='.*/config.json' is a file, not a folder; give the folder that holds config.json .*"
               r"\(model.path='.*/m'\?\)$"),
    "not-json": (r"^.*/m/config.json is not JSON \(JSONDecodeError: .*\); model=hf reads the model's config from it: "
                 r"re-download or re-export the model folder$"),
    "json-list": (r"^.*/m/config.json holds a JSON list, not an object of config keys .*re-download or re-export"),
    "contradiction": (r"^.*/m/config.json contradicts itself: model_type 'gpt2' but architectures \['LlamaForCausalLM'\] "
                      r"\(LlamaForCausalLM is model_type 'llama'\); correct whichever is wrong"),
    "truncated": (r"^.*/m/model.safetensors is not a readable safetensors file: its header describes \d+ bytes but the "
                  r"file holds \d+: truncated .*; re-download or re-export it \(safetensors: .*incomplete metadata"),
    "100-bytes": (r"^.*/m/model.safetensors is not a readable safetensors file: its header length \(\d+ bytes\) runs "
                  r"past the end of the file \(100 bytes\): truncated.*; re-download or re-export it"),
    "index-names-a-missing-file": (r"^.*/m/model.safetensors.index.json names .*/m/model-00002-of-00002.safetensors, "
                                   r"which is missing \(an incomplete download\?\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_model_folder_is_one_named_line_from_build_hf(tmp_path, damage):
    """Issue 38: each used to be a raw error (SafetensorError without the file, JSONDecodeError or
    AttributeError inside Hydra's traceback, a "does not support LlamaForCausalLM ... supported:
    LlamaForCausalLM" contradiction); now build_hf, on every rank before anything is built, names
    the file or the key, what is wrong and the fix."""
    from pipeflow.errors import PipeflowError

    folder = tmp_path / "m"
    write_model(str(folder), "llama")
    path = str(folder)
    config = folder / "config.json"
    if damage == "no-folder":
        path = str(tmp_path / "nowhere")
    elif damage == "a-file":
        path = str(config)
    elif damage == "not-json":
        config.write_text('{"model_type": "llama",')
    elif damage == "json-list":
        config.write_text("[1, 2]")
    elif damage == "contradiction":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gpt2"}))
    elif damage == "truncated":
        _truncate(folder, lambda n: n // 2)
    elif damage == "100-bytes":
        _truncate(folder, lambda n: 100)
    else:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(PipeflowError, match=DAMAGES[damage]) as caught:
        build_hf(path)
    assert "\n" not in str(caught.value)


def test_nan_in_a_loaded_weight_names_the_tensor_and_file_not_the_learning_rate(tmp_path):
    """Issue 38: NaN in the safetensors weights surfaced as a NonFiniteError at step 0 blaming
    optim.lr; the layer that loads the tensor now names it and its file."""
    from pipeflow.errors import CheckpointError

    write_model(str(tmp_path), "llama")

    def poison(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])

    _damaged_tensors(tmp_path, poison)
    spec = build_hf(str(tmp_path))
    spec.build_layers([0, 1])  # the layers whose tensors are finite build
    with pytest.raises(CheckpointError, match=r"^layer 'layer.1': tensor 'model.layers.1.mlp.up_proj.weight' in "
                                              r".*model.safetensors holds 2 NaN and 1 Inf of its 2048 values: .*"
                                              r"re-download or re-export it \(nothing has trained yet: not a learning-rate"):
        spec.build_layers([2])


def test_init_from_loads_a_state_dict_under_the_hugging_face_names(tmp_path):
    """model=hf model.init_from=<torch.save of the model's state dict>: instead of the folder's
    safetensors (here a folder with config.json alone); a NaN there is named alike."""
    from pipeflow.errors import CheckpointError

    ref = write_model(str(tmp_path / "m"), "llama_tied", weights=False)
    torch.save(ref.state_dict(), tmp_path / "sd.pt")
    spec = build_hf(str(tmp_path / "m"), init_from=str(tmp_path / "sd.pt"))
    layers = spec.build_all()
    tie_in_place(spec, dict(enumerate(layers)))
    assert all(torch.equal(p, ref.get_parameter(k)) for layer in layers for k, p in layer.named_parameters())
    state = ref.state_dict()
    state["model.norm.weight"][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError, match=r"^layer 'head': 'model.norm.weight' in model.init_from='.*nan.pt' holds 1 NaN"):
        build_hf(str(tmp_path / "m"), init_from=str(tmp_path / "nan.pt")).build_layers([len(spec) - 1])


def test_tp_plan_follows_the_configs_base_model_tp_plan(tmp_path):
    """parallel.tp's plan: base_model_tp_plan's keys under ``model.``, the vocabulary of the embedding and
    the head split alike."""
    write_model(str(tmp_path), "llama_tied", weights=False)
    spec = build_hf(str(tmp_path))
    last = len(spec) - 1
    embedding, decoder, head = spec.build_layers([0, 2, last])
    assert spec.tensor_plan(0, embedding, 2) == {"model.embed_tokens": "embedding", "": "sequence_out"}
    assert spec.tensor_plan(last, head, 2) == {"model.norm": "norm", "lm_head": "colwise_out"}
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    # the projections take whole inputs: with sequence parallelism the norms before them gather theirs
    assert spec.tensor_plan(2, decoder, 2) == {
        "model.layers.1.input_layernorm": "norm_gathered", "model.layers.1.post_attention_layernorm": "norm_gathered",
        f"{attn}.q_proj": "colwise_whole", f"{attn}.k_proj": "colwise_whole", f"{attn}.v_proj": "colwise_whole",
        f"{attn}.o_proj": "rowwise", f"{mlp}.gate_proj": "colwise_whole", f"{mlp}.up_proj": "colwise_whole",
        f"{mlp}.down_proj": "rowwise"}


def test_tp_plan_named_errors(tmp_path):
    """A tp that does not divide the heads, the kv heads or the vocabulary; a config without a
    base_model_tp_plan, or with a style model=hf does not support: ConfigErrors naming them."""
    write_model(str(tmp_path / "llama"), "llama", weights=False)
    spec = build_hf(str(tmp_path / "llama"))
    embedding, decoder = spec.build_layers([0, 1])
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide .*num_attention_heads=4"):
        spec.tensor_plan(1, decoder, 3)
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide .*num_key_value_heads=2"):
        spec.tensor_plan(0, embedding, 4)
    folder = str(tmp_path / "vocab")
    transformers.LlamaConfig(**{**SMALL, "vocab_size": 66, "num_key_value_heads": 4}).save_pretrained(folder)
    wide = build_hf(folder)
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide .*vocab_size=66"):
        wide.tensor_plan(0, wide.build_layers([0])[0], 4)
    config = spec.tp_plan.args[0]  # the config the plan reads
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.up_proj": "colwise_rep"}
    with pytest.raises(ConfigError, match=r"'layers.\*.mlp.up_proj': 'colwise_rep'.*supported: colwise, rowwise"):
        spec.tensor_plan(1, decoder, 2)
    config.base_model_tp_plan = None
    with pytest.raises(ConfigError, match="has no base_model_tp_plan.*parallel.tp=1"):
        spec.tensor_plan(1, decoder, 2)


def test_importing_pipeflow_never_imports_transformers():
    code = ("import sys, pipeflow, pipeflow.models, pipeflow.config.schema, pipeflow.run.builder; "
            "bad = [m for m in ('transformers', 'safetensors', 'tokenizers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_an_untested_transformers_version_warns(tmp_path, monkeypatch):
    write_model(str(tmp_path), "llama", weights=False)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")  # the module build_hf imports
    with pytest.warns(UserWarning, match=r"transformers 5.99.0 is untested .*tested: 5.25"):
        build_hf(str(tmp_path))


def test_trainer_on_chat_data_equals_hugging_face_on_the_masked_packed_batch(world2):
    """data=chat (tokenised by the chat template in the workers, conversations packed with their
    document ids, prompts masked) through build_run(model=hf) with zb_h1 equals Hugging Face's
    model on the global batch: its mean over the assistant tokens (float64)."""
    for rank, result in enumerate(world2["chat"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["compared"] > 0 and 0 < v["trained"] < 0.5, (rank, v)  # most targets masked
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, (rank, key, v)


def test_trainer_on_packed_chat_data_with_context_parallelism_equals_hugging_face(world4):
    """Issue 59: packed conversations on pp 2 x cp 2: documents cross the chunk boundaries, each rank
    holding its head and tail chunks with the whole rows' document ids (positions, ring masks)."""
    for rank, result in enumerate(world4["chat-cp2"]):
        assert result.error is None, f"rank {rank}: {result.error}"
        v = result.value
        assert v["compared"] > 0 and 0 < v["trained"] < 0.5, (rank, v)
        for key in ("loss", "grad", "param"):
            assert v[key] <= TOLERANCE, (rank, key, v)


# --------------------------------------------------------------------------- generation (issue 43)
@pytest.mark.parametrize("kind", GENERATE_KINDS)
def test_generation_on_the_pipeline_equals_hugging_face_generate(world2, kind):
    """Greedy on 2 stages (float64, KV cache per stage) = transformers' greedy generate token for
    token; batched (left-padded, micro-batches in flight) = one prompt at a time; sampling
    reproducible by seed; a list of end-of-sequence ids stops each row at its first."""
    results = world2[f"generate-{kind}"]
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
    out = results[0].value
    assert out["batched"] == out["hf"]
    assert out["one_at_a_time"] == out["hf"]
    same, again, other = out["sampled"]
    assert same == again and same != other
    for row, greedy in zip(out["eos"], out["batched"]):
        stop = next((k for k, t in enumerate(greedy) if t in out["eos_ids"]), None)
        assert row == (greedy if stop is None else greedy[:stop + 1])
    assert len(out["eos"][0]) <= 3 and len(out["eos"][2]) <= 5  # cut at its first (a token may repeat)


def test_generate_command_reads_the_runs_config_and_checkpoint(world2):
    """python -m pipeflow.generate train.resume=<checkpoint> alone: the saved config.yaml, the layers
    loaded by index, the completions written as JSON lines equal Hugging Face's generate."""
    results = world2["generate-command"]
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
        assert result.value["code"] == 0
    assert results[0].value["written"] == results[0].value["expected"]


def test_generate_command_applies_a_lora_runs_adapters(world2):
    """python -m pipeflow.generate train.resume=<a LoRA run's checkpoint>: the adapters loaded over
    the base the checkpoint names give Hugging Face's greedy generate on the peft-merged model
    (float64); a config without model.lora is refused."""
    results = world2["generate-lora"]
    for rank, result in enumerate(results):
        assert result.error is None, f"rank {rank}: {result.error}"
        assert (result.value["code"], result.value["refused"]) == (0, 1), result.value
    out = results[0].value
    assert out["written"] == out["expected"]["lora"]
    assert out["written"] != out["expected"]["base"]  # the adapters changed what the model says


def test_a_split_hugging_face_experts_layer_names_its_ep_group(one_rank_group, tmp_path):
    """A Hugging Face experts module split by parallel.ep keeps its exchange where
    expert_parallel_ranks looks, so a lost ep peer is named as the ep group's failure, as for
    pipeflow's own MoE (before: only MoE modules were looked at)."""
    import torch.distributed as dist

    from pipeflow.runtime.parallel.expert_parallel import expert_parallel_ranks, split_experts

    write_model(str(tmp_path), "qwen3_moe")
    layer = build_hf(str(tmp_path)).layers[1].build()
    assert expert_parallel_ranks([layer]) is None
    assert split_experts([layer], dist.group.WORLD, 1) == 1
    assert expert_parallel_ranks([layer]) == [0]
