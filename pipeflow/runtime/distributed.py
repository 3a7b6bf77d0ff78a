"""Process-group setup: backend and device from the environment torchrun sets (or a single process)."""
from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def choose_device(backend: str | None, device: str | None) -> tuple[str, torch.device]:
    """(backend, device) for this rank: NCCL on ``cuda:LOCAL_RANK`` when CUDA is present, else gloo/CPU.

    Args:
        backend: ``dist.backend`` override (``nccl`` or ``gloo``), or None for automatic.
        device: ``dist.device`` override (``cpu``, ``cuda``, ``cuda:3``), or None for automatic.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        device = f"cuda:{local_rank}"
    dev = torch.device(device)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    return backend, dev


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend: str, device: torch.device, timeout_s: float | None = None) -> None:
    """Initialise the default process group (from torchrun's env, or as a 1-process group)."""
    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        import datetime

        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:  # plain `python train.py`: a pipeline of one rank
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **kwargs
        )
