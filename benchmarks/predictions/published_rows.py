"""Published training runs kept as data (``benchmarks/predictions/published/*.json``), read into
rows the cluster planner can predict: model shape, GPUs, layout, what the source's software did,
and the published throughput as tokens per second per GPU (the one figure no FLOP convention
touches: where a source gives TFLOP/s only, its own convention converts them back).

Each source file says what it is, where it was published, its FLOP convention and every row's
model, layout and figure (``published/README.md``).  What a row's software did that the planner
models (fused or unfused attention, dp traffic behind compute or not, the optimizer's sharding)
comes from the source's statements, in :data:`STACKS`, never from a fit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

from pipeflow.models.gpt import build_gpt
from pipeflow.planning.cluster_search import Layout, Prediction, Workload, predict
from pipeflow.planning.hardware import Cluster, load_hardware
from pipeflow.planning.costs.layer_trace import CROSS_ENTROPY_BYTES, LayerShape, trace_layers
from pipeflow.planning.costs.roofline import Efficiency, weight_bytes

FOLDER = Path(__file__).with_name("published")
PRESETS = {"a100_sxm_80gb": "a100_sxm_80gb", "a100_sxm_40gb": "a100_sxm_40gb", "h100_sxm_80gb": "h100_sxm"}
MEGATRON_ORDER = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Stack:
    """What a source's software does that the planner models, as the source states it."""

    attention: str  # fused (flash kernels of the GPU's generation) | legacy (the previous one's) | unfused
    overlap_dp: bool  # the dp traffic behind compute
    tp_overlap: bool = False  # the tp collectives behind the matmuls
    shard: str = "none"  # none | optimizer (a distributed optimizer) | full (FSDP)
    sequence_parallel: bool = False  # with tp > 1
    dropout: float = 0.0
    dp_every_microbatch: bool = False  # FSDP's traffic per micro-batch (no no_sync under accumulation)
    flush_per_local_batch: bool = False  # with pp, each local batch its own pipeline (filled and drained)
    loss: str = "torch"  # its cross-entropy (:data:`LOSSES`)
    vocab_parallel: bool = False  # with tp, the head's logits kept split and the loss on each rank's share
    metric_losses: int = 0  # cross-entropies its trainer runs again on each micro-batch's logits, as metrics


LOGIT_BYTES = 2  # the published rows' logits: bf16 or fp16
# bytes a cross-entropy moves per logit, forward and backward
LOSSES = {
    "torch": tuple(LOGIT_BYTES * x for x in CROSS_ENTROPY_BYTES),  # F.cross_entropy, as the planner traces it
    "fused": (2.0, 4.0),  # flash-attn's CrossEntropyLoss: the logits read; their gradient written from them
    # Transformer Engine's: an online-softmax pass, then a pass writing the gradient into the
    # logits (cross_entropy_kernel); the backward scales it by the per-token grad (element_mul_kernel)
    "te": (6.0, 4.0),
    # Megatron's VocabParallelCrossEntropy: logits.float(), max, in-place subtract, exp, sum and
    # divide in fp32 (6 + 4 + 8 + 8 + 4 + 8); the backward's in-place multiply, the cast back (8 + 6)
    "fp32": (38.0, 14.0),
}
# a metric's cross-entropy per logit: log_softmax under autocast reads the bf16 logit, writes an fp32 one
METRIC_LOSS_BYTES = 6.0


