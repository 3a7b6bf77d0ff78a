"""Process-group timeouts pipeflow owns (pipeflow/runtime/timeouts.py, transport.Deadlines): set on
any torch (dist.set_timeout, else _set_pg_timeout, else each backend), a margin after the deadline."""
from __future__ import annotations

import datetime
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pipeflow.runtime.world import timeouts
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


# ------------------------------------------------------------------ the join deadline (issue 28 item 8)
@pytest.fixture
def lone_rank_env(monkeypatch: pytest.MonkeyPatch) -> int:
    """MASTER_ADDR/PORT of a free local port, no torchrun agent: a world whose peers never start."""
    from mp_harness import _free_port

    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    return port


@pytest.mark.parametrize("rank", [0, 1], ids=["host-waits-for-rank-1", "client-waits-for-rank-0"])
def test_a_rank_whose_peer_never_starts_waits_the_join_timeout_once(lone_rank_env: int, rank: int) -> None:
    """Only one rank of 2 starts: the whole join, reaching the store and then the announcements,
    is bounded by one deadline on every rank (the store's client used to retry with the whole
    timeout per attempt: 2 x the timeout and more), and the message gives the seconds waited."""
    from pipeflow.errors import JoinTimeoutError
    from pipeflow.runtime.world.distributed import join_store

    timeout_s = 2.0
    started = time.monotonic()
    with pytest.raises(JoinTimeoutError) as caught:
        join_store(rank, 2, timeout_s)
    waited = time.monotonic() - started
    assert timeout_s * 0.95 <= waited <= timeout_s * 1.3, waited
    text = str(caught.value)
    seconds = float(re.search(r"\(waited ([\d.]+) s", text).group(1))
    assert f"within comm.join_timeout_s=2 s (waited {seconds:.1f} s" in text and abs(seconds - waited) < 0.3, text
    missing = "rank 1 of 2 never joined" if rank == 0 else "rank 0, which hosts it, never arrived"
    assert text.startswith(f"rank {rank}: ") and missing in text, text


def test_under_torchrun_rank_0_blames_the_agent_that_hosts_the_store(lone_rank_env: int, monkeypatch) -> None:
    """With torchrun's agent hosting the store, rank 0 is a client too: when nothing listens it
    names the agent, not 'rank 0, which hosts it, never arrived' (itself; issue 38)."""
    from pipeflow.errors import JoinTimeoutError
    from pipeflow.runtime.world import join

    monkeypatch.setattr(join, "_agent_serves", lambda addr, port: True)
    with pytest.raises(JoinTimeoutError) as caught:
        join.join_store(0, 2, 0.3)
    text = str(caught.value)
    assert text.startswith("rank 0: could not reach the rendezvous store") and "torchrun's agent, which hosts it" in text
    assert "rank 0, which hosts it" not in text, text


def test_a_rank_that_starts_late_still_joins(lone_rank_env: int) -> None:
    """The client polls for its host (rank 0 here starts 0.5 s after rank 1) and joins well within the deadline."""
    from pipeflow.runtime.world.distributed import join_store

    stores: dict[int, object] = {}

    def late_host() -> None:
        time.sleep(0.5)
        stores[0] = join_store(0, 2, 20.0)

    host = threading.Thread(target=late_host)
    host.start()
    started = time.monotonic()
    stores[1] = join_store(1, 2, 20.0)
    host.join(20)
    assert set(stores) == {0, 1} and time.monotonic() - started < 10


# ------------------------------------------------------------------ teardown order (issue 28 item 11)
def test_the_teardown_joins_the_watchers_then_waits_then_destroys(monkeypatch: pytest.MonkeyPatch) -> None:
    """end_process_group stops and joins each watcher thread before the barrier and the destroy
    (a daemon thread still in a store call at interpreter exit aborts the process, exit -6), and
    says when one would not end."""
    from mp_harness import _free_port
    from pipeflow.runtime.world import distributed

    order: list[str] = []
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(distributed, "_bounded_barrier", lambda s: order.append(f"barrier {s:g}"))
    monkeypatch.setattr(distributed.gc, "collect", lambda: order.append("collect"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # a barrier is due: pretend 2 ranks
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (order.append("destroy"), real_destroy()))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    stop = threading.Event()

    def watcher() -> None:  # as the failure watch: polls the store until stopped
        store = dist.distributed_c10d._get_default_store()
        while not stop.wait(0.01):
            store.check(["x"])
        order.append("watcher ended")

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    assert distributed.end_process_group(7.0, [(stop, thread)]) is True
    assert order == ["watcher ended", "collect", "barrier 7", "destroy"] and not dist.is_initialized()

    stuck = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)  # ignores its stop event
    stuck.start()
    assert distributed.end_process_group(None, [(threading.Event(), stuck)], join_s=0.2) is False
