"""The timing abstraction (pipeflow/runtime/events.py): marks resolved to perf_counter seconds
after the step; the host clock on the CPU, CUDA events (faked here) on a GPU."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pipeflow.config.schema import MetricsConfig, ParallelConfig
from pipeflow.runtime.events import CudaEventClock, EventRecorder, HostClock, TimedEvent, clock_for


def test_the_host_clock_records_perf_counter_seconds() -> None:
    recorder = EventRecorder()
    before = time.perf_counter()
    start = recorder.start()
    a = recorder.mark()
    b = recorder.mark()
    recorder.record("F", "0F0", a, b)
    got = recorder.stop()
    assert before <= start <= a <= b <= recorder.stopped_at <= time.perf_counter()
    assert got == [TimedEvent("F", "0F0", a, b)] and not recorder.on


class FakeGPU:
    """A device whose timeline the test moves by hand: events fire at the GPU's time."""

    def __init__(self) -> None:
        self.now_s = 100.0  # GPU clock, unrelated to the host's
        self.synchronized = 0

    def event(self, enable_timing: bool = False) -> "FakeEvent":
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.at = gpu, None

    def record(self) -> None:
        self.at = self.gpu.now_s

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:  # milliseconds, as torch.cuda.Event's
        return 1e3 * (other.at - self.at)


@pytest.fixture
def gpu(monkeypatch) -> FakeGPU:
    fake = FakeGPU()
    monkeypatch.setattr(torch.cuda, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: setattr(fake, "synchronized", fake.synchronized + 1))
    return fake


def test_cuda_marks_resolve_to_gpu_time_after_the_step_start_on_the_host_axis(gpu) -> None:
    recorder = EventRecorder(CudaEventClock(torch.device("cuda", 0)))
    start = recorder.start()
    assert gpu.synchronized == 1  # drained, so the step-start event stands at the host's start
    t0 = recorder.mark()  # the host queues an action in no time...
    gpu.now_s += 0.004  # ...that runs 4 ms on the GPU
    t1 = recorder.mark()
    recorder.record("F", "0F0", t0, t1)
    w0 = recorder.mark()
    gpu.now_s += 0.010  # the compute stream waits 10 ms for a recv
    recorder.record("comm", "recv", w0, recorder.mark())
    got = recorder.stop()
    assert gpu.synchronized == 2  # drained again: the step's time includes its last kernels
    assert [(e.kind, e.name) for e in got] == [("F", "0F0"), ("comm", "recv")]
    assert got[0].start == pytest.approx(start) and got[0].end - got[0].start == pytest.approx(0.004)
    assert got[1].end - got[1].start == pytest.approx(0.010) and got[1].end == pytest.approx(start + 0.014)
    assert all(isinstance(v, float) for e in got for v in (e.start, e.end))


def test_clock_for_picks_cuda_events_only_on_a_cuda_device() -> None:
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(None), HostClock)
    clock = clock_for("cuda:1")  # built without touching CUDA
    assert isinstance(clock, CudaEventClock) and clock.device == torch.device("cuda", 1)


class ScriptedClock(HostClock):
    """Begin at 10 s, end at 13 s (a CUDA step whose kernels ran past the host's return)."""

    def begin(self) -> float:
        return 10.0

    def end(self) -> float:
        return 13.0


def test_run_metrics_time_the_step_by_the_recorders_clock(monkeypatch) -> None:
    from pipeflow.observability import metrics
    from pipeflow.planning.layout import predict
    from pipeflow.schedules import build_schedule

    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    cfg = SimpleNamespace(metrics=MetricsConfig(trace_steps=[], tensorboard=False, progress_bar=False),
                          train=SimpleNamespace(log_every=100, max_steps=10), parallel=ParallelConfig())
    recorder = EventRecorder(ScriptedClock())
    schedule = build_schedule("1f1b", 2, 2)
    run = metrics.RunMetrics(cfg, recorder, 0, 2, None, "unused", predict(schedule, [range(0, 1), range(1, 2)], None),
                             (8, None))
    run.begin_step(1)
    recorder.record("F", "0F0", 10.5, 12.0)
    run.end_step(1, loss=1.0, grad_norm=1.0, lr=0.1)
    assert run.step_times == [3.0]
    assert (run.interval.compute_s, run.interval.idle_s) == pytest.approx((1.5, 1.5))



