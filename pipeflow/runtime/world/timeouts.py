"""Process-group timeouts that pipeflow owns: set on every group it creates or uses, on every torch.

A collective's process-group timeout is where the backend gives up on its own: gloo raises, and
NCCL's watchdog aborts the communicator and the process with a message that names no stage or
transfer.  pipeflow keeps its own deadline on every P2P wait (``comm.first_step_timeout_s``,
then ``comm.timeout_s``); each group's timeout is that deadline plus :func:`margin_s`, so on
NCCL pipeflow's named ``PipelineTimeoutError`` always comes first.

``dist.set_timeout`` is new in torch 2.14; older torch has the private ``_set_pg_timeout``
(torch 2.2 to 2.13), and below that every backend's ``_set_default_timeout`` is called directly.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

MIN_MARGIN_S = 15.0  # the watchdog's poll, its report to the store (up to 2 s) and the exit


def margin_s(deadline_s: float) -> float:
    """How much longer than pipeflow's own deadline a group's timeout is: 5 %, at least 15 s."""
    return max(MIN_MARGIN_S, 0.05 * deadline_s)


def collective_timeout_s(deadline_s: float | None) -> float | None:
    """The process-group timeout that goes with P2P deadline `deadline_s` (None: leave the group's)."""
    return None if deadline_s is None else deadline_s + margin_s(deadline_s)


def set_group_timeout(group: Any, seconds: float) -> None:
    """Set the timeout of every later operation on `group` (None: the default group), on any torch.

    Uses ``dist.set_timeout`` where torch has it (2.14+), else ``_set_pg_timeout``, else each of
    the group's backends' ``_set_default_timeout``.
    """
    timeout = datetime.timedelta(seconds=seconds)
    setter = getattr(dist, "set_timeout", None) or getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)
        return
    for backend in _backends(group):
        backend._set_default_timeout(timeout)


def group_timeout_s(group: Any) -> float | None:
    """The timeout (seconds) the backends of `group` use now: their largest; None if none says."""
    found = [b.options._timeout.total_seconds() for b in _backends(group) if hasattr(getattr(b, "options", None), "_timeout")]
    return max(found) if found else None


def _backends(group: Any) -> list[Any]:
    """The distinct backends of `group` (one per device type it serves)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    found: dict[int, Any] = {}
    for device_type in {d.type for d in getattr(pg, "_device_types", [torch.device("cpu")])}:
        try:
            backend = pg._get_backend(torch.device(device_type))
        except RuntimeError:  # no backend for this device type
            continue
        found.setdefault(id(backend), backend)
    return list(found.values())
