"""Valid-token weighting (pure units): a micro-batch weighs by the targets its loss counts.

The multi-process checks (dp x pp Trainer on masked targets against the unsplit model) are in
test_scale.py (tests/masked_cases.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeflow.data import loss_counts, microbatch_counts
from pipeflow.models import from_module
from pipeflow.models.spec import LayerSpec, ModelSpec, counted_targets
from pipeflow.runtime.stage import Stage


def _masked_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (8, 5, 11) and targets with about half masked, micro-batch rows 2..3 wholly."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 5, 11, generator=gen, dtype=torch.float64)
    y = torch.randint(11, (8, 5), generator=gen)
    y[torch.rand(8, 5, generator=gen) < 0.5] = -100
    y[2:4] = -100
    return logits, y


def test_counted_targets_skip_ignore_index_of_integer_targets_only() -> None:
    y = torch.tensor([[1, -100, 3], [-100, -100, 0]])
    assert counted_targets(y) == 3
    assert counted_targets(y, ignore_index=None) == 6
    assert counted_targets(torch.full((2, 3), -100.0)) == 6  # regression targets: every element
    assert counted_targets([y, y[:1]]) == 5
    spec = ModelSpec("m", [LayerSpec("a", nn.Identity)], loss_fn=F.mse_loss)
    assert spec.loss_count(y) == 3
    assert ModelSpec("m", [LayerSpec("a", nn.Identity)], loss_fn=F.mse_loss, ignore_index=0).loss_count(y) == 5
    custom = ModelSpec("m", [LayerSpec("a", nn.Identity)], loss_fn=F.mse_loss, count_fn=lambda t: 42)
    assert custom.loss_count(y) == 42 and loss_counts([y, y], custom.loss_count) == 84
    assert from_module(nn.Sequential(nn.Linear(2, 2)), ignore_index=-1).loss_count(torch.tensor([-1, 2])) == 1


def test_count_weights_give_the_masked_mean_where_element_weights_did_not() -> None:
    """The pre-issue-42 weights (each micro-batch's elements over the batch's) miss the unsplit
    model's loss on a masked batch, and the all-masked micro-batch's 0/0 makes it NaN; weights
    by counted targets give it exactly."""
    logits, y = _masked_batch()
    whole = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    means = [F.cross_entropy(a.flatten(0, 1), t.flatten()) for a, t in zip(logits.chunk(4), y.chunk(4))]
    old = [t.numel() / y.numel() for t in y.chunk(4)]
    assert torch.isnan(sum(w * mean for w, mean in zip(old, means)))
    kept = [(w, mean) for w, mean in zip(old, means) if not torch.isnan(mean)]
    assert abs(sum(w * mean for w, mean in kept) - whole) > 1e-3  # wrong even without the empty one
    counts = microbatch_counts(y, 4, counted_targets)
    assert counts[1] == 0 and sum(counts) == loss_counts(y, counted_targets) == int((y != -100).sum())
    new = [c / sum(counts) * mean for c, mean in zip(counts, means) if c]
    assert abs(sum(new) - whole) <= 1e-12


def test_counts_follow_micro_batches_given_as_a_list() -> None:
    _, y = _masked_batch(1)
    parts = list(y.tensor_split(3))
    assert microbatch_counts(parts, 3, counted_targets) == [int((t != -100).sum()) for t in parts]
    with pytest.raises(Exception, match="cannot be run as 2"):
        microbatch_counts(parts, 2, counted_targets)


@pytest.mark.parametrize("split", [False, True])
def test_an_all_masked_micro_batch_has_zero_loss_and_gradients_never_nan(split: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 6).double()
    stage = Stage(0, 1, [layer], lambda out, t: F.cross_entropy(out, t), split_backward=split)
    x = torch.randn(3, 4, dtype=torch.float64)
    (loss,) = stage.forward(0, (x,), torch.full((3,), -100), loss_scale=0.0)
    assert loss.item() == 0.0
    stage.backward(0, None, weights=not split)
    if split:
        stage.backward_weight(0)
    assert all(p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)) for p in layer.parameters())
