"""Hugging Face decoders (``*ForCausalLM`` of the Llama family) as pipeline layers: ``model=hf``.

``build_hf(path=<folder with config.json [and *.safetensors]>)`` builds the model that
``transformers`` defines for that config on the meta device and cuts it into layers that keep
the model's own attribute paths (so a layer's state dict keys are the Hugging Face names):

- ``embedding``: ``model.embed_tokens``; takes ``input_ids`` (B, T) and returns ``(hidden (B, T,
  C), position_ids (B, T) long)``; or takes ``(input_ids, doc)`` (packed documents) and returns
  ``(hidden, position_ids, doc)``, positions restarting at each document, which Hugging Face's
  mask utilities read as packed sequences (block-diagonal causal attention).
- ``layer.<i>``: ``model.layers.<i>``, the model's own decoder layer called by keyword as its
  ``forward`` expects (``attention_mask``, ``position_ids``, ``position_embeddings``); returns
  what it was given with the hidden states replaced.
- ``head``: ``model.norm`` and ``lm_head``; returns logits (B, T, V).

Only ``position_ids`` (and ``doc``) travel beside the activations. Each stage recomputes the rotary
``(cos, sin)`` and the causal (or sliding-window) mask from them (once, shared by its layers,
without documents; per layer with them) with the model's own
``rotary_emb`` class and ``masking_utils`` functions, exactly as the model's forward computes them
once: the same functions of the same inputs give the same values on every stage, bit for bit.
That is cheaper than sending them: position ids are B*T integers, a materialised mask is B*T*T
(sliding windows, packed documents) and (cos, sin) 2*B*T*head_dim floats per micro-batch and stage
boundary, while recomputing costs O(B*T*head_dim + B*T*T) elementwise work per stage (or layer), far below
one layer's attention, O(B*H*T*T*head_dim).

Weights: each layer reads only its own tensors from the safetensors files in ``path``
(``safe_open``), or from ``init_from`` (a state dict under the Hugging Face names); without
either, layer i is initialised by the model's own ``_init_weights`` under the layer's seed.
The folder is checked first, on every rank (:mod:`pipeflow.models.hf_folder`: config.json, the
files' headers against every tensor of the model); each loaded tensor is checked to be finite.
``transformers`` and ``safetensors`` are imported only when the builder runs.

Tensor parallelism (``parallel.tp``): :func:`hf_tp_plan` splits the layers by the config's own
``base_model_tp_plan`` (attention heads and the MLP column then row), the embedding's and the
head's vocabulary alike (so a tied pair stays tied shard for shard). With
``parallel.sequence_parallel`` the norms run on this rank's slice of the sequence and are gathered
whole before the projections after them.
"""
from __future__ import annotations

import copy
import fnmatch
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import document_numbers, document_positions
from pipeflow.models.hf_attention import CONTEXT_PARALLEL, ring_attention_of
from pipeflow.models.hf_convert import checkpoint_sources
from pipeflow.models.hf_folder import SafetensorsWeights, load_config
from pipeflow.models.hf_forms import family, tested_forms
from pipeflow.models.hf_experts import narrow_experts
from pipeflow.models.hf_routing import routed_experts, watch_routers
from pipeflow.models.lora import LoraConfig, check_targets, lora_settings
from pipeflow.models.materialise import StateDictFile, skeleton, zero_parameters
from pipeflow.models.module_spec import cross_entropy
from pipeflow.models.pieces import Piece, cut
from pipeflow.models.spec import LayerSpec, ModelSpec

log = logging.getLogger("pipeflow")

_DECODER_KWARGS = ("attention_mask", "position_ids", "position_embeddings")
ROUTERS = "_pipeflow_routers"  # a decoder piece's RouterFigures (pipeflow.models.hf_routing)
_TIE = "model.embed_tokens.weight"
# Hugging Face's tensor-parallel style names (base_model_tp_plan values) -> pipeflow's (TP_STYLES)
HF_TP_STYLES = {"colwise": "colwise_whole", "rowwise": "rowwise"}  # a decoder's norms gather their output
_TP_DIVIDES = ("num_attention_heads", "num_key_value_heads", "vocab_size")  # each tp rank holds 1/tp of these


