"""Tests for pipeflow.models (lazy, deterministic layers; run_layers) and pipeflow.data.synthetic."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeflow.data.synthetic import (
    ClassificationBatches,
    TokenBatches,
    markov_entropy_rate,
    markov_tokens,
    markov_transitions,
    split_tokens,
    text_file_tokens,
)
from pipeflow.errors import ConfigError
import pipeflow.models
from pipeflow.models import LayerSpec, ModelSpec, build_gpt, get_model_builder, run_layers

try:  # pytest puts tests/ on sys.path when tests/ is not a package
    from toy_models import build_toy, random_batch
except ImportError:  # pragma: no cover - tests/ became a package
    from tests.toy_models import build_toy, random_batch

KINDS = ["gpt", "mlp", "masked_mlp"]
B = 3


def _output_shape(kind: str) -> tuple[int, ...]:
    return {"gpt": (B, 16, 64), "mlp": (B, 10), "masked_mlp": (B, 16)}[kind]


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", KINDS)
def test_run_layers_shapes_and_loss(kind: str) -> None:
    spec = build_toy(kind)
    x, y = random_batch(kind, B)
    out = run_layers(spec.build_all(dtype=torch.float64), x)
    assert isinstance(out, torch.Tensor) and out.shape == _output_shape(kind)
    assert out.dtype == torch.float64
    loss = spec.loss_fn(out, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()


def test_layer_names() -> None:
    blocks = [f"block.{k}" for k in range(4)]
    assert build_toy("gpt").layer_names() == ["embedding", *blocks, "head"]
    assert build_toy("mlp").layer_names() == ["input", *(f"hidden.{k}" for k in range(4)), "head"]
    assert build_toy("masked_mlp").layer_names()[1] == "block.0"


@pytest.mark.parametrize("kind", KINDS)
def test_subset_equals_build_all(kind: str) -> None:
    spec = build_toy(kind)
    full = spec.build_all()
    subset = [4, 1, 2]
    for i, layer in zip(subset, spec.build_layers(subset)):
        assert _same_state(layer, full[i])
    assert not _same_state(full[1], full[2])  # layers are seeded apart, not identical


def test_pipelined_chain_equals_full_chain_float64() -> None:
    spec = build_toy("masked_mlp")
    x, _ = random_batch("masked_mlp", B)
    full = run_layers(spec.build_all(dtype=torch.float64), x)
    stage0 = spec.build_layers(range(0, 2), dtype=torch.float64)
    stage1 = spec.build_layers(range(2, len(spec)), dtype=torch.float64)
    hidden = run_layers(stage0, x)
    assert isinstance(hidden, tuple) and hidden[1].dtype == torch.int64
    assert torch.equal(run_layers(stage1, hidden), full)


def test_build_does_not_touch_global_rng() -> None:
    spec = build_toy("gpt")
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    spec.build_layers([1])
    assert torch.equal(torch.rand(4), expected)


def test_build_is_independent_of_global_rng_and_default_dtype() -> None:
    spec = build_toy("mlp")
    torch.manual_seed(1)
    a = spec.build_layers([0])[0]
    torch.manual_seed(2)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = spec.build_layers([0])[0]
    finally:
        torch.set_default_dtype(old)
    assert _same_state(a, b) and a[0].weight.dtype == torch.float32


def test_seed_changes_weights() -> None:
    a = build_toy("mlp", seed=0).build_layers([0])[0]
    b = build_toy("mlp", seed=1).build_layers([0])[0]
    assert not _same_state(a, b)


class _Masked(nn.Module):
    """A layer with a bool buffer and an integer one beside its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("mask", torch.ones(2, dtype=torch.bool))
        self.register_buffer("count", torch.zeros(1, dtype=torch.long))


def test_dtype_leaves_masks_and_ints_alone() -> None:
    layer = ModelSpec("masked", [LayerSpec("l", _Masked)], None).build_layers([0], dtype=torch.float64)[0]
    assert layer.mask.dtype == torch.bool and layer.count.dtype == torch.long
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    block = build_toy("gpt").build_layers([1], dtype=torch.float64)[0]
    assert all(p.dtype == torch.float64 for p in block.parameters())
    assert not list(block.buffers())  # SDPA's causal attention needs no (T, T) mask buffer


def test_gpt_is_causal() -> None:
    spec = build_toy("gpt")
    layers = spec.build_all(dtype=torch.float64)
    x, _ = random_batch("gpt", 1)
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % 64  # change only the last token
    a, b = run_layers(layers, x), run_layers(layers, x2)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


def test_gpt_initial_loss_near_log_vocab() -> None:
    spec = build_toy("gpt")
    x, y = random_batch("gpt", 8)
    loss = spec.loss_fn(run_layers(spec.build_all(), x), y)
    assert abs(loss.item() - math.log(64)) < 0.1


def test_bad_index_and_spec_errors() -> None:
    spec = build_toy("mlp")
    with pytest.raises(ConfigError, match="cannot build layer 6"):
        spec.build_layers([6])
    with pytest.raises(ConfigError, match="duplicate layer names"):
        ModelSpec("x", [LayerSpec("a", nn.ReLU), LayerSpec("a", nn.ReLU)], loss_fn=lambda o, t: o)
    with pytest.raises(ConfigError, match="expected an nn.Module"):
        LayerSpec("bad", lambda: 3).build()
    with pytest.raises(ConfigError, match="n_embd=10 must be divisible by model.n_head=4"):
        get_model_builder("gpt")(n_embd=10, n_head=4)


