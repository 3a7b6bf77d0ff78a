"""One stage of the built-in GPT (:mod:`pipeflow.models.gpt`) run with a KV cache, for generation.

The GPT's own modules are used as they are (``wte``/``wpe``, each block's ``ln_1``, ``attn.c_attn``,
``attn.c_proj``, ``ln_2``, ``mlp``, the head); only the attention is recomputed here, over the
cached keys and values of the tokens before, so gpt.py's training path stays untouched.  Each
stage keeps the keys and values of its own blocks only, per micro-batch.  Padding is on the left:
``pad_mask`` says which tokens are real, and positions count real tokens only.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cached_mask(pad_mask: Tensor, q: int) -> Tensor:
    """(B, 1, q, kv) bool: query j (the last q of kv tokens) sees key k when k is real and not after
    it; a row that sees nothing (a padding query) sees everything instead, as Hugging Face's SDPA
    masks do, so no row is all -inf (its output is never used)."""
    B, kv = pad_mask.shape
    keys = torch.arange(kv, device=pad_mask.device)
    queries = torch.arange(kv - q, kv, device=pad_mask.device)
    mask = (keys[None, :] <= queries[:, None])[None, None] & pad_mask[:, None, None, :]  # (B, 1, q, kv)
    return mask | ~mask.any(-1, keepdim=True)


class GPTStageDecoder:
    """Runs this stage's layers of the built-in GPT on new tokens with a per-micro-batch cache.

    Args:
        layers: this stage's built layers by their index in the whole model (0: the embedding,
            1..n: the blocks, n+1: the head).
        num_layers: the model's layer count (n_layer + 2).
        context: block_size, the longest sequence the position embedding covers.
    """

    def __init__(self, layers: dict[int, nn.Module], num_layers: int, context: int) -> None:
        self.layers = dict(sorted(layers.items()))
        self.last = num_layers - 1
        self.context = context

    def new_cache(self) -> dict[int, tuple[Tensor, Tensor]]:
        """An empty cache for one micro-batch: block index -> (keys, values) (B, H, T, hs)."""
        return {}

    @torch.no_grad()
    def forward(self, x: Tensor, positions: Tensor, pad_mask: Tensor, cache: dict[int, Any]) -> Tensor:
        """This stage's layers on the new tokens (see :meth:`HFStageDecoder.forward`
        (:mod:`pipeflow.models.hf_decode`) for the arguments and the result)."""
        hidden = x
        mask = None
        for i, layer in self.layers.items():
            if i == 0:
                hidden = layer.drop(layer.wte(x) + layer.wpe(positions))  # type: ignore[operator]
            elif i == self.last:
                return layer(hidden[:, -1:])[:, -1]
            else:
                if mask is None:
                    mask = cached_mask(pad_mask, hidden.shape[1])
                hidden = hidden + self._attend(layer.attn, layer.ln_1(hidden), mask, cache, i)  # type: ignore[operator]
                hidden = hidden + layer.mlp(layer.ln_2(hidden))  # type: ignore[operator]
        return hidden

    @staticmethod
    def _attend(attn: Any, x: Tensor, mask: Tensor, cache: dict[int, Any], i: int) -> Tensor:
        """The block's attention over the cached and the new tokens, the new keys and values cached."""
        hs = x.size(-1) // attn.n_head
        qkv = attn.c_attn(x)
        B, T, width = qkv.shape
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in qkv.split(width // 3, dim=2))
        if i in cache:
            k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
        cache[i] = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return attn.resid_drop(attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, width // 3)))