@dataclass
class HFMoEConfig:
    """``model.moe`` for ``model=hf``: what pipeflow adds to a mixture-of-experts family's training
    (the experts, routers and their losses are the family's config's)."""

    bias_update_rate: float = 0.001  # DeepSeek-V3's aux-loss-free balancing: the per-step bias step (0: none)


def _moe_config(value: Any) -> HFMoEConfig:
    """``model.moe`` (a dataclass, a mapping or Hydra's node) as an :class:`HFMoEConfig`, checked.

    Raises:
        ConfigError: an unknown key, or a negative rate.
    """
    items = dict(vars(value)) if isinstance(value, HFMoEConfig) else dict(value or {})
    unknown = sorted(set(map(str, items)) - {"bias_update_rate"})
    if unknown:
        raise ConfigError(f"model.moe has no key(s) {unknown} with model=hf; it takes bias_update_rate (the experts "
                          f"and routers are the Hugging Face config's)")
    config = HFMoEConfig(**items)
    if not config.bias_update_rate >= 0:
        raise ConfigError(f"model.moe.bias_update_rate={config.bias_update_rate} must be >= 0 (0: no bias updates)")
    return config


def _embed(piece: Piece, input_ids: Tensor, doc: Tensor | None = None) -> tuple[Tensor, ...]:
    """Token ids (B, T) -> (hidden (B, T, C), position ids (B, T)); with document ids ``doc`` (B, T)
    the positions restart at each document and ``doc`` is passed on (it says "packed")."""
    hidden = piece.model.embed_tokens(input_ids)  # type: ignore[operator]
    B, T = input_ids.shape
    cp = getattr(piece, CONTEXT_PARALLEL, None)  # parallel.cp: the global positions of this rank's chunks
    mine = None if cp is None else cp.positions(T, input_ids.device)
    if doc is None:
        positions = torch.arange(T, device=input_ids.device) if mine is None else mine
        return hidden, positions.expand(B, T).contiguous()
    positions = document_positions(doc)  # with parallel.cp doc is the whole rows'
    return hidden, (positions if mine is None else positions[:, mine].contiguous()), doc


def head_logits(piece: nn.Module, hidden: Tensor, softcap: float | None = None) -> Tensor:
    """Final norm and output head: hidden (B, T, C) -> logits (B, T, V); with `softcap` (Gemma's
    ``final_logit_softcapping``) the logits squashed into (-softcap, softcap) as the model does."""
    logits = piece.lm_head(piece.model.norm(hidden))  # type: ignore[operator]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _head(piece: Piece, hidden: Tensor, *_: Tensor, softcap: float | None = None) -> Tensor:
    """The head piece's forward (:func:`head_logits`); the position and document ids end here."""
    return head_logits(piece, hidden, softcap)


_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # position ids -> (their key, {what: value})


