"""Micro-batches of different shapes without a process group: the shape plan of a one-rank
pipeline (all stages local, so no message is sent), the receive-buffer pool, uneven splits and
variable-length token batches."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipeflow.data import loss_counts, shard, split_microbatches
from pipeflow.data.synthetic import TokenBatches
from pipeflow.errors import ConfigError, ShapeMismatchError, StageError
from pipeflow.models.spec import LayerSpec, ModelSpec
from pipeflow.planning.partition import partition_layers
from pipeflow.runtime.buffers import BufferPool
from pipeflow.runtime.shapes import ShapePlan
from pipeflow.runtime.stage import build_stages
from pipeflow.runtime.transport import TensorMeta
from pipeflow.schedules import build_schedule


class KeepPositive(nn.Module):
    """Keeps the rows whose sum is positive: its output shape depends on the values, not the shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x.sum(1) > 0]


class Explode(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def _plan(layers: list, mode: str = "per_microbatch") -> ShapePlan:
    """The shape plan of a 2-stage, 1-rank pipeline (interleaved 1F1B with two chunks) of `layers`."""
    spec = ModelSpec("toy", [LayerSpec(f"l{k}", layer) for k, layer in enumerate(layers)],
                     loss_fn=lambda out, y: out.sum())
    schedule = build_schedule("interleaved_1f1b", 1, 2, 2)
    stages = build_stages(spec, partition_layers(len(layers), 2), [0, 1])
    comm = SimpleNamespace(rank=0, device=torch.device("cpu"))
    return ShapePlan(mode, stages, schedule, comm, lambda exc, where: StageError(f"{where}: {exc}"))  # type: ignore[arg-type]


def test_every_microbatch_gets_its_own_shapes() -> None:
    plan = _plan([lambda: nn.Linear(4, 3), lambda: nn.Linear(3, 2)])
    inputs = [(torch.randn(5, 4),), (torch.randn(2, 4),)]
    plan.prepare(inputs, 2)
    assert [m.shape for m in plan.metas(0, 0)] == [(5, 3)] and [m.shape for m in plan.metas(0, 1)] == [(2, 3)]
    assert plan.grad_metas(0, 1) == plan.metas(0, 1)  # the Linear's output requires grad


def test_static_mode_learns_one_shape_and_names_a_change() -> None:
    plan = _plan([lambda: nn.Linear(4, 3), lambda: nn.Linear(3, 2)], mode="static")
    plan.prepare([(torch.randn(5, 4),), (torch.randn(5, 4),)], 2)
    with pytest.raises(ShapeMismatchError, match=r"comm.shapes=per_step.*comm.shapes=per_microbatch"):
        plan.check(0, 1, (torch.randn(2, 3, requires_grad=True),), train=True)


def test_a_value_dependent_output_shape_is_a_named_error() -> None:
    """The plan comes from a trial forward on zeros; a stage whose output shape depends on the
    values cannot be served and says so, naming both stages."""
    plan = _plan([KeepPositive, lambda: nn.Identity()])
    x = torch.ones(4, 3)
    plan.prepare([(x,), (x,)], 2)
    with pytest.raises(ShapeMismatchError, match=r"stage 0 \(rank 0\).*stage 1 \(rank 0\).*function of its input shapes"):
        plan.check(0, 0, (KeepPositive()(x),), train=False)


def test_a_failing_layer_in_the_trial_forward_is_a_stage_error() -> None:
    plan = _plan([Explode, lambda: nn.Identity()])
    with pytest.raises(StageError, match=r"stage 0, shape negotiation \(a trial forward on zeros shaped like micro-batch 0: \['\[2, 3\] float32'\]\): boom"):
        plan.prepare([(torch.ones(2, 3),), (torch.ones(2, 3),)], 2)


def test_pool_reuses_buffers_and_drops_shapes_a_pass_did_not_use() -> None:
    pool = BufferPool(torch.device("cpu"))
    meta = TensorMeta((2, 3), torch.float32, True)
    a = pool.take(meta)
    a.requires_grad_(True)
    a.grad = torch.ones(2, 3)
    pool.give([a])
    pool.end_pass()
    b = pool.take(meta)
    assert b is a and b.grad is None and not b.requires_grad and pool.allocated == 1
    pool.give([b])
    pool.end_pass()  # taken this pass: kept
    pool.end_pass()  # not taken in this one: dropped
    assert pool.take(meta) is not a and pool.allocated == 2


def test_uneven_splits_differ_by_at_most_one_row() -> None:
    x = torch.arange(27).reshape(27, 1)
    shares = [shard((x, x), r, 2)[0] for r in range(2)]
    assert [len(s) for s in shares] == [14, 13]
    assert [len(mb) for mb in split_microbatches(shares[1], 4)] == [4, 3, 3, 3]
    assert torch.equal(torch.cat([mb for s in shares for mb in split_microbatches(s, 4)]), x)
    with pytest.raises(ConfigError, match="3 rows cannot be split into 4 micro-batches"):
        split_microbatches(x[:3], 4)


def test_variable_length_token_batches_are_deterministic_micro_batches() -> None:
    tokens = torch.arange(1000) % 50
    data = TokenBatches(tokens, seq_len=16, batch_size=10, seed=3, lengths=(4, 16), chunks=4)
    xs, ys = data.get(7)
    assert [x.shape[0] for x in xs] == [3, 3, 2, 2] and all(4 <= x.shape[1] <= 16 for x in xs)
    assert len({x.shape[1] for x in xs}) > 1  # the lengths differ (seed 3, step 7)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in zip(xs, ys))  # y is x shifted by one
    again = data.get(7)
    assert all(torch.equal(a, b) for a, b in zip(xs, again[0]))
    assert loss_counts(ys) == sum(y.numel() for y in ys)
    assert [len(s) for s in shard((xs, ys), 1, 2)[0]] == [2, 2]  # replica 1: micro-batches 2 and 3
    with pytest.raises(ConfigError, match="sequence lengths 0..16"):
        TokenBatches(tokens, 16, 10, 3, lengths=(0, 16), chunks=4)


def test_peak_memory_weighs_the_microbatches_in_flight_by_their_size() -> None:
    """1F1B on 2 ranks, m = 4: rank 0 runs 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3, so micro-batches 2 and
    3 are in flight together at its peak (sizes 3 + 4), not the first two."""
    from pipeflow.planning.search import rank_memory
    from pipeflow.schedules import one_f_one_b, simulate

    schedule = one_f_one_b(2, 4)
    sizes = [1.0, 2.0, 3.0, 4.0]
    result = simulate(schedule, microbatch_sizes=sizes)
    assert result.peak_memory == [7.0, 4.0] and result.peak_activations == [2, 1]
    assert simulate(schedule).peak_memory == [2.0, 1.0]  # sizes of 1: the pair counts
    assert rank_memory(schedule, [0.0, 0.0], [10.0, 10.0], microbatch_sizes=sizes) == [70.0, 40.0]


def test_pool_leaves_a_buffer_something_else_still_shares() -> None:
    """A stage that passes its input on sends a view of the buffer (and returns the received
    gradient as its input gradient): until that is sent, the buffer must not be reused."""
    pool = BufferPool(torch.device("cpu"))
    meta = TensorMeta((2, 3), torch.float32, False)
    a = pool.take(meta)
    on_its_way = a.detach()  # what the outbox holds
    pool.give([a])
    assert pool.take(meta) is not a and pool.allocated == 2
    del on_its_way
