"""One `torchrun train.py` of 4 sleep-stages under 1F1B, read back: TensorBoard events, the
Chrome trace, the timeline picture and the console; and `train.py --cfg job`."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import warm
from tests.test_cli import ROOT, torchrun

P, M, STEPS, LOG_EVERY, TRACED = 4, 8, 6, 2, 3
LOGGED = [0, 2, 4, 5]  # every LOG_EVERY steps and the last
SLEEP = ["model=sleep", "data=gaussian", "model.forward_ms=40", "model.backward_ms=40", "model.weight_ms=40"]
PER_STAGE = ("compute_ms", "comm_wait_ms", "idle_ms", "step_ms", "bubble", "peak_memory_mb")
TRAIN = ("loss", "lr", "grad_norm", "samples_per_s", "step_time_ms")
# per global rank, once, at the measured step (metrics.memory_steps, default [1]); no GPU: no allocator peak
MEMORY = ("params_mb", "grads_mb", "optimizer_mb", "tensor_mb", "tensor_predicted_mb", "tensor_resident_mb",
          "peak_params_mb", "activations_mb", "comm_mb", "rss_mb")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path_factory.mktemp("run")
    done = torchrun(P, *SLEEP, f"pipeline.num_microbatches={M}", f"train.max_steps={STEPS}",
                    f"train.log_every={LOG_EVERY}", "train.eval_every=0", "train.eval_batches=1",
                    f"metrics.trace_steps=[{TRACED}]", f"train.run_dir={run_dir}", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, run_dir


@pytest.fixture(scope="module")
def scalars(run) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run[1] / "tb"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_tag_is_written_once_per_log_interval_by_one_writer(run, scalars) -> None:
    expected = {f"train/{name}" for name in TRAIN} | {"pipeline/bubble_measured", "pipeline/bubble_predicted"}
    expected |= {f"stage/{r}/{name}" for r in range(P) for name in PER_STAGE}
    memory = {f"memory/{g}/{name}" for g in range(P) for name in MEMORY}
    at_end = {f"pipeline/step_{name}_ms" for name in ("measured", "predicted", "calibrated")}
    at_end |= {f"stage/{r}/program_end_{name}_ms" for r in range(P) for name in ("measured", "calibrated")}
    at_end |= {f"link/{r}-{r + 1}/comm_wait_ms" for r in range(P - 1)}  # each link's transfer waits
    evaluations = {"eval/loss"}  # the first and the final evaluation (train.eval_every=0); no perplexity: no tokens
    expected |= {f"straggler/rank{r}/compute_ratio" for r in range(P)}  # metrics.straggler_factor's watch
    waited = {tag for tag in scalars if re.fullmatch(r"link/\d+-\d+/measured_mbps", tag)}  # links waited on
    assert set(scalars) == expected | memory | at_end | evaluations | waited  # no tokens/s: gaussian data has no tokens
    assert [step for step, _ in scalars["eval/loss"]] == [0, STEPS]  # the steps trained when each was taken
    assert all([step for step, _ in points] == LOGGED for tag, points in scalars.items() if tag in expected)
    assert all([step for step, _ in scalars[tag]] == [1] for tag in memory)
    assert all([step for step, _ in scalars[tag]] == [STEPS - 1] for tag in at_end)
    assert len(list((run[1] / "tb").iterdir())) == 1


def test_logged_values_are_sane(scalars) -> None:
    value = lambda tag: [v for _, v in scalars[tag]]  # noqa: E731
    assert all(math.isfinite(v) for v in value("train/loss"))
    for step_ms, samples_s in zip(value("train/step_time_ms"), value("train/samples_per_s")):
        assert samples_s == pytest.approx(64 / (step_ms / 1e3), rel=1e-3)  # gaussian: batch of 64
    bubbles = value("pipeline/bubble_measured") + value("pipeline/bubble_predicted")
    bubbles += [v for r in range(P) for v in value(f"stage/{r}/bubble")]
    assert all(0.0 <= b <= 1.0 for b in bubbles)
    for r in range(P):
        parts = zip(value(f"stage/{r}/compute_ms"), value(f"stage/{r}/comm_wait_ms"), value(f"stage/{r}/idle_ms"))
        for (compute, comm, idle), step_ms in zip(parts, value("train/step_time_ms")):
            assert compute + comm + idle == pytest.approx(step_ms, rel=0.10)
            assert compute > 0.5 * M * 40  # at least every F of 40 ms (and stage 0's B, its W only)
        assert all(mb > 10 for mb in value(f"stage/{r}/peak_memory_mb"))


def test_tensor_memory_is_measured_beside_its_prediction(scalars) -> None:
    """One quantity on both sides: the measured in-step peak within 10% of the predicted; AdamW's
    state twice the parameters (and a 4-byte step counter each), all in the peak; RSS (mostly the
    torch runtime) far above."""
    value = lambda tag: scalars[tag][0][1]  # noqa: E731
    for g in range(P):
        measured, predicted = value(f"memory/{g}/tensor_mb"), value(f"memory/{g}/tensor_predicted_mb")
        assert measured > 0 and abs(predicted / measured - 1) < 0.10, (g, measured, predicted)
        assert value(f"memory/{g}/optimizer_mb") >= 2 * value(f"memory/{g}/params_mb") > 0
        assert value(f"memory/{g}/grads_mb") == value(f"memory/{g}/params_mb")
        held = sum(value(f"memory/{g}/{name}") for name in ("params_mb", "grads_mb", "optimizer_mb"))
        assert measured >= held
        assert value(f"memory/{g}/rss_mb") > 10 * measured


def test_measured_bubble_is_within_five_points_of_the_prediction_for_1f1b_p4_m8(scalars) -> None:
    predicted = scalars["pipeline/bubble_predicted"][0][1]
    steady = sorted(v for step, v in scalars["pipeline/bubble_measured"] if step > 0)
    assert abs(steady[len(steady) // 2] - predicted) < 0.05, (steady, predicted)


def test_trace_has_one_track_per_rank_with_m_forwards_and_backwards(run) -> None:
    trace = json.loads((run[1] / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == set(range(P)) and {e["tid"] for e in complete} == {0}
    for r in range(P):
        mine = sorted((e for e in complete if e["pid"] == r), key=lambda e: e["ts"])
        assert {kind: sum(e["cat"] == kind for e in mine) for kind in ("F", "B", "W")} == {"F": M, "B": M, "W": 0}
        assert all(e["args"]["step"] == TRACED and e["dur"] > 0 for e in mine)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(mine, mine[1:]))  # one track never overlaps
    forward = {(e["pid"], e["args"]["microbatch"]): e for e in complete if e["cat"] == "F"}
    for r in range(1, P):  # aligned clocks: stage r's F of micro-batch i starts after stage r-1's ended
        for i in range(M):
            earlier = forward[r - 1, i]
            assert forward[r, i]["ts"] >= earlier["ts"] + earlier["dur"] - 2000  # 2 ms of clock skew


def test_timeline_picture_is_written_and_sent_to_tensorboard(run) -> None:
    image = matplotlib.image.imread(run[1] / f"timeline_step{TRACED}.png")
    assert image.shape[0] > 200 and image.shape[1] > 1000 and image[..., :3].std() > 0.05
    events = EventAccumulator(str(run[1] / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("timeline")] == [TRACED]


def test_console_has_one_line_per_interval_from_rank_0_and_the_summary(run) -> None:
    out = run[0].stdout
    lines = re.findall(r"^\[rank (\d)\] .* INFO step +(\d+)/6 \| loss .* bubble \d+% \(predicted \d+%\)$", out, re.M)
    assert lines == [("0", str(step)) for step in LOGGED], out[-3000:]
    assert re.search(r"median step \d+ ms \| predicted step \(calibrated\) \d+ ms \| \d+ samples/s \| bubble \d+% measured, "
                     r"\d+% predicted \| process peak memory \(RSS\) per pipeline rank \d+, \d+, \d+, \d+ MB", out)
    assert "INFO" not in run[0].stderr  # other ranks log warnings only
    # the start-of-run line predicts the whole step: the layers and the runtime's measured costs
    assert re.search(r"INFO pipeline: 4 ranks, .* \(profiled layers and the measured runtime\), predicted step "
                     r"[\d.]+ ms \(posting (ahead|at_step), transfer [\d.]+ ms \+ [\d.]+ ms/MB", out)


def test_cfg_job_prints_the_resolved_config_with_the_metrics_group() -> None:
    done = warm.run_python(["train.py", "--cfg", "job", "metrics.trace_steps=[5]"], cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^metrics:\n  tensorboard: true\n  trace_steps:\n  - 5\n  progress_bar: true",
                     done.stdout, re.M), done.stdout


def test_a_single_process_token_run_logs_tokens_per_s(tmp_path: Path) -> None:
    """`python train.py` (a pipeline of one rank) on token data: tokens/s = samples/s x seq_len."""
    done = warm.run_python(["train.py", "model.n_layer=1", "model.n_embd=16", "data.batch_size=8",
                           "data.seq_len=16", "data.num_tokens=5000", "pipeline.num_microbatches=2",
                           "pipeline.profile=false", "train.max_steps=3", "train.log_every=1", "train.eval_every=0",
                           "train.eval_batches=1", "metrics.trace_steps=[1]", f"train.run_dir={tmp_path}"],
                          cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    samples = [e.value for e in events.Scalars("train/samples_per_s")]
    tokens = [e.value for e in events.Scalars("train/tokens_per_s")]
    assert len(tokens) == 3 and tokens == pytest.approx([16 * s for s in samples], rel=1e-4)
    assert [e.value for e in events.Scalars("pipeline/bubble_predicted")] == [0.0] * 3
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert sum(e["ph"] == "X" and e["cat"] == "F" for e in trace["traceEvents"]) == 2


def test_the_run_writes_its_measured_costs_and_a_calibrated_prediction(run, scalars) -> None:
    from pipeflow.planning.calibration import Calibration

    cal = Calibration.from_json((run[1] / "costs.json").read_text())
    assert cal.steps == STEPS - 2 and cal.posting in ("ahead", "at_step")  # the warm-up steps are left out
    assert all(f >= 0.040 for f in cal.forward)  # sleeps: F 40 ms, B + W 80 ms (stage 0: its W only)
    assert cal.backward[0] >= 0.040 and all(b >= 0.080 for b in cal.backward[1:])
    assert cal.meta["schedule"] == "1f1b" and cal.meta["num_microbatches"] == M and len(cal.meta["profiles"]) == P
    ring = cal.meta["links"][0]  # what plan.hardware=... plan.calibration=<run dir> puts over a preset's link
    assert ring["ranks"] == list(range(P)) and len(set(ring["hosts"])) == 1 and ring["latency_s"] > 0
    calibrated = scalars["pipeline/step_calibrated_ms"][0][1]
    assert math.isfinite(calibrated) and calibrated > 0