class _Decoder:
    """Decoder layer `index`'s adapter: rotary and mask recomputed from the position ids, then the
    model's own layer called by keyword.

    Without documents the layers of one stage receive the same position-ids tensor, ``arange(T)``
    in every row, so the mask and (cos, sin) are made once per stage and micro-batch (cached by
    that tensor and its shape, as the model makes them once per forward) and shared by its layers,
    as the model's layers share them; the mask is made without the position ids, since Hugging
    Face's packed-sequence detection would read them back to the host (a device sync) only to find
    one sequence per row. With documents the positions vary and arrive in pooled receive buffers
    refilled in place, so each layer makes its own (exact; the detection syncs once per layer).
    """

    def __init__(self, config: Any, index: int, sliding: bool, rope_type: str | None = None) -> None:
        self.config, self.index, self.sliding = config, index, sliding
        self.rope_type = rope_type  # Gemma 3: the rotary embedding of this layer's type (local or global)

    def __call__(self, piece: Piece, hidden: Tensor, position_ids: Tensor,
                 doc: Tensor | None = None) -> tuple[Tensor, ...]:
        whole = hidden  # with sequence parallelism `hidden` is a slice: mask and rotary are the sequence's
        if hidden.shape[1] != position_ids.shape[1]:
            whole = hidden.new_empty((hidden.shape[0], position_ids.shape[1], *hidden.shape[2:]))
        layer = piece.model.layers.get_submodule(str(self.index))  # type: ignore[union-attr]
        ring = ring_attention_of(layer)
        mask, cos_sin = self._shared(piece, whole, position_ids, doc is not None, masked=not ring)
        if hidden.dtype == torch.float64:
            loop_experts(layer)
        extra = {} if not ring or doc is None else {"cp_documents": document_numbers(doc)}
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin, **extra)
        out = out[0] if isinstance(out, tuple) else out
        for router in getattr(piece, ROUTERS, ()):  # an MoE layer's auxiliary loss, for backward
            out = router.attach(out)
        return (out, position_ids) if doc is None else (out, position_ids, doc)

    def _shared(self, piece: Piece, hidden: Tensor, position_ids: Tensor, packed: bool,
                masked: bool = True) -> tuple[Any, Any]:
        from transformers import masking_utils

        key = (hidden.dtype, hidden.device, tuple(hidden.shape[:2]), torch.is_autocast_enabled(), id(self.config))
        entry = _SHARED.get(position_ids)
        if entry is None or entry[0] != key or packed:
            entry = (key, {})
            if not packed:  # the positions are arange(T) in every row: the shape says all
                _SHARED[position_ids] = entry
        made = entry[1]
        if not masked:  # ring attention (parallel.cp) masks by the global positions itself
            made.setdefault(self.sliding, None)
        if self.sliding not in made:
            make = masking_utils.create_sliding_window_causal_mask if self.sliding else masking_utils.create_causal_mask
            made[self.sliding] = make(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                      position_ids=position_ids if packed else None)
        rope = ("rope", self.rope_type)
        if rope not in made:
            made[rope] = (piece.rotary_emb(hidden, position_ids) if self.rope_type is None  # type: ignore[operator]
                          else piece.rotary_emb(hidden, position_ids, self.rope_type))  # type: ignore[operator]
        return made[self.sliding], made[rope]


def rope_types(config: Any, rotary: nn.Module) -> list[str] | None:
    """Each decoder layer's type, where the model's rotary embedding takes one (Gemma 3: local and
    global layers rotate differently); None where one rotary embedding serves every layer."""
    by_type = "layer_type" in inspect.signature(type(rotary).forward).parameters
    return list(config.layer_types) if by_type else None


def loop_experts(layer: nn.Module) -> None:
    """Have the layer's experts run one expert at a time (transformers' ``eager``): torch's
    ``grouped_mm``, which transformers picks where it can, takes no float64."""
    for module in layer.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"  # type: ignore[union-attr]


def sliding_layer(config: Any, index: int) -> bool:
    """Whether decoder layer `index` attends over a sliding window (as the model's forward decides:
    every layer once ``sliding_window`` is set in Mistral's form, Phi-3's among them; else by
    ``layer_types``)."""
    if family(config).window_mask:
        return getattr(config, "sliding_window", None) is not None
    layer_types = getattr(config, "layer_types", None)
    return bool(layer_types) and layer_types[index] == "sliding_attention"


class _Layers:
    """Builds layer k: cut it from the meta skeleton, give it real tensors (loaded or initialised)."""

    def __init__(self, root: nn.Module, plans: list[tuple[str, list[str], Any]],
                 load: Callable[..., None] | None, moe: HFMoEConfig, reads_rows: bool = False) -> None:
        self.root, self.plans, self.load = root, plans, load  # load(piece, layer name[, rows]): its tensors from disk
        self.moe, self.reads_rows = moe, reads_rows  # reads_rows: load reads rows of a tensor (an ep rank's experts)

    def build(self, k: int) -> nn.Module:
        name, paths, adapter = self.plans[k]
        piece = cut(self.root, paths, adapter)
        if torch.get_default_device().type == "meta":  # counting parameters: keep it on meta
            return piece
        rows = narrow_experts(piece) if self.reads_rows else {}  # under parallel.ep: only this rank's experts
        zero_parameters(piece, torch.device("cpu"))
        if self.load is not None:
            self.load(piece, name, rows=rows) if rows else self.load(piece, name)
        else:
            with torch.no_grad():
                for sub in piece.modules():
                    self.root._init_weights(sub)  # type: ignore[operator]
        _fill_transient_buffers(self.root, piece)
        if isinstance(adapter, _Decoder):  # real inv_freq buffers (non-persistent: not in the state dict)
            rotary = type(self.root.model.rotary_emb)  # type: ignore[union-attr]
            piece.add_module("rotary_emb", rotary(config=self.root.config))
            object.__setattr__(piece, ROUTERS, watch_routers(self.root, piece, self.moe.bias_update_rate))
            for module in piece.modules():  # parallel.cp's hook: the attention round the ring
                if hasattr(module, "q_proj") or type(module).__name__.endswith("Attention"):
                    setattr(module, CONTEXT_PARALLEL, None)
        elif adapter is _embed:  # parallel.cp's hook: the global positions of this rank's chunks
            setattr(piece, CONTEXT_PARALLEL, None)
        return piece