STACKS = {  # (source file, GPU generation) -> its software, from the source's own words
    # Narayanan et al. SC'21: Megatron-LM 2021, unfused softmax attention, no dp overlap, fp16, dropout 0.1
    # (its vocab-parallel cross-entropy in fp32: --fp16-lm-cross-entropy unset; likewise in r0.8,
    # --cross-entropy-loss-fusion unset)
    ("megatron_lm_readme", "a100"): Stack("unfused", overlap_dp=False, dropout=0.1, loss="fp32", vocab_parallel=True),
    # Megatron-Core r0.8 (2024): Transformer Engine's fused attention (cuDNN, Hopper's own),
    # --overlap-grad-reduce --overlap-param-gather (a distributed optimizer), --tp-comm-overlap
    # (with sequence parallelism)
    ("megatron_lm_readme", "h100"): Stack("fused", overlap_dp=True, tp_overlap=True, shard="optimizer",
                                          sequence_parallel=True, loss="fp32", vocab_parallel=True),
    # llm-foundry (2023, tables before torch 2.0): Composer + PyTorch FSDP FULL_SHARD (prefetching),
    # every micro-batch gathering and reduce-scattering (Composer's sync context applies no_sync to
    # DDP only: composer/trainer/dist_strategy.py), FlashAttention written for Ampere: on H100
    # through Ampere's instructions; MPT's loss_fn default, fused_crossentropy (flash-attn's), and
    # after each micro-batch's backward Composer's two train metrics (MPT's use_train_metrics
    # default: LanguageCrossEntropy, LanguagePerplexity), each a torch CrossEntropyLoss on the logits
    ("llm_foundry_mpt", "a100"): Stack("fused", overlap_dp=True, shard="full", dp_every_microbatch=True, loss="fused",
                                       metric_losses=2),
    ("llm_foundry_mpt", "h100"): Stack("legacy", overlap_dp=True, shard="full", dp_every_microbatch=True,
                                       loss="fused", metric_losses=2),
    # Megatron-Bridge (2025-26, Megatron-Core): a distributed optimizer with --overlap-grad-reduce
    # --overlap-param-gather, experts over ep within dp, Transformer Engine's fused attention and
    # cross-entropy (scripts/performance/utils/overrides.py: cross_entropy_fusion_impl = "te")
    ("megatron_bridge_h100", "h100"): Stack("fused", overlap_dp=True, shard="optimizer", loss="te",
                                            vocab_parallel=True),
    # NeMo AutoModel (2025): FSDP2 over dp (prefetching), experts over ep within it (DeepEP's
    # all-to-all), Transformer Engine's fused attention; with pp, torch.distributed.pipelining's
    # schedule step()s each local batch (LBS) apart, GA times a step; MaskedCrossEntropy with
    # fp32_upcast false (examples/llm_benchmark): F.cross_entropy on the bf16 logits
    ("nemo_automodel_h100", "h100"): Stack("fused", overlap_dp=True, shard="full", flush_per_local_batch=True),
}


@dataclass(frozen=True)
class PublishedRow:
    """One published run, as the planner predicts it."""

    source: str
    label: str
    gpu: str
    dtype: str
    moe: bool
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    gated: bool
    gpus: int
    batch: int
    micro: int
    tp: int | None
    pp: int | None
    cp: int
    vp: int | None
    recompute: str | None
    published: dict[str, Any]
    ep: int = 1
    model: str = "{}"  # the source's model description (JSON): an MoE row's shape beyond the GPT fields
    local_batch: int | None = None  # samples per dp replica per accumulation step, where published (LBS)
    gather_dtype: str | None = None  # FSDP's parameter gathers, where the source's version says (else the dtype)
    reduce_dtype: str | None = None  # its gradient reductions, likewise

    @property
    def generation(self) -> str:
        """``a100`` or ``h100``."""
        return self.gpu.split("_")[0]

    @property
    def dense(self) -> bool:
        return not self.moe


def load(folder: Path = FOLDER) -> list[PublishedRow]:
    """Every row of every source file in `folder`."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        for r in json.loads(path.read_text())["rows"]:
            m = r["model"]
            rows.append(PublishedRow(
                path.stem, r["label"], r["gpu"], r["dtype"], bool(r["moe"]), m["layers"] or 0, m["hidden"] or 0,
                m.get("ffn_hidden") or 0, m["heads"] or 0, m.get("kv_heads") or m["heads"] or 0, m["vocab"] or 0,
                m["seq"] or 0, bool(m.get("gated_mlp")), r["gpus"], r["global_batch"], r.get("micro_batch") or 1,
                r.get("tp"), r.get("pp"), r.get("cp") or 1, r.get("vp"), r.get("recompute"), r["published"],
                r.get("ep") or 1, json.dumps(m, sort_keys=True), r.get("local_batch"), r.get("gather_dtype"),
                r.get("reduce_dtype")))
    return rows


def unmodelled(row: PublishedRow) -> str | None:
    """Why the planner cannot predict `row` as published, or None."""
    if row.dtype not in ("bf16", "fp16"):
        return f"{row.dtype} (not the BF16/FP16 peak)"
    if row.moe and hf_family(row) is None:
        return "MoE of a family not traced here"
    if row.gpu not in PRESETS:
        return f"GPU {row.gpu} has no vendor preset"
    if (row.source, row.generation) not in STACKS:
        return "its software is not described (STACKS)"
    if row.tp is None or row.pp is None:
        return "no layout published"
    if row.cp > 1:
        return "context parallelism (the cluster planner refuses cp)"
    if not row.moe and (row.gated or row.kv_heads != row.heads or row.ffn != 4 * row.hidden):
        return "not a GPT block (gated MLP or grouped-query attention: traced through model=hf, not yet here)"
    if row.gpus % (row.tp * row.pp) or row.batch % (row.gpus // (row.tp * row.pp) * row.micro):
        return "the batch does not split into the published layout's micro-batches"
    if published_tokens(row) is None:
        return "no figure convertible to tokens/s"
    return None


def model_flops_per_token(row: PublishedRow) -> float:
    """Megatron-Core's model FLOPs per token of a GPT block stack (no recomputation, full attention):
    ``12 l h^2 (2 + s/h + ffn/h) + 6 h V``."""
    l, h, s = row.layers, row.hidden, row.seq
    return 12 * l * h * h * (2 + s / h + row.ffn / h) + 6 * h * row.vocab


def paper_flops_per_token(row: PublishedRow) -> float:
    """Narayanan et al.'s Eq. 3 per token (the recomputed forward counted)."""
    l, h, s = row.layers, row.hidden, row.seq
    return 96 * l * h * h * (1 + s / (6 * h) + row.vocab / (16 * l * h))


