"""parallel.shard=optimizer in one process: with one replica there is nothing to shard."""
from __future__ import annotations

import logging

import pytest
import torch

from pipeflow.runtime.parallel.zero import build_optimizer, local_optimizer, owned_parameters


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_one_replica_gets_plain_adamw_and_zero1_says_so_once(shard: str, caplog: pytest.LogCaptureFixture) -> None:
    params = list(torch.nn.Linear(3, 2).parameters())
    with caplog.at_level(logging.INFO, logger="pipeflow"):
        optimizer = build_optimizer(params, shard, None, 1, announce=True, lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
    assert type(optimizer) is torch.optim.AdamW and local_optimizer(optimizer) is optimizer
    assert owned_parameters(optimizer) == params
    notes = [r.getMessage() for r in caplog.records if "nothing to shard" in r.getMessage()]
    assert notes == (["parallel.shard=optimizer with parallel.dp=1: one replica, nothing to shard; plain AdamW"]
                     if shard == "optimizer" else [])
