"""Pure pieces of scale-out: config checks, the loss scaler's policy, act-ckpt settings, dp buckets."""
from __future__ import annotations

import pytest
import torch

from pipeflow.config import check_config
from pipeflow.errors import ConfigError
from pipeflow.mesh import _buckets
from pipeflow.precision import LossScaler, checkpoint_every, compute_dtype
from test_cli import compose_config


def test_dp_times_pp_layouts_are_accepted_and_precision_is_checked() -> None:
    assert check_config(compose_config("parallel.dp=2", "data.batch_size=32"), world_size=4) == (2, 2)
    assert check_config(compose_config("parallel.dp=4", "data.batch_size=32"), world_size=4) == (4, 1)
    with pytest.raises(ConfigError, match=r"data.batch_size=24.*parallel.dp=2.*multiple of 16"):
        check_config(compose_config("parallel.dp=2", "data.batch_size=24"), world_size=4)
    with pytest.raises(ConfigError, match=r"train.precision='fp8' is not one of fp32, bf16, fp16"):
        check_config(compose_config("train.precision=fp8"), world_size=4)
    with pytest.raises(ConfigError, match=r"pipeline.checkpoint_activations=-1"):
        check_config(compose_config("pipeline.checkpoint_activations=-1"), world_size=4)


def test_checkpoint_activations_values() -> None:
    assert [checkpoint_every(v) for v in (False, True, 0, 1, 3, "true", "false", None)] == [0, 1, 0, 1, 3, 1, 0, 0]
    with pytest.raises(ConfigError):
        checkpoint_every("some")


def test_compute_dtypes() -> None:
    assert (compute_dtype("fp32"), compute_dtype("bf16"), compute_dtype("fp16")) == (None, torch.bfloat16, torch.float16)


def test_loss_scaler_backs_off_on_overflow_and_grows_after_clean_steps() -> None:
    scaler = LossScaler(True, init_scale=1024.0, growth_interval=3)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 2048.0)
    scaler.unscale_([p])
    assert p.grad.tolist() == [2.0, 2.0]
    restored = LossScaler(True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == scaler.scale
    off = LossScaler(False)
    off.update(found_inf=True)
    assert off.scale == 1.0


def test_buckets_split_by_size_and_dtype_in_order() -> None:
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((10, torch.float32), (10, torch.float32), (30, torch.float32), (5, torch.float64), (5, torch.float64))]
    buckets = _buckets(params, bucket_bytes=100)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 10], [30], [5, 5]]
    assert [p for b in buckets for p in b] == params