def published_tokens(row: PublishedRow) -> float | None:
    """Tokens per second per GPU: as published, or TFLOP/s over the source's FLOPs per token."""
    figures = row.published
    if figures.get("tokens_per_s_per_gpu"):
        return float(figures["tokens_per_s_per_gpu"])
    if figures.get("tflops_per_gpu") and row.source == "megatron_lm_readme":
        per_token = paper_flops_per_token(row) if row.generation == "a100" else model_flops_per_token(row)
        return float(figures["tflops_per_gpu"]) * 1e12 / per_token
    return None


@lru_cache(maxsize=None)
def shapes(heads: int, hidden: int, layers: int, vocab: int, seq: int, dropout: float, dtype: str
            ) -> tuple[LayerShape, ...]:
    """The GPT's layers traced for one sample; blocks are alike, so two blocks stand for all."""
    spec = build_gpt(vocab_size=vocab, block_size=seq, n_layer=2, n_head=heads, n_embd=hidden, dropout=dropout)
    embedding, block, _, head = trace_layers(spec, seq, torch.float16 if dtype == "fp16" else torch.bfloat16)
    return (embedding, *([block] * layers), head)


def hf_family(row: PublishedRow) -> str | None:
    """The Hugging Face model type an MoE row's model is of (its config built from the row), or None."""
    name = json.loads(row.model).get("name", "")
    if name.startswith("Qwen3 MoE"):
        return "qwen3_moe"
    if name.startswith(("DeepSeek-V3", "Kimi K2")):
        return "deepseek_v3"
    if name.startswith("GPT-OSS"):
        return "gpt_oss"
    return None


def hf_config(row: PublishedRow, layers: int) -> dict[str, Any]:
    """An MoE row's model as a Hugging Face ``config.json`` of `layers` decoder layers."""
    m = json.loads(row.model)
    common = {"hidden_size": row.hidden, "num_hidden_layers": layers, "num_attention_heads": row.heads,
              "num_key_value_heads": row.kv_heads, "vocab_size": row.vocab, "num_experts_per_tok": m["experts_per_token"],
              "moe_intermediate_size": m["moe_ffn_hidden"], "max_position_embeddings": max(row.seq, 4096),
              "tie_word_embeddings": False}
    if hf_family(row) == "gpt_oss":  # its layers alternate: a 128-token sliding window, then full attention
        return {**common, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_local_experts": m["experts"], "head_dim": m["head_dim"], "intermediate_size": m["moe_ffn_hidden"],
                "sliding_window": SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}
    if hf_family(row) == "qwen3_moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_experts": m["experts"], "head_dim": m["head_dim"], "intermediate_size": m["moe_ffn_hidden"],
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    mla = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", m["attention"])}
    return {**common, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "n_routed_experts": m["experts"], "n_shared_experts": m.get("shared_experts", 0),
            "first_k_dense_replace": m.get("first_dense_layers", 0), "intermediate_size": row.ffn,
            "n_group": 1, "topk_group": 1, "q_lora_rank": mla["q_lora_rank"], "kv_lora_rank": mla["kv_lora_rank"],
            "qk_nope_head_dim": mla["qk_nope"], "qk_rope_head_dim": mla["qk_rope"], "v_head_dim": mla["v_head"],
            "num_nextn_predict_layers": 0}


