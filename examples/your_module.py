"""Bring the nn.Module you already have: a plain GPT, split into pipeline stages by `from_module`.

    torchrun --nproc-per-node 2 examples/your_module.py

The first half is an ordinary GPT (nanoGPT-like) written with no knowledge of pipeflow: a token
and a position embedding, a ModuleList of blocks looped over in forward, a final norm and a head
tied to the token embedding. The second half splits it with `pipeflow.models.from_module`, naming
what runs before the blocks, the blocks, and what runs after, and trains it through the same
config and builder as ``train.py``. Each rank builds the model on the meta device and
materialises only its own layers; the tied embedding and head live on the first and last stage
and their gradients are summed each step. See docs/start/2-your-model.md.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


# ----------------------------------------------------------------- a GPT, knowing nothing of pipeflow


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and an MLP, each on the residual stream."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C / H)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


def init_gpt2(name: str, module: nn.Module, n_layer: int) -> None:
    """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 n_layer)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("c_proj", "attn_proj")) else 0.02
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """A decoder-only transformer: idx (B, T) long -> logits (B, T, vocab_size)."""

    def __init__(self, vocab_size: int = 64, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 64) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        for name, module in self.named_modules():
            init_gpt2(name, module, n_layer)

    def forward(self, idx: Tensor) -> Tensor:
        """Next-token logits for every position."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------- pipeflow's part


def embed(m: nn.Module, idx: Tensor) -> Tensor:
    """What GPT.forward does before the blocks, written with the model's attribute names."""
    return m.tok_emb(idx) + m.pos_emb(torch.arange(idx.size(1), device=idx.device))


def split_gpt(vocab_size: int = 64, block_size: int = 64, n_layer: int = 4, n_head: int = 4, n_embd: int = 64,
              dropout: float = 0.0, bias: bool = True, seed: int = 0, tie_embeddings: bool = True):
    """GPT as pipeline layers: ``before`` (the embeddings), ``blocks.0`` .., ``after`` (norm, head).

    The keyword arguments are those of the ``model=gpt`` config group (dropout and bias are
    the plain GPT's own: none, and biases); ``init`` repeats GPT.__init__'s own init per layer.
    """
    from pipeflow.models import from_module

    return from_module(
        functools.partial(GPT, vocab_size, block_size, n_layer, n_head, n_embd),  # built on meta, never whole
        before=["tok_emb", "pos_emb"], before_fn=embed,
        blocks="blocks",
        after=["ln_f", "head"],  # called in order: head(ln_f(x))
        init=functools.partial(init_gpt2, n_layer=n_layer), seed=seed,
    )


def main() -> None:
    """Train the split GPT on the Markov corpus with 1F1B, as train.py would."""
    import sys
    from pathlib import Path

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # model._target_ names examples.your_module

    from pipeflow.observability.console import setup_logging
    from pipeflow.run.builder import build_run
    from pipeflow.commands.plan.command import compose_config
    from pipeflow.runtime.world.distributed import choose_device, init_distributed

    cfg = compose_config(["model=gpt", "model._target_=examples.your_module.split_gpt", "model.n_layer=4",
                          "model.n_embd=64", "data.seq_len=32", "data.batch_size=16", "pipeline.num_microbatches=4",
                          "train.max_steps=150", "train.eval_every=75", "train.eval_batches=2", "train.log_every=20",
                          "metrics.tensorboard=false", "pipeline.profile=false"])
    backend, device = choose_device(cfg.dist.backend, cfg.dist.device)
    init_distributed(backend, device, cfg.comm.first_step_timeout_s)
    setup_logging(dist.get_rank())
    build_run(cfg, device).fit()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