def _fill_transient_buffers(root: nn.Module, piece: nn.Module) -> None:
    """Give the piece's non-persistent buffers (in no checkpoint: Gemma's embedding scale) the values
    the model's own ``_init_weights`` gives them, on a twin, so no loaded parameter is touched;
    rotary embeddings are made whole apart."""
    for module in piece.modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names or "RotaryEmbedding" in type(module).__name__:
            continue
        twin = copy.copy(module)
        twin._parameters = {k: None if p is None else nn.Parameter(torch.empty_like(p), p.requires_grad)
                            for k, p in module._parameters.items()}
        twin._buffers = dict(module._buffers)
        with torch.no_grad():
            twin._buffers.update({n: module._buffers[n].clone() for n in names})
            root._init_weights(twin)  # type: ignore[operator]
        for n in names:
            module._buffers[n] = twin._buffers[n]


def _weights(root: nn.Module, path: str, tied: bool, init_from: str | None) -> Callable[[nn.Module, str], None] | None:
    """How a layer's tensors are loaded: from `init_from` (a state dict under the Hugging Face
    names), else from the folder's safetensors files, whose headers are checked against every
    tensor of the model here (so on every rank, before any collective); None: nothing to load.

    Raises:
        CheckpointError: a safetensors file or index that cannot be read.
        ConfigError: a tensor of the model in no file, or with another shape there.
    """
    if init_from:
        return StateDictFile(init_from, "the model's state dict under its Hugging Face names").load_into
    weights = SafetensorsWeights(path, functools.partial(checkpoint_sources, root))
    if not weights.files:
        return None
    aliases = {"lm_head.weight": _TIE} if tied else {}
    if torch.get_default_device().type != "meta":  # on meta (export, counting) nothing is loaded
        weights.check({key: list(t.shape) for key, t in root.state_dict(keep_vars=True).items()}, aliases)
    return functools.partial(weights.load_into, aliases=aliases)