def test_an_untimed_cuda_step_neither_drains_the_device_nor_records_events(gpu) -> None:
    recorder = EventRecorder(CudaEventClock(torch.device("cuda", 0)))
    assert not recorder.free
    before = time.perf_counter()
    start = recorder.start(timed=False)
    assert not recorder.on and gpu.synchronized == 0  # the pipeline records nothing while off
    assert recorder.stop() == [] and gpu.synchronized == 0
    assert before <= start <= recorder.stopped_at <= time.perf_counter()


def test_cuda_events_come_from_a_pool_reused_step_after_step(gpu, monkeypatch) -> None:
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: made.append(1) or FakeEvent(gpu))
    recorder = EventRecorder(CudaEventClock(torch.device("cuda", 0)))
    for _ in range(3):
        recorder.start()
        for _ in range(4):
            recorder.record("F", "0F0", recorder.mark(), recorder.mark())
        recorder.stop()
    assert len(made) == 9  # one step's worth (the step-start event and 8 marks), made once


def test_on_cuda_only_the_traced_memory_and_every_nth_step_are_timed(monkeypatch) -> None:
    from pipeflow.observability import metrics
    from pipeflow.planning.layout import predict
    from pipeflow.schedules import build_schedule

    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    cfg = SimpleNamespace(metrics=MetricsConfig(trace_steps=[5], tensorboard=False, progress_bar=False,
                                                memory_steps=[1], timed_every=10),
                          train=SimpleNamespace(log_every=100, max_steps=40), parallel=ParallelConfig())
    schedule = build_schedule("1f1b", 2, 2)
    prediction = predict(schedule, [range(0, 1), range(1, 2)], None)
    cuda = metrics.RunMetrics(cfg, EventRecorder(CudaEventClock(torch.device("cuda", 0))), 0, 2, None, "unused",
                              prediction, (8, None))
    cuda.first_step = 0
    assert [s for s in range(40) if cuda.timed(s)] == [1, 2, 5, 12, 22, 32]  # memory, warm-up done, traced, every 10th
    cpu = metrics.RunMetrics(cfg, EventRecorder(), 0, 2, None, "unused", prediction, (8, None))
    assert all(cpu.timed(s) for s in range(40))


def test_an_overlapped_pairs_second_action_and_the_exchanges_get_threads_of_their_own() -> None:
    """Issue 46: in the Chrome trace an action that starts before the rank's previous one ended (an
    overlapped pair's B) lies on the rank's "overlapped pair" thread, the all_to_alls on theirs;
    ``span`` records only while the recorder is on."""
    from pipeflow.observability.trace import chrome_trace
    from pipeflow.runtime.events import span

    timed = [("F", "0F1", 0.0, 3.0), ("a2a", "dispatch", 1.0, 2.0), ("B", "3B0", 1.5, 4.0), ("F", "3F2", 4.0, 5.0)]
    trace = chrome_trace({0: [(0, 0.0, 5.0, timed)]})
    tids = {e["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tids == {"0F1": 0, "all_to_all dispatch": 2, "3B0": 1, "3F2": 0}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "pipeline", 1: "overlapped pair", 2: "all_to_all"}
    recorder = EventRecorder()
    with span(recorder, "F", "0F0"):
        pass
    recorder.start()
    with span(recorder, "B", "0B0"):
        pass
    with pytest.raises(ValueError), span(recorder, "W", "0W0"):  # an action that failed is not recorded
        raise ValueError
    assert [(e.kind, e.name) for e in recorder.stop()] == [("B", "0B0")]
