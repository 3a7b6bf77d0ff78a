"""The built-in GPT's attention (pipeflow.models.gpt.attend): SDPA equals the hand-written formula
it replaced, with and without packed documents; the variable-length path's glue on the CPU."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from pipeflow.models import gpt
from pipeflow.models.gpt import attend, document_mask, varlen_applies

B, H, T, HS = 3, 4, 29, 8


def hand_written(q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None = None) -> Tensor:
    """The GPT's attention before SDPA, verbatim: scores, causal (and same-id) mask, softmax, @ v."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, T, T)
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))
    if doc is not None:
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])[:, None]
    return F.softmax(att.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def qkv(seed: int = 0, requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, HS, generator=gen, dtype=torch.float64, requires_grad=requires_grad)
                 for _ in range(3))


def packed(seed: int = 0) -> Tensor:
    """Document ids (B, T): runs of 1..9 tokens, ids increasing along each row (from 0 in each)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (B, T), generator=gen)
    return torch.stack([torch.repeat_interleave(torch.arange(T), row)[:T] for row in lengths])


@pytest.mark.parametrize("documents", [False, True])
def test_sdpa_equals_the_hand_written_attention_in_float64(documents: bool) -> None:
    q, k, v = qkv(requires_grad=True)
    doc = packed() if documents else None
    grad = torch.randn(B, H, T, HS, dtype=torch.float64)
    ours, theirs = attend(q, k, v, doc), hand_written(q, k, v, doc)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(theirs, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_document_mask_is_causal_and_block_diagonal() -> None:
    doc = torch.tensor([[0, 0, 1, 1, 1], [4, 5, 5, 5, 5]])
    mask = document_mask(doc)
    assert mask[0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                      [0, 0, 1, 1, 1]]
    assert mask[1, 0].int().tolist() == [1, 0, 0, 0, 0] and mask[1, 4].int().tolist() == [0, 1, 1, 1, 1]


def test_an_id_seen_again_later_in_a_row_is_another_document() -> None:
    """As the positions (document_positions) count it: attention does not reach back to the first run."""
    assert not document_mask(torch.tensor([[7, 7, 3, 7]]))[0, 3, :2].any()
    assert gpt.document_positions(torch.tensor([[7, 7, 3, 7]])).tolist() == [[0, 1, 0, 0]]


def reference_varlen(calls: list) -> object:
    """``varlen_attn``'s documented semantics in plain torch (it runs on CUDA only): tokens (N, H, D)
    laid end to end, sequence i is [cu[i], cu[i+1]), causal within it for window (-1, 0)."""

    def varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *,
               window_size: tuple[int, int] = (-1, -1)) -> Tensor:
        calls.append((cu_q.dtype, max_q, window_size))
        assert torch.equal(cu_q, cu_k) and window_size == (-1, 0)
        bounds = cu_q.tolist()
        assert bounds[0] == 0 and bounds[-1] == q.size(0) and max(b - a for a, b in zip(bounds, bounds[1:])) <= max_q
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):  # (L, H, D) -> (H, L, D) and back
            out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                      is_causal=True).transpose(0, 1)
        return out

    return varlen


def test_the_variable_length_path_attends_as_the_mask_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The glue around ``varlen_attn`` (token layout, cumulative lengths, causal window), with a CPU
    stand-in for the CUDA kernel: the same result as the mask, which the CPU runs."""
    calls: list = []
    monkeypatch.setattr(gpt, "varlen_attn", reference_varlen(calls))
    monkeypatch.setattr(gpt, "varlen_applies", lambda q, dropout_p: True)
    q, k, v = qkv(1)
    doc = packed(1)
    torch.testing.assert_close(attend(q, k, v, doc), hand_written(q, k, v, doc), rtol=1e-12, atol=1e-12)
    assert calls == [(torch.int32, T, (-1, 0))]


def test_the_document_bounds_are_counted_once_per_doc_tensor_and_again_after_a_refill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpt, "varlen_attn", reference_varlen([]))
    monkeypatch.setattr(gpt, "varlen_applies", lambda q, dropout_p: True)
    doc = torch.tensor([[0, 0, 1], [0, 1, 1]])
    first = gpt._cu_seqlens(doc)
    assert first.tolist() == [0, 2, 3, 4, 6] and gpt._cu_seqlens(doc) is first  # the blocks of a stage
    doc.copy_(torch.tensor([[0, 0, 0], [0, 0, 0]]))  # a buffer refilled in place
    assert gpt._cu_seqlens(doc).tolist() == [0, 3, 6]


def test_the_variable_length_kernel_is_chosen_only_where_it_runs() -> None:
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert not varlen_applies(q, 0.0)  # the CPU: the mask
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        assert varlen_applies(q.cuda(), 0.0) == (gpt.varlen_attn is not None)
        assert not varlen_applies(q.cuda(), 0.1) and not varlen_applies(q.cuda().float(), 0.0)


def test_attention_dropout_acts_in_training_only() -> None:
    spec = gpt.build_gpt(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.5)
    exact = gpt.build_gpt(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.0)
    block, same = spec.build_layers([1], dtype=torch.float64)[0], exact.build_layers([1], dtype=torch.float64)[0]
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    block.eval()
    torch.testing.assert_close(block(x), same(x), rtol=1e-12, atol=1e-12)
    block.train()
    torch.manual_seed(0)
    assert not torch.allclose(block.attn(x), same.attn(x))
