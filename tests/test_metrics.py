"""Measured figures from events (pure), the Chrome trace and timeline of a step, the console."""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import matplotlib.image
import pytest

from pipeflow.observability.console import setup_logging, step_line, summary_line
from pipeflow.observability.figures import RankFigures, pipeline_bubble, rank_bubble, step_figures
from pipeflow.observability.trace import RankStep, chrome_trace, draw_step
from pipeflow.planning.layout import predict
from pipeflow.config.schema import MetricsConfig, ParallelConfig
from pipeflow.runtime.events import EventRecorder, TimedEvent
from pipeflow.schedules import build_schedule, simulate


def ev(kind: str, name: str, start: float, end: float) -> TimedEvent:
    return TimedEvent(kind, name, start, end)


def test_step_figures_split_the_step_into_compute_comm_wait_and_idle() -> None:
    events = [
        ev("comm", "recv", 1.0, 3.0),  # idle 0..1 before it
        ev("F", "1F0", 3.0, 4.0),
        ev("comm", "send", 4.5, 5.0),  # idle 4..4.5
        ev("B", "1B0", 5.0, 7.0),
        ev("W", "1W0", 7.0, 7.5),
    ]  # idle 7.5..10 after the last event
    figures = step_figures(events, 0.0, 10.0)
    assert figures == RankFigures(compute_s=3.5, comm_wait_s=2.5, idle_s=4.0, step_s=10.0, span_s=6.5)
    assert figures.compute_s + figures.comm_wait_s + figures.idle_s == pytest.approx(figures.step_s)


def test_idle_time_counts_overlapping_events_once_and_an_empty_step_is_all_idle() -> None:
    figures = step_figures([ev("F", "0F0", 1.0, 4.0), ev("comm", "x", 2.0, 3.0), ev("B", "0B0", 6.0, 8.0)], 0.0, 9.0)
    assert figures.idle_s == pytest.approx(1.0 + 2.0 + 1.0)
    assert step_figures([], 2.0, 5.0) == RankFigures(0.0, 0.0, 3.0, 3.0, 0.0)


def test_bubbles_are_idle_fractions_clamped_to_zero_one() -> None:
    assert rank_bubble(3.0, 4.0) == pytest.approx(0.25)
    assert rank_bubble(5.0, 4.0) == 0.0 and rank_bubble(0.0, 0.0) == 0.0
    assert pipeline_bubble([3.0, 2.0], [4.0, 3.0]) == pytest.approx(1 - 5.0 / 8.0)
    assert pipeline_bubble([], []) == 0.0


def simulated_events(name: str, p: int, m: int, **kwargs) -> tuple[list[list[TimedEvent]], float]:
    """A simulated run as each rank would record it: its actions, and a first comm event from
    the step start (0) to its first action (the wait for the first activation)."""
    schedule = build_schedule(name, p, m, **kwargs)
    sim = simulate(schedule, costs={"F": 1.0, "B": 2.0, "W": 1.5})
    per_rank: list[list[TimedEvent]] = [[] for _ in range(p)]
    for rank, action, start, end in sim.timeline:
        per_rank[rank].append(ev(action.kind, str(action), start, end))
    for events in per_rank:
        events.insert(0, ev("comm", "recv", 0.0, min(e.start for e in events)))
    return per_rank, sim.bubble


@pytest.mark.parametrize(("name", "kwargs"), [("1f1b", {}), ("gpipe", {}), ("zb_h1", {}), ("interleaved_1f1b", {"stages_per_rank": 2})])
def test_measured_bubble_of_a_simulated_run_equals_the_simulators_bubble(name: str, kwargs: dict) -> None:
    per_rank, expected = simulated_events(name, 4, 8, **kwargs)
    figures = [step_figures(events, 0.0, max(e.end for e in events)) for events in per_rank]
    assert pipeline_bubble([f.compute_s for f in figures], [f.span_s for f in figures]) == pytest.approx(expected)
    assert 0.0 < expected < 1.0