def test_layer_spec_is_lazy() -> None:
    calls: list[int] = []

    def builder() -> nn.Module:
        calls.append(1)
        return nn.Identity()

    spec = ModelSpec("lazy", [LayerSpec(f"l{i}", builder) for i in range(3)], lambda o, t: o)
    assert calls == []
    spec.build_layers([2])
    assert calls == [1]


def test_a_model_is_named_by_its_builder_import_path() -> None:
    """One registry: the import path a config's ``model._target_`` holds; a built-in's short name
    is ``pipeflow.models.build_<name>``, not an entry of a table to register into."""
    assert get_model_builder("gpt") is build_gpt
    assert set(pipeflow.models.builtin_models()) == {"gpt", "hf", "mlp", "module", "resnet", "resnet18", "resnet50",
                                                     "sleep", "torchvision"}
    assert get_model_builder("hf") is pipeflow.models.hf.build_hf  # model=hf (transformers only when it builds)
    for name in ("nope", "pipeflow.models.gpt.build_gpt"):
        with pytest.raises(ConfigError) as err:
            get_model_builder(name)
        assert repr(name) in str(err.value) and "gpt, hf, mlp" in str(err.value) and "model._target_" in str(err.value)
    assert not hasattr(pipeflow.models, "MODEL_BUILDERS") and not hasattr(pipeflow.models, "register_model")


# ---- data ----------------------------------------------------------------------------------


def test_token_batches_deterministic() -> None:
    tokens = markov_tokens(2000, 32, seed=0)
    batches = TokenBatches(tokens, seq_len=8, batch_size=4, seed=7)
    x, y = batches.get(5)
    x2, y2 = TokenBatches(tokens, seq_len=8, batch_size=4, seed=7).get(5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert not torch.equal(batches.get(6)[0], x)
    with pytest.raises(ConfigError, match="too short"):
        TokenBatches(tokens[:8], seq_len=8, batch_size=1, seed=0)


def test_markov_stream_and_entropy() -> None:
    a = markov_tokens(5000, 32, seed=3)
    assert torch.equal(a, markov_tokens(5000, 32, seed=3))
    assert not torch.equal(a, markov_tokens(5000, 32, seed=4))
    assert a.dtype == torch.long and 0 <= int(a.min()) and int(a.max()) < 32
    P = markov_transitions(32, seed=3)
    assert torch.allclose(P.sum(dim=1), torch.ones(32, dtype=torch.float64))
    h = markov_entropy_rate(32, seed=3)
    assert 0.0 < h < math.log(32) - 1.0  # learnable: far below the uniform loss
    # the empirical next-token loss under the true chain matches the entropy rate
    empirical = -P[a[:-1], a[1:]].log().mean().item()
    assert abs(empirical - h) < 0.1


def test_text_file_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("hello wörld", encoding="utf-8")
    tokens, vocab = text_file_tokens(path, level="char")
    assert vocab == sorted(set("hello wörld")) and len(tokens) == 11
    assert "".join(vocab[i] for i in tokens) == "hello wörld"
    tokens, vocab = text_file_tokens(path, level="byte")
    assert vocab is None and bytes(tokens.tolist()) == "hello wörld".encode()
    with pytest.raises(ConfigError, match="does not exist"):
        text_file_tokens(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="'word'"):
        text_file_tokens(path, level="word")


def test_split_tokens() -> None:
    tokens = torch.arange(100)
    train, val = split_tokens(tokens, 0.1)
    assert torch.equal(torch.cat([train, val]), tokens) and len(val) == 10
    assert len(split_tokens(tokens, 0.0)[1]) == 0
    with pytest.raises(ConfigError):
        split_tokens(tokens, 1.0)


def test_classification_batches() -> None:
    data = ClassificationBatches(in_features=32, num_classes=10, batch_size=6, seed=1)
    x, y = data.get(2)
    assert x.shape == (6, 32) and x.dtype == torch.float32 and y.dtype == torch.long
    x2, y2 = ClassificationBatches(32, 10, 6, seed=1).get(2)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(data.get(3)[0], x)


def test_gpt_packed_documents_attend_only_within_their_document() -> None:
    """Fed (tokens, document ids), each document's logits equal those of the document alone:
    attention is block-diagonal causal and positions restart at each document."""
    from pipeflow.models.gpt import document_positions

    assert document_positions(torch.tensor([[0, 0, 0, 1, 1, 2]])).tolist() == [[0, 1, 2, 0, 1, 0]]
    spec = build_gpt(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    layers = spec.build_all(dtype=torch.float64)
    idx = torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2, 2]])
    packed = run_layers(layers, (idx, doc))

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # float64 rounding of other matmul shapes
        return float((a - b).abs().max()) <= 1e-12

    assert same(packed[0, 3:], run_layers(layers, idx[:1, 3:])[0])
    assert same(packed[1, :5], run_layers(layers, idx[1:, :5])[0])
    assert same(packed[1, 5:], run_layers(layers, idx[1:, 5:])[0])
    assert not same(packed[0, 3:], run_layers(layers, idx[:1])[0, 3:])  # unpacked: it sees document 0
