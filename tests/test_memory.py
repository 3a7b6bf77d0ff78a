"""Tensor memory: the accountant (pipeflow.runtime.memory) against a hand count, and the
prediction (pipeflow.schedules.memory.tensor_memory, pipeflow.planning.layout.stage_bytes) of
the same small case.  Single process; the multi-rank comparison runs in the gloo group of
test_pipeline_equivalence (``memory-*`` cases)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeflow.planning.layout import stage_bytes
from pipeflow.planning.profile import profile_layers
from pipeflow.models.spec import LayerSpec, ModelSpec
from pipeflow.runtime.memory import MemoryAccountant
from pipeflow.runtime.stage import Stage
from pipeflow.schedules import build_schedule, lower
from pipeflow.schedules.memory import RankMemory, StageBytes, TensorBytes, tensor_memory

F32 = 4
B, D_IN, D_HID, D_OUT = 4, 8, 16, 4
# Linear(8, 16) -> ReLU -> Linear(16, 4) -> Unflatten (a view of its input: no new storage)
PARAMS = (D_HID * D_IN + D_HID + D_OUT * D_HID + D_OUT) * F32
# kept for backward: the input x (Linear saves it), Linear's output z (kept as a layer boundary),
# ReLU's output h (saved by ReLU and by the second Linear: one storage), y (a boundary; the
# Unflatten view of it is the same storage)
ACTIVATIONS = B * (D_IN + D_HID + D_HID + D_OUT) * F32
ADAMW_STATE = 2 * PARAMS + 4 * F32  # exp_avg and exp_avg_sq per parameter, a float32 step each


def layers(view: bool = True) -> list[nn.Module]:
    torch.manual_seed(0)
    stack = [nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT)]
    return stack + [nn.Unflatten(1, (2, 2))] if view else stack


def middle_stage() -> Stage:
    return Stage(1, 3, layers())  # a middle stage: inputs received, outputs sent on


def test_the_accountant_equals_a_hand_count_of_a_linear_stack() -> None:
    stage = middle_stage()
    optimizer = torch.optim.AdamW(stage.parameters())
    acc = MemoryAccountant({1: stage}, optimizer, torch.device("cpu"))
    assert acc.count() == TensorBytes(params=PARAMS)
    x = torch.randn(B, D_IN, requires_grad=True)
    with acc.tracking():
        (out,) = stage.forward(0, (x,))
    assert out._base is not None  # the Unflatten view shares y's storage: counted once
    assert acc.count() == TensorBytes(params=PARAMS, activations=ACTIVATIONS)
    stage.backward(0, (torch.ones_like(out),))
    assert acc.count() == TensorBytes(params=PARAMS, grads=PARAMS)
    optimizer.step()
    assert acc.count() == TensorBytes(params=PARAMS, grads=PARAMS, optimizer=ADAMW_STATE)
    comm = [torch.empty(B, D_OUT), x.detach()]  # buffers the transport holds; x is no longer kept
    assert acc.count(comm).comm == B * D_OUT * F32 + B * D_IN * F32


def test_the_peak_is_the_largest_sample_and_the_step_end_what_stays() -> None:
    stage = middle_stage()
    optimizer = torch.optim.AdamW(stage.parameters())
    acc = MemoryAccountant({1: stage}, optimizer, torch.device("cpu"))
    acc.begin()
    with acc.tracking():
        for i in range(3):
            stage.forward(i, (torch.randn(B, D_IN, requires_grad=True),))
            acc.sample()
    for i in range(3):
        stage.backward(i, (torch.ones(B, 2, 2),))
        acc.sample()
    optimizer.step()
    measured = acc.end()
    # three held: 848 + 3 x 704; after the first backward the grads exist and two are held
    assert measured == RankMemory(TensorBytes(PARAMS, PARAMS, ADAMW_STATE),
                                  TensorBytes(PARAMS, PARAMS, 0, 2 * ACTIVATIONS)), measured
    assert acc.samples == 6


def test_optimizer_state_counts_only_the_parameters_that_have_it() -> None:
    """As ZeRO-1 keeps state for the parameters a rank owns: the accountant reads whatever state
    the optimizer holds, also through a wrapping optimizer's ``optim``."""
    stage = middle_stage()
    owned = list(stage.module[2].parameters())  # the second Linear only
    inner = torch.optim.AdamW(owned)
    stage.forward(0, (torch.randn(B, D_IN, requires_grad=True),))
    stage.backward(0, (torch.ones(B, 2, 2),))
    inner.step()
    owned_bytes = (D_OUT * D_HID + D_OUT) * F32
    wrapper = torch.optim.SGD(stage.parameters(), lr=0.1)
    wrapper.optim = inner  # how ZeroRedundancyOptimizer holds its local optimizer
    for optimizer in (inner, wrapper):
        counted = MemoryAccountant({1: stage}, optimizer, torch.device("cpu")).count()
        assert counted.optimizer == 2 * owned_bytes + 2 * F32
        assert counted.params == PARAMS and counted.grads == PARAMS