def traced_steps(name: str, p: int, m: int, steps: tuple[int, ...] = (3,)) -> dict[int, list[RankStep]]:
    per_rank, _ = simulated_events(name, p, m)
    return {
        step: [(r, 10.0 * step, 10.0 * step + 40, [(e.kind, e.name, 10.0 * step + e.start / 1e3, 10.0 * step + e.end / 1e3)
                                               for e in events]) for r, events in enumerate(per_rank)]
        for step in steps
    }


def test_chrome_trace_has_one_track_per_rank_and_every_action_of_the_schedule() -> None:
    p, m = 4, 6
    trace = json.loads(json.dumps(chrome_trace(traced_steps("zb_h1", p, m, steps=(2, 3)))))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in complete} == {(r, 0) for r in range(p)}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r} (pipeline rank {r})" for r in range(p)}
    for step in (2, 3):
        for r in range(p):
            mine = [e for e in complete if e["pid"] == r and e["args"]["step"] == step]
            assert {kind: sum(e["cat"] == kind for e in mine) for kind in "FBW"} == {"F": m, "B": m, "W": m}
            assert sorted(e["args"]["microbatch"] for e in mine if e["cat"] == "F") == list(range(m))
            assert {e["args"]["stage"] for e in mine if e["cat"] in "FBW"} == {r}
    assert min(e["ts"] for e in complete) == 0.0 and all(e["dur"] >= 0 for e in complete)
    assert all(isinstance(e["ts"], float) for e in complete)


def test_timeline_picture_of_a_step_decodes_and_is_not_blank(tmp_path: Path) -> None:
    steps = traced_steps("1f1b", 4, 8)
    path = draw_step(steps[3], 4, "measured 1f1b", str(tmp_path / "timeline_step3.png"))
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 800 and image[..., :3].std() > 0.05


def test_predicted_bubble_without_profiles_is_the_simulators_with_equal_costs() -> None:
    schedule = build_schedule("1f1b", 4, 8)
    prediction = predict(schedule, [range(s, s + 1) for s in range(4)], None)
    assert prediction.bubble == pytest.approx(simulate(schedule, costs={"F": 1, "B": 1, "W": 1}).bubble)
    assert prediction.bubble == pytest.approx(3 / 11)  # B costs B + W: (p-1)/(m+p-1)


def test_console_lines_name_the_figures() -> None:
    line = step_line(25, 300, 2.34123, 0.8123, 3e-3, 0.041, 32, 2048, 0.301, 0.273)
    assert line == ("step   25/300 | loss 2.3412 | grad norm 0.812 | lr 3.00e-03 | 41 ms/step | "
                    "780 samples/s 49951 tokens/s | bubble 30% (predicted 27%)")
    summary = {"samples_per_s": 780.4, "tokens_per_s": None, "step_time_s": 0.041, "bubble_measured": 0.3,
               "bubble_predicted": 0.273, "peak_memory_mb": [812.2, 640.0]}
    assert summary_line(summary) == ("median step 41 ms | predicted step (calibrated) - ms | 780 samples/s | "
                                     "bubble 30% measured, 27% predicted | process peak memory (RSS) per pipeline rank 812, 640 MB")
    summary["step_calibrated_s"] = 0.0398
    assert summary_line(summary).startswith("median step 41 ms | predicted step (calibrated) 40 ms | 780 samples/s")


def test_non_zero_ranks_log_only_warnings_tagged_with_their_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(2)
        logging.getLogger("pipeflow").info("not shown")
        logging.getLogger("pipeflow").warning("stage 1 is slow")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.captureWarnings(False)
    assert "not shown" not in err.getvalue()
    assert "[rank 2]" in err.getvalue() and "WARNING stage 1 is slow" in err.getvalue()


def test_each_log_line_reaches_the_stream_in_one_write() -> None:
    """With unbuffered streams (PYTHONUNBUFFERED=1) every write is a syscall: a line and its
    newline written apart let another rank's line land between them in a shared pipe (found in
    CI: one rank's error line spliced onto another's)."""
    from pipeflow.observability.console import RankFilter, TqdmHandler

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    stream = Writes()
    handler = TqdmHandler(stream)
    handler.addFilter(RankFilter(1))
    handler.setFormatter(logging.Formatter("[rank %(rank)d] %(message)s"))
    handler.handle(logging.makeLogRecord({"msg": "rank 1 failed: X", "levelno": logging.ERROR}))
    assert stream.calls == ["[rank 1] rank 1 failed: X\n"]


