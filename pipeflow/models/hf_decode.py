"""One stage of a ``model=hf`` decoder (:mod:`pipeflow.models.hf`) run with a KV cache, for generation.

A stage holds some of the model's layers (the pieces ``build_hf`` makes: ``embedding``,
``layer.<i>``, ``head``) and runs them on new tokens only, the keys and values of the tokens
before kept in a ``transformers`` ``DynamicCache`` per micro-batch.  The cache is made from the
model's config, so it has a slot for every decoder layer, but only this stage's layers ever
write theirs: each stage keeps only its own layers' keys and values.

The attention mask and the rotary ``(cos, sin)`` are made once per stage and call with the
model's own ``masking_utils`` and ``rotary_emb``, as the model's forward makes them, sized against
this stage's first layer of each kind in the cache (the cache's first layer belongs to another
stage).  Padding is on the left: ``pad_mask`` (B, cached + new) says which tokens are real, and
the positions count real tokens only, as ``transformers``' ``generate`` counts them.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from pipeflow.errors import ConfigError
from pipeflow.models.hf import head_logits, loop_experts, rope_types
from pipeflow.models.hf import sliding_layer as _sliding


class HFStageDecoder:
    """Runs this stage's layers of a Hugging Face decoder on new tokens with a per-micro-batch cache.

    Args:
        config: the model's Hugging Face config.
        layers: this stage's built layers by their index in the whole model (0: the embedding,
            1..n: decoder layers 0..n-1, n+1: the head).
    """

    def __init__(self, config: Any, layers: dict[int, nn.Module]) -> None:
        self.config = config
        self.layers = dict(sorted(layers.items()))
        self.last = config.num_hidden_layers + 1
        self.context = int(config.max_position_embeddings)
        decoders = [i - 1 for i in self.layers if 0 < i < self.last]
        self.softcap = getattr(config, "final_logit_softcapping", None)
        rotary = next((layer.rotary_emb for i, layer in self.layers.items() if 0 < i < self.last), None)
        self.rope_types = rope_types(config, rotary) if rotary is not None else None
        self.first_of_kind = {}  # sliding? -> this stage's first decoder layer of that kind
        for d in decoders:
            self.first_of_kind.setdefault(_sliding(config, d), d)
        if decoders:
            # the config the layers were built with: it names their attention implementation (a
            # config read from config.json names none, and the masks made for none are no masks)
            self.config = getattr(getattr(self._decoder(decoders[0]), "self_attn", None), "config", config)

    def new_cache(self) -> Any:
        """An empty cache for one micro-batch."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _decoder(self, d: int) -> nn.Module:
        return self.layers[d + 1].model.layers.get_submodule(str(d))  # type: ignore[union-attr]

    @torch.no_grad()
    def forward(self, x: Tensor, positions: Tensor, pad_mask: Tensor, cache: Any) -> Tensor:
        """This stage's layers on the new tokens.

        Args:
            x: token ids (B, q) on the first stage, else the hidden states (B, q, C).
            positions: the new tokens' positions (B, q).
            pad_mask: (B, cached + q) bool, True for real tokens (False: left padding).
            cache: this micro-batch's cache (:meth:`new_cache`), extended in place.

        Returns:
            The hidden states (B, q, C), or on the last stage the logits of the last token (B, V).

        Raises:
            ConfigError: a transformers whose mask functions cannot size a mask by layer.
        """
        hidden = x
        masks: dict[bool, Any] = {}
        ropes: dict[str | None, Any] = {}
        for i, layer in self.layers.items():
            if i == 0:
                hidden = layer.model.embed_tokens(x)  # type: ignore[union-attr,operator]
            elif i == self.last:
                return head_logits(layer, hidden[:, -1:], self.softcap)[:, -1]
            else:
                d = i - 1
                sliding = _sliding(self.config, d)
                if sliding not in masks:
                    masks[sliding] = self._mask(sliding, hidden, positions, pad_mask, cache)
                kind = self.rope_types[d] if self.rope_types else None  # Gemma 3: local or global rotary
                if kind not in ropes:
                    ropes[kind] = (layer.rotary_emb(hidden, positions) if kind is None  # type: ignore[operator]
                                   else layer.rotary_emb(hidden, positions, kind))  # type: ignore[operator]
                decoder = self._decoder(d)
                if hidden.dtype == torch.float64:
                    loop_experts(decoder)
                out = decoder(hidden, attention_mask=masks[sliding], position_ids=positions,
                              position_embeddings=ropes[kind], use_cache=True, cache=cache)
                hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _mask(self, sliding: bool, hidden: Tensor, positions: Tensor, pad_mask: Tensor, cache: Any) -> Any:
        """The model's own mask for this stage's layers of one kind, sized against this stage's first
        layer of that kind in the cache (the cache's own first layer may belong to another stage)."""
        from transformers import masking_utils

        make = (masking_utils.create_sliding_window_causal_mask if sliding
                else masking_utils.create_causal_mask)
        if "layer_idx" not in inspect.signature(make).parameters:
            raise ConfigError(f"transformers {__import__('transformers').__version__}'s {make.__name__} takes no "
                              f"layer_idx, which a pipeline stage's mask needs (its cache's first layer is another "
                              f"stage's): generation needs transformers 5.25")
        return make(config=self.config, inputs_embeds=hidden, attention_mask=pad_mask, cache=cache,
                    position_ids=positions, layer_idx=self.first_of_kind[sliding])
