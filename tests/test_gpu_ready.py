"""What the first GPU run needs, checked on the CPU: the int16 refusal, the trial forward's
device, the planner's NCCL worker's device, the grad norm without float64 copies, and the
side-by-side benchmark's timing on CUDA (issue 18)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeflow.errors import UnsendableDtypeError
from pipeflow.runtime.transport import P2PComm, TensorMeta

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_int16_is_refused_before_anything_is_sent(one_rank_group) -> None:
    comm = P2PComm(None, torch.device("cpu"), timeout_s=5)
    sent = []
    comm.exchange = lambda *a, **k: sent.append(a)  # nothing may reach the wire
    fine = (TensorMeta((4, 8), torch.float32, True),)
    plan = [fine, (TensorMeta((4, 8), torch.float32, True), TensorMeta((4,), torch.int16, False))]  # 2 micro-batches
    with pytest.raises(UnsendableDtypeError) as err:
        comm.send_metas(1, plan, "of stage 2 output")
    assert sent == []
    text = str(err.value)
    assert text.startswith("pipeline rank 0 (global rank 0): the tensor [4] int16 of stage 2 output would be sent")
    assert "NCCL cannot send int16" in text and "cast it to int32" in text
    comm.send_metas(1, [fine, fine], "of stage 2 output")  # float32 goes through
    assert len(sent) == 1


class DeviceProbe(nn.Module):
    """A layer without parameters that notes where its input lives."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        return x * 2


def test_the_trial_forward_of_a_stage_without_parameters_runs_on_the_comm_device() -> None:
    from types import SimpleNamespace

    from pipeflow.models.spec import LayerSpec, ModelSpec
    from pipeflow.runtime.shapes import ShapePlan
    from pipeflow.runtime.stage import build_stages
    from pipeflow.schedules import build_schedule

    probes: list[DeviceProbe] = []
    spec = ModelSpec("probe", [LayerSpec("probe", lambda: probes.append(DeviceProbe()) or probes[-1]),
                               LayerSpec("head", lambda: nn.Identity())], loss_fn=lambda out, y: out.sum())
    stages = build_stages(spec, [range(0, 1), range(1, 2)], [0, 1])
    comm = SimpleNamespace(rank=0, device=torch.device("meta"))  # where received activations would land
    plan = ShapePlan("static", stages, build_schedule("interleaved_1f1b", 1, 2, 2), comm,
                     lambda exc, where: RuntimeError(where))
    plan.prepare([(torch.randn(2, 3),), (torch.randn(2, 3),)], 2)
    assert probes[0].seen == [torch.device("meta")]  # not the CPU, where a parameterless stage's ran before
    assert [m.shape for m in plan.metas(0, 0)] == [(2, 3)]


def test_the_planners_nccl_worker_makes_its_gpu_current_before_the_group(monkeypatch) -> None:
    from pipeflow.planning.costs import comm as comm_cost

    calls: list[tuple] = []

    class Stop(Exception):
        pass

    def init(backend, **kwargs):
        calls.append(("init", backend, kwargs.get("device_id")))
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(comm_cost.dist, "init_process_group", init)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with pytest.raises(Stop):
        comm_cost._worker(1, 12345, None, [64], 1, True)
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl", torch.device("cuda", 1))]
    calls.clear()
    with pytest.raises(Stop):
        comm_cost._worker(1, 12345, None, [64], 1, False)
    assert calls == [("init", "gloo", None)]


class Float64Copies(TorchDispatchMode):
    """Notes every op that makes a float64 tensor of more than one element."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.numel() > 1:
                self.copies.append(f"{func} -> {list(t.shape)}")
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grad_norm_makes_no_float64_copy_of_a_gradient_and_equals_torchs(monkeypatch, dtype) -> None:
    from pipeflow.run import trainer

    monkeypatch.setattr(trainer.dist, "all_reduce", lambda t, group=None: None)  # a world of one
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, 16, dtype=dtype)) for n in (300, 7, 1)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    expected = float(torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) for p in params])))
    with Float64Copies() as mode:
        norm, extra = trainer.clip_grad_norm_global(params, 0.0, None, torch.zeros(3, dtype=torch.float64))
    sizes = {c.rsplit("-> ", 1)[1] for c in mode.copies}
    assert sizes <= {"[3]", "[4]"}, mode.copies  # the 3 per-tensor norms and the all-reduced packet only
    assert abs(norm - expected) <= (1e-6 if dtype == torch.float32 else 1e-2) * expected
    assert extra.shape == (3,)


def test_the_side_by_side_benchmark_drains_the_gpu_and_reduces_a_cuda_tensor(monkeypatch) -> None:
    sys.path.insert(0, str(BENCHMARKS / "overhead"))
    import vs_torch_pipelining as vs

    calls: list[tuple] = []
    real_tensor = torch.tensor
    monkeypatch.setattr(vs.torch.cuda, "synchronize", lambda d=None: calls.append(("synchronize", d)))
    monkeypatch.setattr(vs.torch, "tensor", lambda data, dtype=None, device=None:
                        calls.append(("tensor", device)) or real_tensor(data, dtype=dtype))
    monkeypatch.setattr(vs.dist, "barrier", lambda: calls.append(("barrier",)))
    monkeypatch.setattr(vs.dist, "all_reduce", lambda t, op=None: calls.append(("all_reduce", t.dtype)))
    cuda = torch.device("cuda", 1)
    took, _ = vs.timed(vs.Runner(lambda: calls.append(("step",)), []), cuda)
    assert calls == [("barrier",), ("synchronize", cuda), ("step",), ("synchronize", cuda), ("tensor", cuda),
                     ("all_reduce", torch.float64)]
    assert took >= 0


def test_the_overflow_fault_keeps_the_forward_finite_and_makes_the_gradient_inf() -> None:
    from pipeflow.run.faults import FaultInjector, FaultSpec

    injector = FaultInjector(FaultSpec.parse("overflow:rank=0:step=4"), 0)
    injector.step = 4
    x = torch.ones(3, requires_grad=True)
    (out,) = injector._post_forward(SimpleStage(), 0, (x * 2,))
    assert torch.isfinite(out).all()  # the loss stays finite...
    out.sum().backward()
    assert torch.isinf(x.grad).all()  # ...its gradient overflows, as an fp16 backward can


class SimpleStage:
    index = 0


def test_a_posted_recv_marks_its_pooled_buffer_changed(one_rank_group, monkeypatch) -> None:
    """The backends fill a recv buffer without bumping its version; what is cached on the version
    (the GPT's cu_seqlens of packed documents on CUDA) would be read stale when a pooled buffer
    is refilled for the next micro-batch."""
    from pipeflow.models import gpt

    comm = P2PComm(None, torch.device("cpu"), timeout_s=5)
    buffer = torch.zeros(2, 6, dtype=torch.long)
    doc = buffer
    first = gpt._cu_seqlens(doc).tolist()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [None] * len(ops))  # no wire
    comm.post([], [(0, buffer)])
    buffer.data.copy_(torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]))  # as a recv writes: no version bump
    assert gpt._cu_seqlens(doc).tolist() != first