def test_a_dtensor_counts_its_local_shard() -> None:
    """A DTensor parameter sharded over a (fake) 2-rank mesh: this rank holds half of it."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        linear = nn.Linear(8, 8, bias=False)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        stage = Stage(0, 1, [linear])
        counted = MemoryAccountant({0: stage}, torch.optim.AdamW(stage.parameters()), torch.device("cpu")).count()
        assert counted == TensorBytes(params=4 * 8 * F32)
    finally:
        dist.destroy_process_group()


def test_the_prediction_of_the_same_stack_from_its_profile() -> None:
    """Profiled, a middle stage costs what the accountant counts once the pipeline has sent its
    outputs (freed) and holds its received input as a comm buffer."""
    spec = ModelSpec("stack", [LayerSpec(f"l{k}", lambda k=k: layers(view=False)[k]) for k in range(3)],
                     loss_fn=nn.functional.mse_loss)
    profiles = profile_layers(spec, torch.randn(B, D_IN))
    schedule = build_schedule("1f1b", 3, 4)
    costs = stage_bytes([range(0, 0), range(0, 3), range(3, 3)], profiles, schedule)
    output = B * D_OUT * F32
    held = ACTIVATIONS - B * D_IN * F32 - output
    assert costs[1] == StageBytes(params=PARAMS, activations=held, split_held=B * (D_HID + D_HID) * F32,
                                  boundary=output, offloadable=held)  # 1F1B keeps no layer outputs for a W
    stage = Stage(1, 3, layers(view=False))
    acc = MemoryAccountant({1: stage}, None, torch.device("cpu"))
    received = torch.randn(B, D_IN, requires_grad=True)
    with acc.tracking():
        (out,) = stage.forward(0, (received,))
    sent = out.detach()
    stage.deallocate_outputs(0)  # as the pipeline does once the outputs are on their way
    assert acc.count([received, sent]) == TensorBytes(params=PARAMS, activations=costs[1].activations,
                                                      comm=B * D_IN * F32 + costs[1].boundary)


def test_tensor_memory_walks_a_rank_as_the_accountant_samples() -> None:
    """1F1B, p = 2, m = 4: rank 0 holds 2 micro-batches; grads exist from its first backward;
    AdamW's two states; sharded over dp = 2 as each mode says."""
    schedule = build_schedule("1f1b", 2, 4)
    stages = [StageBytes(params=100, activations=10), StageBytes(params=60, activations=5)]
    none = tensor_memory(schedule, stages)
    assert none[0] == RankMemory(TensorBytes(100, 100, 200), TensorBytes(100, 100, 200, 20))
    assert none[1] == RankMemory(TensorBytes(60, 60, 120), TensorBytes(60, 60, 120, 5))
    zero1 = tensor_memory(schedule, stages, dp=2, shard="optimizer")[0]
    assert zero1 == RankMemory(TensorBytes(100, 100, 100), TensorBytes(100, 100, 100, 20))
    full = tensor_memory(schedule, stages, dp=2, shard="full")[0]
    # between steps a shard of each; in the step the unsharded params and grads beside the shard
    assert full == RankMemory(TensorBytes(50, 50, 100), TensorBytes(150, 100, 100, 20))


def test_comm_buffers_follow_the_lowered_program() -> None:
    """GPipe, p = 2, m = 2, recvs posted at their step: rank 1 lends each received activation until
    its backward (2 at once); a gradient lives from its B to the wait after the next step's
    action, where its send is posted: right after B1 both are live."""
    schedule = build_schedule("gpipe", 2, 2)
    stages = [StageBytes(0, 0, boundary=8), StageBytes(0, 0, boundary=0)]
    programs = lower(schedule, "at_step")
    memory = tensor_memory(schedule, stages, programs=programs)
    assert memory[1].resident.comm == 2 * 8  # the pool: two activation buffers
    assert memory[1].peak.comm == 2 * 8 + 2 * 8
    assert memory[0].peak.comm == 8 + 2 * 8  # rank 0: one gradient buffer; after F1 both activations are being sent


def test_the_planner_charges_each_shard_mode() -> None:
    """rank_memory (the planner's memory limit) under parallel.shard over dp = 2, no activations:
    1F1B on 2 ranks, 100 parameter bytes on stage 0 (grads exist after its first backward)."""
    from pipeflow.planning.search import rank_memory

    schedule = build_schedule("1f1b", 2, 4)
    peaks = {shard: rank_memory(schedule, [100.0, 60.0], [0.0, 0.0], dp=2, shard=shard)[0]
             for shard in ("none", "optimizer", "full")}
    assert peaks == {"none": 400.0, "optimizer": 300.0, "full": 50 + 100 + 100 + 100}


def test_the_console_labels_each_memory_figure() -> None:
    """Tensor bytes measured | predicted per pipeline rank; RSS and, on a GPU, the allocator's peak
    each under its own label (never one unlabelled 'peak memory')."""
    from pipeflow.observability.console import summary_line
    from pipeflow.observability.memory import memory_line

    nan = float("nan")
    cpu = {"tensor_mb": [6.42, 2.99], "tensor_predicted_mb": [6.41, 3.0], "rss_mb": [760.0, 735.0],
           "allocator_peak_mb": [nan, nan], "memory_step": 1}
    assert memory_line(cpu) == ("tensor memory per pipeline rank at step 1, MB measured | predicted: 6.42 | 6.41, "
                                "2.99 | 3.00 | process RSS 760, 735 MB")
    gpu = dict(cpu, allocator_peak_mb=[40.0, 12.0])
    assert memory_line(gpu).endswith("| process RSS 760, 735 MB | allocator peak 40, 12 MB")
    moved = dict(cpu, offloaded_mb=[1.5, 0.25], offloaded_predicted_mb=[1.5, 0.3])  # pipeline.offload
    assert memory_line(moved).endswith("| activations offloaded to the host per step, MB measured | predicted: "
                                       "1.50 | 1.50, 0.25 | 0.30")
    run = {"samples_per_s": 780.4, "tokens_per_s": None, "step_time_s": 0.041, "bubble_measured": 0.3,
           "bubble_predicted": 0.273, "peak_memory_mb": [40.0, 12.0]}
    assert summary_line(dict(run, **gpu)).endswith("| process peak memory (allocator) per pipeline rank 40, 12 MB")
    assert summary_line(dict(run, **cpu)).endswith("| process peak memory (RSS) per pipeline rank 40, 12 MB")