SLIDING_WINDOW = 128  # gpt-oss's sliding-window layers (its config.json)
_MOE_SHAPES: dict[tuple[str, str], tuple[LayerShape, ...]] = {}


def moe_shapes(row: PublishedRow, dtype: str) -> tuple[LayerShape, ...]:
    """An MoE row's layers traced through ``model=hf`` on the meta device: its first dense layers
    and one MoE layer traced, the MoE layer standing for the rest (routing balanced; cached)."""
    if (row.model, dtype) not in _MOE_SHAPES:
        _MOE_SHAPES[(row.model, dtype)] = _traced_moe(row, dtype)
    return _MOE_SHAPES[(row.model, dtype)]


def _traced_moe(row: PublishedRow, dtype: str) -> tuple[LayerShape, ...]:
    import tempfile

    from pipeflow.models.hf import build_hf

    dense = json.loads(row.model).get("first_dense_layers", 0)
    traced_layers = 2 if hf_family(row) == "gpt_oss" else dense + 1  # gpt-oss: a sliding and a full layer
    with tempfile.TemporaryDirectory() as folder, _fused_sink_attention(), _fused_rms_norms():
        (Path(folder) / "config.json").write_text(json.dumps(hf_config(row, traced_layers)))
        embedding, *layers, head = trace_layers(build_hf(folder), row.seq,
                                                torch.float16 if dtype == "fp16" else torch.bfloat16)
    if hf_family(row) == "gpt_oss":
        return (embedding, *([windowed(layers[0], SLIDING_WINDOW, row.seq), layers[1]] * (row.layers // 2)), head)
    return (embedding, *layers[:-1], *([layers[-1]] * (row.layers - dense)), head)


@contextlib.contextmanager
def _fused_rms_norms() -> Iterator[None]:
    """transformers' RMSNorms traced as one kernel each (``F.rms_norm``: its input read, its output
    written), as the published MoE stacks run them (Transformer Engine's RMSNorm: AutoModel's
    ``BackendConfig(rms_norm="te")``, Megatron-Core's), not as the eager fp32 upcast, square,
    mean, rsqrt and two products, each through memory."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def fused(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, (hidden.shape[-1],), self.weight.to(hidden.dtype), self.variance_epsilon)

    with contextlib.ExitStack() as patched:
        for norm in (modeling_deepseek_v3.DeepseekV3RMSNorm, modeling_gpt_oss.GptOssRMSNorm,
                     modeling_qwen3_moe.Qwen3MoeRMSNorm):
            patched.enter_context(mock.patch.object(norm, "forward", fused))
        yield


@contextlib.contextmanager
def _fused_sink_attention() -> Iterator[None]:
    """gpt-oss's attention traced as the published stacks run it, one fused kernel (Transformer
    Engine's, FlexAttention), not as transformers' eager code (which materialises every T x T
    score and transformers will not run through SDPA): SDPA here, its sinks (one more score
    column per head) left out."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    def fused(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
              scaling: float, dropout: float = 0.0, **_: Any) -> tuple[torch.Tensor, None]:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    with mock.patch.object(modeling_gpt_oss, "eager_attention_forward", fused):
        yield


def windowed(shape: LayerShape, window: int, seq: int) -> LayerShape:
    """`shape` with its attention over a `window`-token band instead of the whole sequence: what
    the published stacks' windowed kernels compute (Transformer Engine's, FlexAttention); traced,
    the layer's eager attention multiplies whole T x T scores."""
    scale = min(1.0, window / seq)
    return dataclasses.replace(shape, attention_flops=shape.attention_flops * scale,
                               other_matmul_flops=shape.other_matmul_flops * scale,
                               attention_scores=shape.attention_scores * scale,
                               attention_keys=min(shape.attention_keys, window))


def with_loss(shapes: tuple[LayerShape, ...], stack: Stack) -> tuple[LayerShape, ...]:
    """`shapes` with the loss `stack` runs: its bytes per logit (:data:`LOSSES`, and its metrics'),
    and, vocab-parallel, the head's logits kept split over tp (no gather; the loss on each rank's share)."""
    forward, backward = LOSSES[stack.loss]
    forward += stack.metric_losses * METRIC_LOSS_BYTES

    def run(shape: LayerShape) -> LayerShape:
        if not shape.loss_elements:
            return shape
        linears = [dataclasses.replace(x, style="colwise") if stack.vocab_parallel and x.style == "colwise_out" else x
                   for x in shape.linears]
        return dataclasses.replace(shape, linears=linears, loss_split=stack.vocab_parallel,
                                   loss_bytes=(shape.loss_elements * forward, shape.loss_elements * backward))

    return tuple(run(shape) for shape in shapes)


def chunks(layers: int, pp: int) -> int:
    """v where unpublished: the smallest count above 1 dividing a rank's layers (1 at pp = 1)."""
    per = layers // pp
    if pp == 1 or per <= 1:
        return 1
    return next(v for v in range(2, per + 1) if per % v == 0)


@lru_cache(maxsize=None)
def cluster_of(gpu: str) -> Cluster:
    return load_hardware(PRESETS[gpu])


def megatron_ranges(layers: int, stages: int) -> list[range]:
    """Megatron's split: equal blocks per stage, the embedding with the first, the head with the last."""
    per = layers // stages
    bounds = [0] + [1 + per * s for s in range(1, stages)] + [layers + 2]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


# pipeflow's own stack: SDPA, dp after the pipeline; ZeRO-1 as the Megatron runs' distributed optimizer
PIPEFLOW = Stack("fused", overlap_dp=False, shard="optimizer", sequence_parallel=True)


def workload(row: PublishedRow, stack: Stack) -> Workload:
    """`row`'s model, sequence and batch on `stack`'s attention."""
    traced = (moe_shapes(row, row.dtype) if row.moe
              else shapes(row.heads, row.hidden, row.layers, row.vocab, row.seq, stack.dropout, row.dtype))
    own = stack == STACKS.get((row.source, row.generation))  # the row's gathers and reductions: its own stack's
    return Workload(with_loss(traced, stack), row.seq, row.batch, dtype=row.dtype, attention=stack.attention,
                    tp_overlap=stack.tp_overlap,
                    param_bytes=weight_bytes(row.gather_dtype) if own and row.gather_dtype else 0,
                    grad_bytes=weight_bytes(row.reduce_dtype) if own and row.reduce_dtype else 0)


def predict_published(row: PublishedRow, eff: Efficiency = Efficiency(), stack: Stack | None = None) -> Prediction:
    """The planner's prediction of `row` on its published layout and its source's software (or `stack`)."""
    stack = stack or STACKS[(row.source, row.generation)]
    tp, pp = row.tp or 1, row.pp or 1
    v = row.vp or chunks(row.layers, pp)
    dp = row.gpus // (tp * pp)
    layout = Layout(tp, pp, dp, "interleaved_1f1b" if v > 1 else "1f1b", v, row.micro,
                    recompute=row.recompute == "full", sequence_parallel=stack.sequence_parallel and tp > 1,
                    split_boundary=tp > 1, shard=stack.shard if dp > 1 else "none", order=MEGATRON_ORDER,
                    overlap_dp=stack.overlap_dp, ep=row.ep, dp_every_microbatch=stack.dp_every_microbatch)
    # Megatron's split where the layers divide evenly; else balanced (AutoModel's uneven stages)
    ranges = megatron_ranges(row.layers, pp * v) if pp > 1 and row.layers % (pp * v) == 0 else None
    work = workload(row, stack)
    flushes = row.batch // (dp * row.local_batch) if stack.flush_per_local_batch and pp > 1 and row.local_batch else 1
    if flushes == 1:
        return predict(work, layout, cluster_of(row.gpu), eff, ranges=ranges)
    one = predict(dataclasses.replace(work, global_batch=row.batch // flushes), layout, cluster_of(row.gpu), eff,
                  ranges=ranges)  # one local batch's pipeline, then the step's reduction and update once
    step = flushes * one.pipeline_s + one.dp_s + one.optimizer_s
    return dataclasses.replace(one, num_microbatches=flushes * one.num_microbatches, step_s=step,
                               pipeline_s=flushes * one.pipeline_s, tokens_per_s=row.batch * row.seq / step,
                               model_tflops_per_gpu=one.model_tflops_per_gpu * one.step_s / step,
                               mfu=one.mfu * one.step_s / step)


def ratio(row: PublishedRow, eff: Efficiency = Efficiency()) -> float:
    """Predicted over published tokens per second per GPU."""
    pred = predict_published(row, eff)
    return pred.tokens_per_s / row.gpus / published_tokens(row)  # type: ignore[operator]