def _check_trainable_as_stored(config: Any, path: str | None) -> None:
    """Refuse quantized weights by name (FP8 with ``weight_scale_inv``, MXFP4: copied into the
    model's dtype they would be wrong, not merely less precise); say that multi-token-prediction
    layers (DeepSeek-V3's ``num_nextn_predict_layers``), which the model transformers builds lacks,
    are skipped.

    Raises:
        ConfigError: the config has a ``quantization_config``.
    """
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else type(quantization).__name__
        raise ConfigError(f"model.path={path!r} holds quantized weights (quantization_config: {method}); model=hf "
                          f"trains unquantized weights only: dequantize the folder first (load it with "
                          f"transformers and save_pretrained it in bf16 or fp32)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(f"model.path={path!r}: its config sets use_bidirectional_attention (an encoder's "
                          f"attention); model=hf trains causal decoders: set it false or use another model")
    mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
    if mtp:
        log.warning("model.path=%r: its %d multi-token-prediction layer(s) (num_nextn_predict_layers) are not part "
                    "of the model transformers builds; they are skipped (neither loaded nor trained)", path, mtp)


def build_hf(path: str | None = None, seed: int = 0, init_from: str | None = None,
             lora: LoraConfig = LoraConfig(), moe: HFMoEConfig = HFMoEConfig()) -> ModelSpec:
    """A Hugging Face ``*ForCausalLM`` (a tested family, or one of their form:
    :mod:`pipeflow.models.hf_forms`) as pipeline layers.

    Args:
        path: a local folder with the model's config.json, and its ``*.safetensors`` to load
            (without them the weights are initialised from the config, seeded).
        seed: layer i is initialised under a RNG seeded from (seed, i) when nothing is loaded.
        init_from: a state dict file or DCP directory under the Hugging Face names (what
            ``export`` writes), loaded instead of the folder's safetensors files.
        lora: ``model.lora`` (rank, alpha, dropout, targets; :mod:`pipeflow.models.lora`): peft's
            LoRA layers in each decoder layer's targeted Linear modules, the base frozen; None
            or rank 0: none.
        moe: ``model.moe`` of a mixture-of-experts family (:class:`HFMoEConfig`).

    Returns:
        A ModelSpec of ``num_hidden_layers + 2`` layers (embedding, decoder layers, head) whose
        state dict keys are the model's own names; the head is tied to the token embedding when
        the config says ``tie_word_embeddings``. ``export_name`` maps (layer index, key) to the
        Hugging Face name and ``save_config(dir)`` writes config.json.

    Raises:
        ConfigError: no path, a path that is no folder with config.json, a config.json that is not
            a JSON object or contradicts itself, an unsupported architecture, a decoder layer whose
            forward does not take the keywords pipeflow passes, or a tensor of the model missing
            from the safetensors files or of another shape there.
        LoraError: ``model.lora`` targets that match no Linear, or the embedding or the head.
        CheckpointError: a damaged safetensors file (or index); (when a layer is built) NaN or
            Inf in a loaded tensor.
    """
    config = load_config(path)
    kind = family(config, path)
    _check_trainable_as_stored(config, path)
    if not kind.tested:
        log.info("model.path=%r: %s, not a tested family, is cut as %s's model and %s's head, whose forwards it "
                 "shares (docs/reference/hf-families.md)", path, kind.cls.__name__, *tested_forms(kind.model_type))
    root = skeleton(lambda: kind.cls(config))
    decoder = type(root.model.layers[0]) if len(root.model.layers) else None
    if decoder is not None:
        accepted = inspect.signature(decoder.forward).parameters
        missing = [k for k in _DECODER_KWARGS if k not in accepted]
        if missing:
            raise ConfigError(f"{decoder.__name__}.forward takes no {missing}: an incompatible decoder layer "
                              f"signature for model=hf (transformers {__import__('transformers').__version__})")
    n = config.num_hidden_layers
    plans: list[tuple[str, list[str], Any]] = [("embedding", ["model.embed_tokens"], _embed)]
    ropes = rope_types(config, root.model.rotary_emb)
    plans += [(f"layer.{i}", [f"model.layers.{i}"],
               _Decoder(config, i, sliding_layer(config, i), ropes[i] if ropes else None))
              for i in range(n)]
    plans.append(("head", ["model.norm", "lm_head"],
                  functools.partial(_head, softcap=getattr(config, "final_logit_softcapping", None))))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    settings = lora_settings(lora)
    if settings is not None:  # on the meta skeleton, before any layer is built
        settings = check_targets(settings, root.named_modules(), {"lm_head": "the output head"})
    load = _weights(root, path, tied, init_from)
    layers = _Layers(root, plans, load, _moe_config(moe), reads_rows=load is not None and not init_from)
    specs = [LayerSpec(name, layers.build, (k,)) for k, (name, _, _) in enumerate(plans)]
    ties = {_TIE: [("embedding", _TIE), ("head", "lm_head.weight")]} if tied else {}
    return ModelSpec(f"hf-{config.model_type}", specs, loss_fn=cross_entropy, seed=seed, tied=ties,
                     export_name=hf_name, save_config=config.save_pretrained, compile_unit=decoder_layer,
                     tp_plan=functools.partial(hf_tp_plan, config), lora=settings,
                     routed_experts=routed_experts(config), as_stored=functools.partial(as_stored, root))


def as_stored(root: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` under the model's names as ``save_pretrained`` writes them (transformers' own
    conversion mapping reversed: a MoE's fused experts back to each expert's tensors, as the hub
    stores them and other tools read them)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(root, dict(tensors))


def hf_tp_plan(config: Any, index: int, layer: nn.Module, tp: int) -> dict[str, str]:
    """Layer `index`'s tensor-parallel plan (``ModelSpec.tp_plan``) from the config's own
    ``base_model_tp_plan``: each key, relative to the base model, is matched (fnmatch) as
    ``"model." + key`` against the layer's submodule paths, its style mapped by
    :data:`HF_TP_STYLES`; the embedding piece's ``model.embed_tokens`` is split by the
    vocabulary ('embedding') and the head's ``lm_head`` by its output features, gathered again
    ('colwise_out'), so a tied embedding and head are split alike.

    Args:
        config: the model's Hugging Face config.
        index: the layer's index (unused: the layer's own submodule paths say what it holds).
        layer: the built layer (a piece keeping the model's paths, e.g. ``model.layers.3``).
        tp: the tensor-parallel degree.

    Returns:
        ``{submodule path: pipeflow style}`` for the layer.

    Raises:
        ConfigError: tp does not divide num_attention_heads, num_key_value_heads or vocab_size;
            the config has no ``base_model_tp_plan``; or the plan uses a style pipeflow does not
            support.
    """
    for key in _TP_DIVIDES:
        value = getattr(config, key, None)
        if value is not None and value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide the Hugging Face config's {key}={value}: each tp "
                              f"rank holds {key}/tp of it; choose a tp that divides {value}")
    hf_plan = getattr(config, "base_model_tp_plan", None)
    if not hf_plan:
        raise ConfigError(f"the Hugging Face config ({type(config).__name__}) has no base_model_tp_plan, so "
                          f"parallel.tp={tp} does not know how to split model=hf's layers; set parallel.tp=1")
    unsupported = {key: style for key, style in hf_plan.items() if style not in HF_TP_STYLES}
    if unsupported:
        raise ConfigError(f"the Hugging Face config's base_model_tp_plan uses style(s) {unsupported} that model=hf "
                          f"does not support (supported: {', '.join(HF_TP_STYLES)}); set parallel.tp=1")
    plan: dict[str, str] = {}
    for path, _ in layer.named_modules():
        for key, style in hf_plan.items():
            if fnmatch.fnmatchcase(path, f"model.{key}"):
                plan[path] = HF_TP_STYLES[style]
        if path == "model.embed_tokens":
            plan[path] = "embedding"
            plan[""] = "sequence_out"  # with sequence parallelism: the hidden states leave as this rank's slice
        elif path == "lm_head":
            plan[path] = "colwise_out"
        elif path == "model.norm":
            plan[path] = "norm"  # with sequence parallelism: on this rank's slice (lm_head gathers it)
        elif fnmatch.fnmatchcase(path, "model.layers.*.*_layernorm"):
            # with sequence parallelism: on this rank's slice, gathered whole for the projections after it
            # (Hugging Face's attention reads the sequence's length off its input)
            plan[path] = "norm_gathered"
    return plan


def decoder_layer(index: int, layer: nn.Module) -> nn.Module:
    """What ``train.compile`` compiles of layer `index`: a decoder layer's own module (its adapter's
    shared mask and rotary cache, Python state Dynamo cannot trace, stays eager: cheap elementwise
    work once per stage); the embedding and head pieces whole.  A decoder whose experts are split
    over ep compiles its attention: the experts' all_to_all exchange is no graph Dynamo traces whole."""
    decoders = getattr(getattr(layer, "model", None), "layers", None)
    children = list(decoders.children()) if decoders is not None else []
    if len(children) != 1:
        return layer
    (decoder,) = children
    attention = getattr(decoder, "self_attn", None)
    split = any(getattr(module, "_exchange", None) is not None for module in decoder.modules())
    return attention if split and isinstance(attention, nn.Module) else decoder


def hf_name(index: int, key: str) -> str:
    """The Hugging Face parameter name of layer `index`'s state dict `key`: the key itself (each
    layer holds the model's modules at their own paths)."""
    return key
