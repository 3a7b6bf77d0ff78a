"""Stage: which kept tensors it frees after a send, and which it keeps for backward at all.

An output that a later layer of the same stage was handed keeps its storage (the layer may have
saved it for backward); each layer's outputs are kept from forward to backward only on a stage
that runs a split backward (B then W).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeflow.errors import ScheduleError
from pipeflow.runtime.stage import Stage

F64 = torch.float64


class Fork(nn.Module):
    """x -> (a(x), b(x)): two outputs of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6, dtype=F64), nn.Linear(6, 6, dtype=F64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class GateAndPass(nn.Module):
    """(u, v) -> (c(u) * v, v): consumes v (the product saves it) and hands it on, the very tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(6, 6, dtype=F64)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.c(u) * v, v


def _grads(stage: Stage, free: bool, weights: bool) -> list[torch.Tensor]:
    """The input's and the parameters' gradients of one forward and backward of `stage`."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=F64, requires_grad=True)
    gate, passed = stage.forward(0, (x,))
    if free:
        stage.deallocate_outputs(0)
        assert gate.numel() == 0 and passed.shape == (4, 6)  # the product's storage goes, v stays
    (gx,) = stage.backward(0, (torch.ones(4, 6, dtype=F64), torch.full((4, 6), 0.5, dtype=F64)), weights=weights)
    if not weights:
        stage.backward_weight(0)
    grads = [gx] + [p.grad.clone() for p in stage.parameters()]
    stage.module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("weights", [True, False], ids=["full", "split"])
def test_an_output_a_later_layer_consumed_is_not_freed(weights: bool) -> None:
    """Before: v's storage was swapped out after the send, and the product's backward read an
    empty tensor (a size mismatch, or with a matmul `mat2 must be a matrix`)."""
    torch.manual_seed(0)
    stage = Stage(0, 2, [Fork(), GateAndPass()])
    kept, freed = _grads(stage, free=False, weights=weights), _grads(stage, free=True, weights=weights)
    for a, b in zip(kept, freed):
        assert torch.equal(a, b)  # the same computation in one process: bit for bit


def test_a_full_backward_stage_keeps_no_layer_outputs() -> None:
    torch.manual_seed(0)
    full, split = Stage(0, 2, [Fork(), GateAndPass()], split_backward=False), Stage(0, 2, [Fork(), GateAndPass()])
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    full.forward(0, (x,)), split.forward(0, (x,))
    assert full._boundaries == {} and len(split._boundaries[0]) == 2
    ones = (torch.ones(4, 6, dtype=F64),) * 2
    refused = r"stage 0, micro-batch 0: a split backward .* only with split_backward=True \(here False\)"
    with pytest.raises(ScheduleError, match=refused):
        full.backward(0, ones, weights=False)
    full.backward(0, ones)  # refused above without touching what it keeps; a full backward needs no layer outputs
    assert full.activations_held() == 0 and all(p.grad is not None for p in full.parameters())


def test_the_memory_prediction_keeps_the_last_outputs_only_where_the_stage_does() -> None:
    """Under a full backward the last stage's outputs (the logits) live on only when the loss saves
    them (MSE), not under cross-entropy, which keeps its log-probabilities; a split backward keeps
    them for W."""
    from dataclasses import replace

    from pipeflow.planning.layout import stage_bytes
    from pipeflow.planning.partition import partition_layers
    from pipeflow.planning.profile import profile_layers
    from pipeflow.schedules import build_schedule
    from toy_models import build_toy, random_batch

    spec = build_toy("mlp")
    x, y = random_batch("mlp", 4)
    ranges = partition_layers(len(spec.layers), 2)
    one_hot = nn.functional.one_hot
    mse = replace(spec, loss_fn=lambda out, t: nn.functional.mse_loss(out, one_hot(t, out.shape[-1]).to(out)))
    for model, saves in ((spec, False), (mse, True)):
        profiles = profile_layers(model, x, dtype=F64, sample_target=y, repeats=1)
        assert profiles[-1].loss_saves_output is saves
        full, split = (stage_bytes(ranges, profiles, build_schedule(name, 2, 4)) for name in ("1f1b", "zb_h1"))
        assert split[0].activations == full[0].activations  # sent on: freed once sent either way
        assert split[1].activations - full[1].activations == (0 if saves else profiles[-1].output_bytes)


def test_a_full_backward_of_an_input_that_is_a_view_warns_nothing() -> None:
    """Stage 0 given a view of a tensor that requires grad (a batch cut into micro-batches): its
    backward read the view's .grad, which autograd never fills, and torch warned on every step."""
    import warnings

    stage = Stage(0, 2, [Fork(), GateAndPass()], split_backward=False)
    whole = torch.randn(8, 6, dtype=F64, requires_grad=True)
    stage.forward(0, (whole[:4],))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (gx,) = stage.backward(0, (torch.ones(4, 6, dtype=F64),) * 2)
    assert gx is None and whole.grad is not None  # the gradient went through the view to the batch
