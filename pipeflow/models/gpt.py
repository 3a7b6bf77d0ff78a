"""A GPT-style decoder (nanoGPT-like) written as an ordered list of layers for pipelining.

Layers: ``embedding`` (token + learned position), ``block.0`` .. ``block.{n_layer-1}`` (pre-LN
causal self-attention and MLP, each residual), ``head`` (final LayerNorm + Linear to the vocab).
With ``model.moe.experts > 0`` the MLP of every ``model.moe.every``-th block is a mixture of
experts (:mod:`pipeflow.models.moe`).
Shapes: B = batch, T = time (sequence), C = n_embd, V = vocab_size, H = n_head.

Attention is ``F.scaled_dot_product_attention`` (flash or memory-efficient kernels on CUDA), see
:func:`attend`.

Packed documents: the input may be ``(idx, doc)`` with ``doc`` (B, T) long, the document id of
every position (several documents packed into one sequence; a document is a run of equal ids).
Each layer then passes ``doc`` on beside its activations, attention is block-diagonal causal (a
position attends to the earlier positions of its own document only) and positions count from
each document's start.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from pipeflow.errors import ConfigError
from pipeflow.models.lora import LoraConfig, check_targets, layer_modules, lora_settings
from pipeflow.models.materialise import layers_from
from pipeflow.models.moe import MoE, MoEConfig, moe_config
from pipeflow.models.spec import LayerSpec, ModelSpec

INIT_STD = 0.02  # GPT-2 init: weights ~ N(0, 0.02), biases 0

_NOT_IMPORTED = object()
# flash attention over variable-length sequences (CUDA only; older torch: None, the mask instead),
# imported at its first use on a GPU (:func:`_varlen`): the module imports Dynamo, about a second
# of every process that merely builds a GPT
varlen_attn: Any = _NOT_IMPORTED


def _varlen() -> Any:
    """torch's ``varlen_attn`` (None where this torch has none), imported once, on first use."""
    global varlen_attn
    if varlen_attn is _NOT_IMPORTED:
        try:
            from torch.nn.attention.varlen import varlen_attn as found
        except ImportError:  # pragma: no cover
            found = None
        varlen_attn = found
    return varlen_attn


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters shared by every GPT layer (their defaults are `build_gpt`'s)."""

    vocab_size: int
    block_size: int  # the longest sequence T the position embedding covers
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    bias: bool


def _init_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2 init: N(0, 0.02) Linear/Embedding weights, zero biases, scaled residual projections."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            std = INIT_STD
            if name.endswith("c_proj"):
                # Residual projections are scaled by 1/sqrt(2 * n_layer) (GPT-2 paper), so the
                # residual stream's variance does not grow with depth.
                std = INIT_STD / math.sqrt(2 * n_layer)
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)


