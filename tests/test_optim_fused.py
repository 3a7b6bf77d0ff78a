"""optim.fused: fused AdamW where set (auto: on CUDA), the same update as the unfused one on the CPU.
The builder's optimizer in every shard mode: tests/test_scale.py (the ``-fused`` cases)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from pipeflow.planning.costs.runtime_timing import fused_adamw, measure_optimizer_s
from pipeflow.config.schema import register_configs
from pipeflow.runtime.parallel.zero import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_optim_fused_defaults_to_auto_and_takes_a_bool() -> None:
    assert _compose().optim.fused is None
    assert _compose("optim.fused=true").optim.fused is True
    with pytest.raises(ConfigCompositionException):
        _compose("optim.fused=sometimes")


@pytest.mark.parametrize("setting, device, fused", [
    (None, "cuda", True), (None, "cpu", False), (True, "cpu", True), (False, "cuda", False), (True, "cuda", True)])
def test_auto_fuses_on_cuda_only(setting: bool | None, device: str, fused: bool) -> None:
    assert fused_adamw(setting, device) is fused


def test_fused_adamw_on_the_cpu_updates_as_the_unfused_one() -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(17, 5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    runs = {}
    for fused in (True, None):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = build_optimizer(params, "none", None, 1, fused=fused, **ADAMW)
        assert bool(optimizer.defaults.get("fused")) == bool(fused)
        grads = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads, dtype=p.dtype)
            optimizer.step()
        runs[fused] = params
    for a, b, s in zip(runs[True], runs[None], start):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert (a - s).abs().max() > 1e-3  # they moved


def test_the_tail_times_the_optimizer_the_run_uses() -> None:
    params = [torch.nn.Parameter(torch.zeros(100)) for _ in range(2)]
    assert measure_optimizer_s(params, torch.device("cpu"), repeats=2, fused=True) > 0.0
    assert all(p.grad is None for p in params)


def test_a_rank_with_nothing_to_train_times_no_optimizer_step() -> None:
    """A pipeline rank whose stages hold only frozen weights (LoRA's embedding and head) has no
    optimizer step to time; the start-of-run measurement raised AdamW's "empty parameter list"."""
    assert measure_optimizer_s([], torch.device("cpu"), repeats=2) == 0.0

