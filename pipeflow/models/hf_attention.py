"""``parallel.cp`` for ``model=hf``: a family's own attention module runs round the cp ring.

The builder attaches the cp ring (:class:`~pipeflow.runtime.parallel.ring_attention.ContextParallel`) to
every module with a :data:`CONTEXT_PARALLEL` attribute (the decoder pieces' attention modules and
the embedding piece carry one, None without cp).  A layer whose attention holds it names
:data:`RING_ATTENTION` in its config: a function registered with transformers'
``AttentionInterface``, which the family's attention calls as it calls SDPA, with its own scaling
and sliding window.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from pipeflow.errors import ConfigError

CONTEXT_PARALLEL = "context_parallel"  # the hook parallel.cp attaches its ring to (runtime.ring_attention)
RING_ATTENTION = "pipeflow_ring"  # the attention function registered with transformers for parallel.cp


def ring_attention_of(layer: nn.Module) -> bool:
    """Whether `layer`'s attention runs round the cp ring (its hook attached): then its config
    names :data:`RING_ATTENTION`, registered with transformers' ``AttentionInterface`` once, so
    the family's own attention module calls it as it calls SDPA."""
    attention = getattr(layer, "self_attn", None)
    if getattr(attention, CONTEXT_PARALLEL, None) is None:
        return False
    if attention.config._attn_implementation != RING_ATTENTION:  # type: ignore[union-attr]
        from transformers import AttentionInterface

        if RING_ATTENTION not in AttentionInterface._global_mapping:
            AttentionInterface.register(RING_ATTENTION, ring_attention_forward)
        attention.config._attn_implementation = RING_ATTENTION  # type: ignore[union-attr]
    return True


def ring_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                           dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                           cp_documents: Tensor | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature, run round the cp ring by the module's
    ``context_parallel`` (query (B, H, T/cp, D), key and value with their own K/V heads; the mask
    made from the global positions, causal, sliding by `sliding_window`, within the packed documents
    `cp_documents` (B, T), the whole rows' document numbers); returns (B, T/cp, H, D).

    Raises:
        ConfigError: attention dropout, logit soft-capping or sinks, which the ring does not compute.
    """
    unsupported = [what for what, there in (("attention dropout", dropout), ("logit soft-capping", kwargs.get("softcap")),
                                            ("attention sinks", kwargs.get("s_aux"))) if there]
    if unsupported:
        raise ConfigError(f"parallel.cp: {type(module).__name__} computes {unsupported[0]}, which ring attention does "
                          f"not; set parallel.cp=1 for this model (or turn it off in its config)")
    out = getattr(module, CONTEXT_PARALLEL).attend(query, key, value, window=sliding_window, scale=scaling,
                                                   documents=cp_documents)
    return out.transpose(1, 2).contiguous(), None
