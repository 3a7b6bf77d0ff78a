"""Activation offloading at run time (pipeflow.runtime.offload), on the CPU: the same loss and
gradients as without it (the copies are exact), the device memory really goes, what is kept
anyway never moves, views come back as views, and misuse is an OffloadError naming the group."""
from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeflow.errors import OffloadError
import pipeflow.runtime.host_link as host_link_module
from pipeflow.runtime.host_link import HostLinkMeasure, measure_link, measured_once
from pipeflow.runtime.offload import ActivationOffloader, PinnedPool

D = 4
G = (1, 2)  # the group: stage 1, micro-batch 2


class Attention(nn.Module):
    """One fused qkv projection split into views, a softmax (saves its output), GELU, LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.fc, self.norm = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.LayerNorm(D)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, D))
        self.probes: list[weakref.ref] = []  # the softmax outputs' storages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, D) each, views of one (B, T, 3D)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1)
        self.probes.append(weakref.ref(att.untyped_storage()))
        h = x + (att @ v) * self.gain
        return self.norm(F.gelu(self.fc(h)))


def model_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Attention(), Attention()).double()
    return model, torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)


def keep_of(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), x]


def ptrs(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in model.parameters())]


def plain_run(forward=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model, x = model_and_input()
    loss = forward(model, x) if forward else model(x).square().mean()
    loss.backward()
    return loss.detach(), grads(model, x)


def assert_all_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_offloaded_run_equals_the_plain_one_and_frees_the_activations() -> None:
    want_loss, want_grads = plain_run()
    model, x = model_and_input()
    off = ActivationOffloader("cpu")
    with off.saving(G, keep=keep_of(model, x)):
        loss = model(x).square().mean()
    probes = [p for layer in model for p in layer.probes]
    assert all(p() is not None for p in probes)  # held by the saved activations
    assert {p().data_ptr() for p in probes} <= ptrs(off.device_tensors())

    nbytes = off.offload(G)
    assert nbytes > 0 and off.host_bytes(G) == nbytes
    assert all(p() is None for p in probes)  # nothing else held them: the memory went
    # what is still on the device is what is kept anyway: the weights, the buffers, the input
    kept = ptrs(keep_of(model, x))
    assert ptrs(off.device_tensors()) <= kept
    saved_for_sure = [layer.qkv.weight for layer in model] + [layer.norm.weight for layer in model]
    assert ptrs(saved_for_sure + [x] + list(model.buffers())) <= ptrs(off.device_tensors())

    off.reload(G)
    assert off.host_bytes(G) == 0
    off.ready(G)
    loss.backward()
    off.release(G)
    assert off.device_tensors() == []
    stats = off.end_pass()
    assert (stats.bytes, stats.groups) == (nbytes, 1) and stats.host_pool_bytes >= nbytes
    assert (off.end_pass().bytes, off.end_pass().groups) == (0, 0)
    assert torch.equal(loss.detach(), want_loss)
    assert_all_equal(grads(model, x), want_grads)


def test_bytes_offloaded_are_the_storages_not_kept() -> None:
    x = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(D, D, dtype=torch.float64, requires_grad=True)
    for keep, want in (([x, w], 2 * D * 8), ([w], 2 * 2 * D * 8)):
        off = ActivationOffloader("cpu")
        with off.saving(G, keep=keep):
            e = (x @ w).exp()  # mm saves x and w, exp its output e
        assert off.offload(G) == want  # e, and x when it is not kept
        off.release(G)
        del e


def test_parameters_other_devices_and_stays_are_not_moved() -> None:
    p = nn.Parameter(torch.randn(D, dtype=torch.float64))
    m = torch.randn(D, device="meta", requires_grad=True)
    off = ActivationOffloader("cpu")
    with off.saving(G):
        y = (p * p).sum()  # saves the Parameter p
        (m * m).exp()  # meta tensors: another device
        z = p.exp()  # exp saves z: a stay below
    assert off.offload(G, stay=[z]) == 0
    assert ptrs([p, z]) <= ptrs(off.device_tensors())
    assert all(t.device.type == "cpu" for t in off.device_tensors())
    off.reload(G)
    off.ready(G)
    y.backward()
    off.release(G)
    off.end_pass()


class Mul(torch.autograd.Function):
    """a * b, reporting the saved tensors as backward sees them."""

    seen: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        Mul.seen[:] = [a, b]
        return g * b, g * a


def test_views_of_one_storage_are_copied_once_and_come_back_as_views() -> None:
    a = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(D, 3 * D, dtype=torch.float64, requires_grad=True)

    def run(offload: bool):
        off = ActivationOffloader("cpu")
        with off.saving(G, keep=[a, w]):
            qkv = a @ w
            q, k, _ = qkv.chunk(3, dim=-1)
            loss = Mul.apply(q, k).sum()
        layout = [(t.storage_offset(), t.size(), t.stride()) for t in (q, k)]
        nbytes = off.offload(G) if offload else 0
        if offload:
            assert nbytes == qkv.untyped_storage().nbytes() == 2 * 3 * D * 8  # not 2 views' bytes
            del qkv, q, k
            off.reload(G)
            off.ready(G)
        a.grad = w.grad = None
        loss.backward()
        off.release(G)
        seen = [(t.storage_offset(), t.size(), t.stride()) for t in Mul.seen]
        assert seen == layout and len(ptrs(Mul.seen)) == 1
        return [a.grad.clone(), w.grad.clone()]

    assert_all_equal(run(True), run(False))


def test_a_split_backward_unpacks_twice_after_one_reload() -> None:
    def split(model, x, off=None):
        with off.saving(G, keep=keep_of(model, x)) if off else torch.enable_grad():
            loss = model(x).square().mean()
        if off:
            off.offload(G)
            off.reload(G)
            off.ready(G)
        params = list(model.parameters())
        (dx,) = torch.autograd.grad(loss, inputs=[x], retain_graph=True)  # B
        dw = torch.autograd.grad(loss, inputs=params)  # W unpacks the same saved tensors again
        if off:
            off.release(G)
            off.end_pass()
        return [dx, *dw]

    model, x = model_and_input()
    want = split(model, x)
    model, x = model_and_input()
    assert_all_equal(split(model, x, ActivationOffloader("cpu")), want)


def test_checkpointed_layers_inside_the_saved_region() -> None:
    def forward(model, x):
        h = checkpoint(model[0], x, use_reentrant=False)
        return model[1](h).square().mean()

    want_loss, want_grads = plain_run(forward)
    model, x = model_and_input()
    off = ActivationOffloader("cpu")
    with off.saving(G, keep=keep_of(model, x)):
        loss = forward(model, x)
    assert off.offload(G) > 0
    off.reload(G)
    off.ready(G)
    loss.backward()
    off.release(G)
    off.end_pass()
    assert torch.equal(loss.detach(), want_loss)
    assert_all_equal(grads(model, x), want_grads)


def saved_group(off: ActivationOffloader) -> torch.Tensor:
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with off.saving(G, keep=[x]):
        return x.exp().sum()


def test_a_backward_without_its_reload_names_the_group() -> None:
    off = ActivationOffloader("cpu")
    loss = saved_group(off)
    off.offload(G)
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2.*reload was missing"):
        loss.backward(retain_graph=True)
    off.reload(G)
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2.*ready"):
        loss.backward(retain_graph=True)
    off.ready(G)
    loss.backward(retain_graph=True)
    off.release(G)
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2.*released"):
        loss.backward()


def test_misuse_is_an_offload_error() -> None:
    off = ActivationOffloader("cpu")
    saved_group(off)
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2"):
        saved_group(off)  # saved twice
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2.*held"):
        off.reload(G)  # not offloaded
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2"):
        off.ready(G)
    off.offload(G)
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2.*offloaded"):
        off.offload(G)
    off.reload(G)
    with pytest.raises(OffloadError, match="stage 1 micro-batch 2.*reloading"):
        off.reload(G)
    with pytest.raises(OffloadError, match="stage 0 micro-batch 0.*not live"):
        off.release((0, 0))
    with pytest.raises(OffloadError, match=r"never released: stage 1 micro-batch 2 \(reloading\)"):
        off.end_pass()
    assert off.device_tensors() == [] and off.end_pass().groups == 0  # forgotten


def test_a_failed_forward_leaves_no_group() -> None:
    off = ActivationOffloader("cpu")
    with pytest.raises(ZeroDivisionError):
        with off.saving(G):
            torch.randn(2, requires_grad=True).exp()
            1 / 0
    off.end_pass()


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_the_pool_reuses_a_buffer_only_after_its_copy() -> None:
    pool = PinnedPool(pin=False)
    first = pool.take(64)
    pool.give(first, FakeEvent(done=True))
    assert pool.take(64) is first and pool.allocated_bytes == 64
    busy = FakeEvent(done=False)
    pool.give(first, busy)
    second = pool.take(64)
    assert second is not first and pool.allocated_bytes == 128
    assert pool.take(32) is not first  # another size
    busy.done = True
    assert pool.take(64) is first
    pool.give(first)
    pool.give(second, FakeEvent(done=False))
    assert pool.trim() == 64 and pool.allocated_bytes == 128 + 32 - 64


def test_measure_link_on_the_cpu() -> None:
    link = measure_link("cpu", nbytes=2**20, repeats=3)
    for rate in (link.d2h_bytes_per_s, link.h2d_bytes_per_s):
        assert math.isfinite(rate) and rate > 0
    assert not link.overlapped and not link.link().overlapped


def test_a_process_measures_its_host_link_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run built in the same process plans with the first run's link, not a new measure."""
    calls = []

    def measure(device: str) -> HostLinkMeasure:
        calls.append(device)
        return HostLinkMeasure(1e9, 2e9, overlapped=False)

    monkeypatch.setattr(host_link_module, "measure_link", measure)
    measured_once.cache_clear()
    try:
        first, again = measured_once("cpu"), measured_once("cpu")
    finally:
        measured_once.cache_clear()
    assert first is again and calls == ["cpu"]
