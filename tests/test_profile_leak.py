"""Start-of-run measurements leave nothing alive: every tensor they made is dead when they return,
with the garbage collector off (a reference cycle through autograd is never collected anyway)."""
from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipeflow.models import build_gpt
from pipeflow.planning.profile import profile_layers
from pipeflow.planning.costs.runtime_timing import measure_action_overhead_s, measure_optimizer_s


class Made(TorchDispatchMode):
    """Weak references to every tensor an op returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[weakref.ref, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.refs.append((weakref.ref(t), t.untyped_storage().nbytes()))
        return out

    def alive(self, *held: torch.Tensor) -> list[torch.Tensor]:
        """The tensors made under the mode that are still alive, besides views of `held`."""
        mine = {t.untyped_storage().data_ptr() for t in held}
        living = [ref() for ref, _ in self.refs]
        return [t for t in living if t is not None and t.untyped_storage().data_ptr() not in mine]


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """No garbage collection inside: what is not freed by reference counts stays."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def made_and_alive(fn: Callable[[], Any], *held: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Run `fn` once to warm up (first calls import and cache), then again under `Made`: how many
    tensors it made and which of them are alive right after it returned."""
    with Made():
        fn()
    with collector_off():
        made = Made()
        with made:
            fn()
        return len(made.refs), made.alive(*held)


def mib(tensors: list[torch.Tensor]) -> float:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()) / 2**20


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_profiling_a_gpt_leaves_none_of_its_tensors_alive(amp: torch.dtype | None) -> None:
    """Softmax and log_softmax save their outputs: a pack hook returning the tensor itself made
    each block's graph a cycle (output -> grad_fn -> saved output) that outlived the profile."""
    spec = build_gpt(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    x, y = torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))

    def profile() -> None:
        profile_layers(spec, x, repeats=1, split_backward=True, sample_target=y, autocast_dtype=amp)

    made, alive = made_and_alive(profile, x, y)
    assert made > 100  # the profile ran under the mode
    assert alive == [], f"{len(alive)} tensors ({mib(alive):.2f} MiB) outlive the profile: {[t.shape for t in alive]}"


def test_the_optimizer_and_action_overhead_measurements_leave_nothing_alive() -> None:
    params = [nn.Parameter(torch.randn(300)) for _ in range(3)]

    def measure() -> None:
        measure_optimizer_s(params, torch.device("cpu"), repeats=2)
        measure_action_overhead_s(torch.device("cpu"), repeats=2)

    _, alive = made_and_alive(measure, *params)
    assert alive == [] and all(p.grad is None for p in params)


def test_a_rehearsed_step_leaves_nothing_but_its_stages_alive() -> None:
    """The rehearsal's block: a stage's forward and backward through a softmax, gradients dropped."""
    from pipeflow.planning.rehearsal import untouched
    from pipeflow.runtime.stage import Stage

    layers = [nn.Linear(8, 8), nn.Softmax(dim=-1), nn.BatchNorm1d(8)]
    stage = Stage(0, 1, layers, lambda out, target: out.pow(2).mean())
    x = torch.randn(4, 8)

    def rehearse() -> None:
        with untouched({0: stage}):
            stage.forward(0, (x,), torch.zeros(1), 1.0, keep_for_backward=True)
            stage.backward(0, None)

    _, alive = made_and_alive(rehearse, x, *stage.parameters(), *stage.module.buffers())
    assert alive == []
