"""Fixtures shared by test modules."""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mp_harness import _free_port  # noqa: E402


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (a Trainer of one stage, a transport to
    itself), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
