"""Pure pieces of scale-out: config checks, the loss scaler's policy, act-ckpt settings, dp buckets."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra.errors import ConfigCompositionException

from pipeflow.config.schema import check_config
from pipeflow.errors import ConfigError, NonFiniteError
from pipeflow.runtime.finite import FiniteCheck
from pipeflow.runtime.parallel.mesh import _buckets
from pipeflow.runtime.precision import LossScaler, checkpoint_every, compute_dtype
from test_cli import compose_config


def test_dp_times_pp_layouts_are_accepted_and_precision_is_checked() -> None:
    assert check_config(compose_config("parallel.dp=2", "data.batch_size=32"), world_size=4) == (2, 2)
    assert check_config(compose_config("parallel.dp=4", "data.batch_size=32"), world_size=4) == (4, 1)
    # 24 rows over dp 2 x m 8: micro-batches of 2 and 1 rows (issue 23); fewer rows than 16 cannot be split
    assert check_config(compose_config("parallel.dp=2", "data.batch_size=24"), world_size=4) == (2, 2)
    with pytest.raises(ConfigError, match=r"data.batch_size=12.*parallel.dp=2.*at least 16"):
        check_config(compose_config("parallel.dp=2", "data.batch_size=12"), world_size=4)
    with pytest.raises(ConfigCompositionException) as refused:  # an Enum: refused while composing
        compose_config("train.precision=fp8")
    assert "Invalid value 'fp8', expected one of [fp32, bf16, fp16]" in str(refused.value.__cause__)
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
    assert off.scale == 1.0 and not off.at_minimum


def test_loss_scale_stops_at_its_minimum() -> None:
    scaler = LossScaler(True, init_scale=4.0)
    scales = []
    for _ in range(4):
        scaler.update(found_inf=True)
        scales.append(scaler.scale)
    assert scales == [2.0, 1.0, 1.0, 1.0] and scaler.at_minimum
    scaler.load_state_dict({"scale": 0.25, "good_steps": 0})  # saved before the floor existed
    assert scaler.scale == 1.0
    scaler.update(found_inf=True)
    assert scaler.scale == 1.0  # an overflow never raises the scale


def test_check_finite_leaves_gradient_overflow_to_the_fp16_loss_scaler() -> None:
    check = FiniteCheck({}, num_stages=2, device=torch.device("cpu"))  # flags: [forward 0, 1, grads 0, 1]
    ranks = [0, 1]
    fp16, fp32 = LossScaler(True), LossScaler(False)
    check.raise_if_non_finite([0, 0, 0, 0], 3, ranks, fp16)
    check.raise_if_non_finite([0, 0, 1, 2], 3, ranks, fp16)  # an overflow: skipped by the scaler
    with pytest.raises(NonFiniteError, match=r"step 3: .* the parameter gradients of stage 1 \(rank 1\), in backward; s"):
        check.raise_if_non_finite([0, 0, 1, 2], 3, ranks, fp32)  # no scaler to explain it
    with pytest.raises(NonFiniteError, match=r"step 3: .* the parameter gradients of stage 1 \(rank 1\)"):
        check.raise_if_non_finite([0, 0, 1, 2], 3, ranks)
    with pytest.raises(NonFiniteError, match=r"the forward output of stage 1 \(rank 1\) - the loss"):
        check.raise_if_non_finite([0, 1, 0, 1], 3, ranks, fp16)  # the scale does not touch the forward
    fp16.scale = fp16.min_scale
    with pytest.raises(NonFiniteError, match=r"stage 1 \(rank 1\), in backward; the fp16 loss scale is already at its minimum \(1\)"):
        check.raise_if_non_finite([0, 0, 0, 1], 3, ranks, fp16)


def test_buckets_split_by_size_and_dtype_in_order() -> None:
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((10, torch.float32), (10, torch.float32), (30, torch.float32), (5, torch.float64), (5, torch.float64))]
    buckets = _buckets(params, bucket_bytes=100)
    assert [[p.numel() for p in b] for b in buckets] == [[10, 10], [30], [5, 5]]
    assert [p for b in buckets for p in b] == params


def test_check_finite_judges_the_unscaled_loss_and_large_finite_gradients_pass() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.full((2,), 1e20)  # finite, though its float32 norm overflows
    last = SimpleNamespace(index=1, is_last=True, losses={0: torch.tensor(2.0, dtype=torch.float16)},
                           forward_hooks=[], parameters=lambda: [weight])
    check = FiniteCheck({1: last}, num_stages=2, device=torch.device("cpu"))
    scaled = torch.tensor(2.0, dtype=torch.float16) * 65536.0  # inf: fp16 tops out at 65504
    check._watch_forward(last, 0, (scaled,))
    assert check.local_flags().tolist() == [0, 0, 0, 0]
    last.losses[0] = torch.tensor(float("nan"))
    weight.grad[1] = float("inf")
    check._watch_forward(last, 0, (scaled,))
    assert check.local_flags().tolist() == [0, 1, 0, 1]
    assert check.local_flags().tolist() == [0, 0, 0, 1]  # forward flags start again from zero