class Embedding(nn.Module):
    """Token + learned position embedding: idx (B, T) long -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.context_parallel: Any = None  # parallel.cp: this rank's tokens' global positions (runtime.ring_attention)
        _init_weights(self, cfg.n_layer)

    def forward(self, idx: Tensor, doc: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Embed tokens (B, T) into activations (B, T, C); with document ids ``doc`` (B, T),
        positions restart at each document and ``(activations, doc)`` is returned."""
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        if doc is None:
            cp = self.context_parallel
            pos = torch.arange(T, device=idx.device) if cp is None else cp.positions(T, idx.device)  # (T,)
            return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        positions = document_positions(doc)  # (B, T): with parallel.cp the whole rows' (doc is whole)
        if self.context_parallel is not None:
            positions = positions[:, self.context_parallel.positions(T, idx.device)]
        return self.drop(self.wte(idx) + self.wpe(positions)), doc  # (B, T, C), (B, T)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through :func:`attend` (SDPA: flash or memory-efficient
    kernels on CUDA, exact in float64 on the CPU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout  # of the attention weights, inside SDPA (training only) ...
        self.attn_drop = nn.Dropout(cfg.dropout)  # ... or through this module when it is keyed (train.dropout_rng)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.context_parallel: Any = None  # parallel.cp: attention round the cp ring (runtime.ring_attention)

    def forward(self, x: Tensor, doc: Tensor | None = None) -> Tensor:
        """Attend over the past (of the same document, with ``doc``): (B, T, C) -> (B, T, C).

        Under tensor parallelism c_attn yields this rank's heads only (and, with sequence
        parallelism, the whole sequence from a slice of it), so heads and T are read off its output.
        """
        hs = x.size(-1) // self.n_head  # head size
        qkv = self.c_attn(x)  # (B, T, 3 C) (this rank's 3 C / tp)
        B, T, width = qkv.shape
        q, k, v = qkv.split(width // 3, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, H, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, H, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, H, T, hs)
        if self.context_parallel is not None:  # this rank's chunks of the sequence; keys and values go round
            numbers = None if doc is None else document_numbers(doc)  # the whole rows' documents
            y = self.context_parallel.attend(q, k, v, documents=numbers)
        elif self.training and self.dropout > 0.0 and getattr(self.attn_drop, "keyed", False):
            y = self._attend_keyed(q, k, v, doc)  # (B, H, T, hs)
        else:
            y = attend(q, k, v, doc, self.dropout if self.training else 0.0)  # (B, H, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, width // 3)  # heads side by side again
        return self.resid_drop(self.c_proj(y))


    def _attend_keyed(self, q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None) -> Tensor:
        """:func:`attend` with its weights computed here and dropped through ``attn_drop`` (keyed
        by sample and head: under tensor parallelism this rank's heads are numbered as the
        whole model's, from the rank's coordinate on c_attn's mesh)."""
        heads = q.size(1)
        mesh = getattr(self.c_attn.weight, "device_mesh", None)
        first = 0 if heads == self.n_head or mesh is None else mesh.get_local_rank() * heads
        T = q.size(2)
        allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if doc is None else document_mask(doc)[:, None]
        scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5  # (B, H, T, T)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return self.attn_drop(weights, heads=(1, first, self.n_head)) @ v


class MLP(nn.Module):
    """Position-wise feed-forward: (B, T, C) -> (B, T, 4C) -> GELU -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to every position: (B, T, C) -> (B, T, C)."""
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)); (B, T, C) -> (B, T, C).
    With `moe`, the MLP is a mixture of experts (:class:`~pipeflow.models.moe.MoE`)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg) if moe is None else MoE(cfg.n_embd, moe, cfg.bias, cfg.dropout)
        _init_weights(self, cfg.n_layer)

    def forward(self, x: Tensor, doc: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run attention then the MLP, each on the residual stream (``doc`` passed on beside it)."""
        x = x + self.attn(self.ln_1(x), doc)
        x = x + self.mlp(self.ln_2(x))
        return x if doc is None else (x, doc)


class Head(nn.Module):
    """Final LayerNorm and projection to the vocabulary: (B, T, C) -> logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        _init_weights(self, cfg.n_layer)

    def forward(self, x: Tensor, doc: Tensor | None = None) -> Tensor:
        """Turn activations (B, T, C) into logits (B, T, V) (document ids are not needed here)."""
        return self.lm_head(self.ln_f(x))


def document_positions(doc: Tensor) -> Tensor:
    """Each position's index within its document: doc (B, T) ids -> (B, T) long, 0 where a document starts."""
    T = doc.size(1)
    t = torch.arange(T, device=doc.device).expand_as(doc)  # (B, T)
    return t - torch.where(document_starts(doc), t, torch.zeros_like(t)).cummax(dim=1).values


def document_starts(doc: Tensor) -> Tensor:
    """Where a document starts: doc (B, T) ids -> (B, T) bool, True at t = 0 and where the id changes.

    A document is a run of equal ids within a row (an id seen again later in the row starts
    another document).
    """
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return starts


def document_numbers(doc: Tensor) -> Tensor:
    """Each position's document, numbered from 1 within its row: doc (B, T) ids -> (B, T) long
    (two positions attend to each other only when their numbers are equal)."""
    return document_starts(doc).cumsum(dim=1)


def attend(q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention: q, k, v (B, H, T, hs) -> (B, H, T, hs); with ``doc`` (B, T), within each
    document only (a position attends to the earlier positions of its own document).

    Which kernel runs (docs/explanation/performance.md): without documents, SDPA with ``is_causal`` (flash or
    memory-efficient on CUDA, no mask); with documents where flash's variable-length kernel
    applies (:func:`varlen_applies`), ``varlen_attn`` over the documents as sequences, O(T)
    memory; elsewhere SDPA with a boolean block-diagonal causal mask, (B, 1, T, T).
    `dropout_p` drops attention weights (pass 0 outside training).
    """
    if doc is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if varlen_applies(q, dropout_p):
        return _varlen_attention(q, k, v, doc)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc)[:, None], dropout_p=dropout_p)


def document_mask(doc: Tensor) -> Tensor:
    """Who may attend to whom: doc (B, T) ids -> (B, T, T) bool, [b, t, s] True where s <= t in
    the same document (O(T^2) memory: the fallback of :func:`attend`)."""
    run = document_numbers(doc)  # (B, T): the document's number within its row
    T = doc.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()  # (T, T), s <= t
    return causal & (run[:, :, None] == run[:, None, :])  # (B, T, T)


def varlen_applies(q: Tensor, dropout_p: float) -> bool:
    """True where :func:`attend` runs packed documents through ``varlen_attn``: it is in this torch,
    q is on an NVIDIA GPU of compute capability >= 8.0 (flash attention 2) in float16 or bfloat16
    (autocast), the head size is a multiple of 8 up to 256, and no dropout (the kernel has none)."""
    return (q.is_cuda and torch.version.hip is None and dropout_p == 0.0
            and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) % 8 == 0 and q.size(-1) <= 256
            and _flash_capable(q.device) and _varlen() is not None)


@functools.lru_cache(maxsize=None)
def _flash_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _varlen_attention(q: Tensor, k: Tensor, v: Tensor, doc: Tensor) -> Tensor:
    """:func:`attend` over packed documents with ``varlen_attn``: the B x T tokens laid end to end,
    each document one sequence, causal within it; (B, H, T, hs) -> (B, H, T, hs)."""
    B, H, T, hs = q.shape

    def tokens(t: Tensor) -> Tensor:  # (B, H, T, hs) -> (B * T, H, hs), a view of c_attn's output
        return t.transpose(1, 2).reshape(B * T, H, hs)

    cu = _cu_seqlens(doc)
    # T bounds every document's length: the longest is not read back (no host sync for it)
    y = _varlen()(tokens(q), tokens(k), tokens(v), cu, cu, T, T, window_size=(-1, 0))  # (-1, 0): causal
    return y.view(B, T, H, hs).transpose(1, 2)


_CU_SEQLENS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # doc -> (its version, its cu_seqlens)


def _cu_seqlens(doc: Tensor) -> Tensor:
    """Where each document starts among the B x T tokens, then B x T: (N + 1,) int32.

    Counting the documents reads the device back once (``nonzero``); the blocks of a stage
    share one ``doc`` tensor, so it is done once per micro-batch and stage, not per block.
    """
    version = None if doc.is_inference() else doc._version  # refilled in place: counted again
    cached = _CU_SEQLENS.get(doc)
    if cached is not None and version is not None and cached[0] == version:
        return cached[1]
    starts = document_starts(doc).flatten().nonzero().flatten()  # (N,)
    cu = torch.cat([starts, starts.new_full((1,), doc.numel())]).to(torch.int32)
    if version is not None:
        _CU_SEQLENS[doc] = (version, cu)
    return cu


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy over all tokens, mean: logits (B, T, V), targets (B, T) long -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _check_config(cfg: GPTConfig) -> None:
    """Raise ConfigError naming the bad GPT hyper-parameter."""
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 1")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(
            f"model.n_embd={cfg.n_embd} must be divisible by model.n_head={cfg.n_head}"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.dropout={cfg.dropout} must be in [0, 1)")


def build_gpt(
    vocab_size: int = 64,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 64,
    dropout: float = 0.0,
    bias: bool = True,
    seed: int = 0,
    tie_embeddings: bool = False,
    init_from: str | None = None,
    moe: MoEConfig = MoEConfig(),
    lora: LoraConfig = LoraConfig(targets=["c_attn", "c_proj"]),
) -> ModelSpec:
    """Describe a GPT decoder as n_layer + 2 lazy layers: embedding, block.0.., head.

    Args:
        vocab_size: number of token ids V.
        block_size: longest sequence T.
        n_layer: number of transformer blocks.
        n_head: attention heads per block (must divide n_embd).
        n_embd: model width C.
        dropout: dropout probability (0 for exact reproducibility).
        bias: whether Linear and LayerNorm layers have biases.
        seed: the model seed every layer's init derives from.
        tie_embeddings: share the token embedding with the output head (GPT-2 style); the two
            copies live on different stages and their gradients are summed every step.
        init_from: a file or DCP directory of the layers' weights under ``<layer index>.<key>``
            (what ``export`` writes), loaded instead of the seeded init; each rank reads its own.
        moe: ``model.moe``: mixture-of-experts blocks (:class:`~pipeflow.models.moe.MoEConfig`;
            ``experts=0``, the default, keeps every block dense).
        lora: ``model.lora`` (:mod:`pipeflow.models.lora`): peft's LoRA in the blocks' Linear
            modules the targets name (``c_attn``, ``c_proj``, ``c_fc``), the rest frozen.

    Returns:
        A ModelSpec whose loss is the mean token cross entropy.

    Raises:
        ConfigError: a hyper-parameter is invalid.
    """
    cfg = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
    _check_config(cfg)
    moe = moe_config(moe)
    layers = [LayerSpec("embedding", Embedding, (cfg,))]
    layers += [LayerSpec(f"block.{k}", Block, (cfg, moe) if moe.is_moe(k) else (cfg,)) for k in range(n_layer)]
    layers.append(LayerSpec("head", Head, (cfg,)))
    tied = {"wte": [("embedding", "wte.weight"), ("head", "lm_head.weight")]} if tie_embeddings else {}
    spec = ModelSpec(name="gpt", layers=layers_from(layers, init_from), loss_fn=gpt_loss, seed=seed, tied=tied,
                     tp_plan=functools.partial(gpt_tp_plan, cfg), lora=lora_settings(lora))
    if spec.lora is not None:  # every layer's module names, on meta
        spec.lora = check_targets(spec.lora, layer_modules(spec), {"lm_head": "the output head"})
    return spec


GPT_BLOCK_PLAN = {"ln_1": "norm", "attn.c_attn": "colwise_qkv", "attn.c_proj": "rowwise", "attn.resid_drop": "norm",
                  "ln_2": "norm", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise", "mlp.drop": "norm"}


def gpt_tp_plan(cfg: GPTConfig, index: int, layer: nn.Module, tp: int) -> dict[str, str]:
    """The GPT's tensor-parallel plan (Megatron's): attention heads and the MLP split column then
    row; the vocabulary of the embedding and the head split; with sequence parallelism the norms,
    dropouts and the activations between layers split along the sequence.

    Raises:
        ConfigError: n_head, 4 x n_embd or vocab_size not divisible by tp.
    """
    for key, value in (("n_head", cfg.n_head), ("vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.{key}={value}: each tp rank holds "
                              f"{key}/tp of it; choose a tp that divides {value}")
    if isinstance(layer, Block) and isinstance(layer.mlp, MoE):
        raise ConfigError(f"parallel.tp={tp} with model.moe.experts={layer.mlp.cfg.experts}: experts are not split "
                          f"by tensor parallelism; use parallel.tp=1 (pp x dp) for a mixture-of-experts GPT")
    if isinstance(layer, Embedding):
        return {"wte": "embedding", "": "sequence_out"}
    if isinstance(layer, Head):
        return {"ln_f": "norm", "lm_head": "colwise_out"}
    return dict(GPT_BLOCK_PLAN)
