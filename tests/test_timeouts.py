"""Process-group timeouts pipeflow owns (pipeflow/runtime/timeouts.py, transport.Deadlines): set on
any torch (dist.set_timeout, else _set_pg_timeout, else each backend), a margin after the deadline."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from pipeflow.runtime import timeouts
from pipeflow.runtime.transport import Deadlines


class FakeBackend:
    def __init__(self) -> None:
        self.set_to: list[datetime.timedelta] = []

    def _set_default_timeout(self, timeout: datetime.timedelta) -> None:
        self.set_to.append(timeout)


class FakeGroup:
    """A group serving CPU and CUDA through one backend (as gloo may) and nothing else."""

    def __init__(self) -> None:
        self.backend = FakeBackend()
        self._device_types = [torch.device("cpu"), torch.device("cuda")]

    def _get_backend(self, device: torch.device) -> FakeBackend:
        return self.backend


def test_the_margin_keeps_pipeflows_deadline_first() -> None:
    assert timeouts.collective_timeout_s(300.0) == 315.0  # at least 15 s
    assert timeouts.collective_timeout_s(900.0) == 945.0  # 5 %
    assert timeouts.collective_timeout_s(None) is None


def test_set_timeout_is_used_where_torch_has_it(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(dist, "set_timeout", lambda t, g: calls.append((t, g)), raising=False)
    group = FakeGroup()
    timeouts.set_group_timeout(group, 42.0)
    assert calls == [(datetime.timedelta(seconds=42), group)] and group.backend.set_to == []


def test_without_set_timeout_the_private_setter_of_older_torch_is_used(monkeypatch) -> None:
    calls = []
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda t, g: calls.append((t, g)), raising=False)
    group = FakeGroup()
    timeouts.set_group_timeout(group, 7.5)
    assert calls == [(datetime.timedelta(seconds=7.5), group)]


def test_without_either_every_backend_is_set_once(monkeypatch) -> None:
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout", raising=False)
    group = FakeGroup()
    timeouts.set_group_timeout(group, 9.0)
    assert group.backend.set_to == [datetime.timedelta(seconds=9)]  # one backend for both devices


def test_deadlines_set_owned_groups_now_and_at_the_switch(monkeypatch) -> None:
    seen: list[tuple[object, float]] = []
    monkeypatch.setattr(timeouts, "set_group_timeout", lambda g, s: seen.append((g, s)))
    a, b = object(), object()
    deadlines = Deadlines(120.0, 30.0, collectives=True)  # the default group (None) from the start
    deadlines.own(a)
    deadlines.own(b)
    deadlines.own(a)  # once
    assert seen == [(None, 135.0), (a, 135.0), (b, 135.0)]
    assert deadlines.current == 120.0
    seen.clear()
    deadlines.first_step_done()
    deadlines.first_step_done()  # idempotent
    assert seen == [(None, 45.0), (a, 45.0), (b, 45.0)] and deadlines.current == 30.0


def test_without_a_deadline_groups_keep_their_own_timeouts(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(timeouts, "set_group_timeout", lambda g, s: seen.append((g, s)))
    deadlines = Deadlines(None, collectives=True)
    deadlines.own(object())
    deadlines.first_step_done()
    assert seen == [] and deadlines.collective_s is None


@pytest.mark.filterwarnings("ignore:.*_set_pg_timeout.*:FutureWarning")  # the fallback of older torch, on purpose
@pytest.mark.parametrize("drop", [(), ("set_timeout",), ("set_timeout", "_set_pg_timeout")])
def test_a_real_gloo_group_gets_the_timeout_on_every_path(monkeypatch, drop: tuple[str, ...]) -> None:
    """In-process 1-rank gloo group; each fallback really changes the group's timeout."""
    from mp_harness import _free_port

    for name in drop:
        monkeypatch.delattr(dist if name == "set_timeout" else dist.distributed_c10d, name, raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    try:
        sub = dist.new_group([0])
        timeouts.set_group_timeout(None, 33.0)
        timeouts.set_group_timeout(sub, 44.0)
        assert timeouts.group_timeout_s(None) == 33.0 and timeouts.group_timeout_s(sub) == 44.0
    finally:
        dist.destroy_process_group()