def test_clock_offsets_are_zero_on_rank_0s_host_and_a_median_per_other_host() -> None:
    from pipeflow.observability.trace import host_offsets

    hosts = ["a", "a", "b", "b"]
    rounds = [[10.0, 10.1, 15.0, 15.2], [20.0, 19.9, 25.1, 25.0], [30.0, 30.0, 34.0, 35.0]]
    assert host_offsets(hosts, rounds) == [0.0, 0.0, 5.0, 5.0]  # median of 5.0 5.2 5.1 5.0 4.0 5.0
    assert host_offsets(["a", "a"], []) == [0.0, 0.0]


def test_progress_bar_of_a_resumed_run_starts_at_the_resumed_step() -> None:
    from types import SimpleNamespace

    from pipeflow.observability.metrics import RunMetrics

    fake = SimpleNamespace(show_bar=True, bar=None, first_step=None, max_steps=10, recorder=EventRecorder(),
                           timed=lambda step: True)
    RunMetrics.begin_step(fake, 6)  # the first step this process runs after resuming at step 6
    assert (fake.bar.n, fake.bar.total) == (6, 10)
    fake.bar.close()


def test_run_metrics_measure_what_the_recorder_collected_during_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """begin_step switches the recorder on, end_step takes its events off and adds up their figures."""
    from types import SimpleNamespace

    from pipeflow.observability import metrics

    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    cfg = SimpleNamespace(
        metrics=MetricsConfig(trace_steps=[2], tensorboard=False, progress_bar=False),
        train=SimpleNamespace(log_every=100, max_steps=10), parallel=ParallelConfig(),
    )
    recorder = EventRecorder()
    schedule = build_schedule("1f1b", 2, 2)
    prediction = predict(schedule, [range(0, 1), range(1, 2)], None)
    run = metrics.RunMetrics(cfg, recorder, 0, 2, None, "unused", prediction, (8, None))
    assert run.predicted == prediction.bubble
    run.begin_step(2)  # not a log step: nothing is gathered
    assert recorder.on
    recorder.record("comm", "recv", run._start + 1.0, run._start + 2.0)  # filled by hand, as the pipeline would
    recorder.record("F", "0F0", run._start + 2.0, run._start + 3.0)
    run.end_step(2, loss=1.0, grad_norm=1.0, lr=0.1)
    assert not recorder.on
    assert (run.interval.compute_s, run.interval.comm_wait_s, run.interval.span_s) == pytest.approx((1.0, 1.0, 2.0))
    assert [kind for kind, *_ in run.traced[2][2]] == ["comm", "F"]


def test_transfer_waits_are_split_over_the_links_they_waited_on_and_a_far_slower_link_named() -> None:
    from pipeflow.observability.figures import wait_by_link
    from pipeflow.observability.metrics import link_wait_line
    from pipeflow.runtime.parallel.mesh_order import MeshGrid

    events = [ev("comm", "recv:act3[0>1]<-r0; send:grad2[1>0]->r0", 0.0, 1.0),
              ev("comm", "recv:act3[1>2]<-r1; recv:grad1[3>2]<-r3", 1.0, 3.0), ev("F", "1F0", 3.0, 4.0)]
    assert wait_by_link(events, 2) == {(0, 2): 1.0, (1, 2): 1.0, (2, 3): 1.0}
    line = link_wait_line({(0, 1): 0.001, (1, 2): 0.009, (2, 3): 0.0011}, MeshGrid(1, 4))
    assert line.startswith("transfer waits per link, ms per step (both ranks of each, the pipeline of rank 0): "
                           "0-1 1.00; 1-2 9.00; 2-3 1.10")
    assert line.endswith("waited on far more than the median link: 1-2 8.2x (a slow link or a slow neighbour)")
