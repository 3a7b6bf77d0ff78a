"""benchmarks/gpu_check.sh without a GPU: it parses, a dry run stops where CUDA is needed and says
so (exit 2), and a failing step's own exit status reaches the report (not the status of an echo);
its benchmark vs_plain_loop.py answers --help, runs a tiny CPU case to its step-ratio line, and
exits 1 when its correctness check fails; so does offload.py (pipeline.offload none vs all, one
line per mode and the targets' line)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import warm

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(tmp_path: Path, python: str) -> tuple[subprocess.CompletedProcess, str]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "LOGS": str(tmp_path / "logs"), "PYTHON": python,
           "PIPEFLOW_FORCE_WHEELS": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    return done, (tmp_path / "out" / "gpu_check.md").read_text()


def test_the_gpu_check_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_a_dry_run_without_cuda_stops_where_it_needs_cuda_and_says_so(tmp_path: Path) -> None:
    done, report = _run(tmp_path, sys.executable)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device here: stopping before the GPU checks" in done.stdout
    assert "| train.py's imports with this torch | 0 |" in report
    assert "CUDA devices: 0" in report and "overall exit status: 2" in report
    assert "single-GPU" not in report  # nothing on a GPU was claimed


def test_a_failing_step_reports_its_own_exit_status(tmp_path: Path) -> None:
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/bash\ncase "$*" in *pipeflow.run.builder*) echo broken >&2; exit 3;; esac\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    done, report = _run(tmp_path, str(wrapper))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED (exit status 3): train.py's imports with this torch" in done.stdout
    assert "exit status 3 after" in report and "| train.py's imports with this torch | 3 |" in report
    assert "broken" in report and "overall exit status: 1" in report


PLAIN = ROOT / "benchmarks" / "overhead" / "vs_plain_loop.py"
TINY = ["--case", "n_layer=2", "n_embd=32", "seq=16", "batch=4", "m=2", "--rounds", "1", "--steps", "1",
        "--warmup", "0"]


def _benchmark(script: Path, *args: str) -> subprocess.CompletedProcess:
    """`python script args` on a fork of the warm server (tests/warm.py)."""
    return warm.run_python([str(script), *args], cwd=ROOT, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _plain(*args: str) -> subprocess.CompletedProcess:
    return _benchmark(PLAIN, *args)


def _in_process(script: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                *args: str) -> tuple[int, str]:
    """(exit status, stdout) of `python script args` run as its main(argv) in this process: its
    imports (torch, pipeflow) are loaded here already and it starts and destroys its own one-rank
    group, so no process start-up is paid (each test below that keeps a subprocess covers
    `python benchmarks/<script>` as a process)."""
    monkeypatch.syspath_prepend(str(script.parent))  # as `python benchmarks/<group>/x.py` has it
    spec = importlib.util.spec_from_file_location(f"_in_process_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    capsys.readouterr()
    try:
        status = module.main(list(args)) or 0
    except SystemExit as stop:  # argparse: --help
        status = stop.code or 0
    return status, capsys.readouterr().out


def test_the_gpu_check_runs_the_plain_loop_benchmark_on_cuda() -> None:
    assert "benchmarks/overhead/vs_plain_loop.py --device cuda" in SCRIPT.read_text()


def test_vs_plain_loop_answers_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    status, out = _in_process(PLAIN, monkeypatch, capsys, "--help")
    assert status == 0, out
    assert out.startswith("usage: python benchmarks/overhead/vs_plain_loop.py") and "--case" in out


def test_vs_plain_loop_tiny_cpu_run_checks_then_prints_a_step_ratio_line(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture) -> None:
    status, out = _in_process(PLAIN, monkeypatch, capsys, "--device", "cpu", *TINY)
    assert status == 0, out
    assert "check: first-step loss" in out and "rel diff" in out and ": ok;" in out
    assert re.search(r"^GPT 2x32 h4, seq 16, batch 4, m 2, fp32, cpu \| plain [\d.]+ ms \| pipeflow [\d.]+ ms \| "
                     r"step ratio [\d.]+ \| predicted [\d.]+ ms \(\d+% of measured\)$", out, re.M), out
    assert "peak ratio" not in out  # the allocator peak is CUDA's


def test_the_gpu_check_runs_the_compiled_comparison_on_cuda() -> None:
    assert "benchmarks/overhead/vs_plain_loop.py --device cuda --compile --repeat-backward" in SCRIPT.read_text()


def test_vs_plain_loop_compiled_tiny_cpu_run_prints_every_ratio() -> None:
    done = _plain("--device", "cpu", *TINY, "--compile", "--compile-backend", "aot_eager", "--repeat-backward")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check: first-step loss and grad norm against the compiled plain loop" in done.stdout and ": ok;" in done.stdout
    assert re.search(r"^GPT 2x32 h4, .* \| pipeflow eager [\d.]+ ms \| pipeflow compiled [\d.]+ ms \| plain compiled "
                     r"[\d.]+ ms \| zb_h1 compiled [\d.]+ ms \| zb_h1 compiled, backward repeated [\d.]+ ms \| "
                     r"compiled/eager [\d.]+x \| vs compiled plain [\d.]+ \| zb_h1/1f1b [\d.]+ \| "
                     r"repeated/split zb_h1 [\d.]+ .*\| graphs compiled during the timed rounds 0$", done.stdout, re.M), \
        done.stdout


def test_vs_plain_loop_exits_1_when_the_losses_disagree(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    status, out = _in_process(PLAIN, monkeypatch, capsys, "--device", "cpu", *TINY, "--rtol", "-1")  # nothing agrees
    assert status == 1, out  # within a negative tolerance
    assert "DISAGREE" in out and "step ratio" not in out


OFFLOAD = ROOT / "benchmarks" / "features" / "offload.py"
OFFLOAD_TINY = ["--case", "n_layer=2", "n_embd=32", "seq=16", "batch=8", "m=4", "--rounds", "1", "--steps", "1",
                "--warmup", "0"]


def _offload(*args: str) -> subprocess.CompletedProcess:
    return _benchmark(OFFLOAD, *args)


ROOFLINE = ROOT / "benchmarks" / "gpu_checks" / "roofline_probe.py"


def test_the_gpu_check_measures_the_planners_roofline_terms(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """The roofline probe (matmul widths, a memory pass, SDPA forward and backward, the loss beside
    the planner's prediction) runs on the lent GPU; on tiny CPU shapes its rows come out whole."""
    assert 'benchmarks/gpu_checks/roofline_probe.py --out "$OUT/RESULTS.md"' in SCRIPT.read_text()
    out = tmp_path / "results.md"
    status, text = _in_process(ROOFLINE, monkeypatch, capsys, "--device", "cpu", "--quick", "--preset", "h100_sxm",
                               "--repeats", "1", "--out", str(out))
    assert status == 0, text
    number = r"[\d.]+(?:e[-+]\d+)?"
    rows = re.findall(rf"^\| (matmul|elementwise|sdpa forward \+ backward|sdpa forward|cross-entropy)[^|]* \| {number} "
                      rf"\| ({number}) \| {number} \|$", text, re.M)
    assert [kind for kind, _ in rows].count("matmul") == 2 and len(rows) == 8, text
    assert all(float(predicted) > 0 for _, predicted in rows)
    assert "against the h100_sxm preset" in out.read_text()


def test_the_gpu_check_runs_the_offload_benchmark_on_cuda() -> None:
    text = SCRIPT.read_text()
    assert "benchmarks/features/offload.py --device cuda --out \"$OUT/RESULTS.md\"" in text


def test_offload_answers_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    status, out = _in_process(OFFLOAD, monkeypatch, capsys, "--help")
    assert status == 0, out
    assert out.startswith("usage: python benchmarks/features/offload.py") and "--modes" in out


def test_offload_tiny_cpu_run_checks_then_prints_one_line_per_mode(tmp_path: Path) -> None:
    out = tmp_path / "results.md"
    done = _offload(*OFFLOAD_TINY, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^host link \(memcpy on the compute thread\): [\d.]+ GB/s to the host, [\d.]+ GB/s back, "
                     r"not overlapped$", done.stdout, re.M), done.stdout
    assert done.stdout.count("first-step loss") == 2 and "DISAGREE" not in done.stdout
    field = r"[\d.]+ MiB \(predicted [\d.]+ MiB, \d+%\)"
    for mode, groups in (("none", 0), ("all", 4)):
        assert re.search(rf"^GPT 2x32 h4, seq 16, batch 8, m 4, gpipe, fp32, cpu \| offload={mode} \| groups {groups}/4 "
                         rf"\| step [\d.]+ ms \(predicted [\d.]+ ms, \d+%\) \| peak {field} \| offloaded [\d.]+ "
                         rf"MiB/step \(predicted [\d.]+\) \| vs none: step [\d.]+x, peak [\d.]+x$", done.stdout, re.M), \
            done.stdout
    assert re.search(r"^targets: auto step vs none: not run \| step within 10% of predicted: .* \| peak within 10% of "
                     r"predicted: none [\d.]+%, all [\d.]+% \((does not )?hold(s)?\) \| peak cut vs none: all \d+% \([\d.]+x\)$",
                     done.stdout, re.M), done.stdout  # tensor bytes: the prediction's own quantity
    assert "tensor peak" not in done.stdout  # the allocator's peak beside it is CUDA's
    assert "offload=all" in out.read_text() and "### Activation offload" in out.read_text()


def test_offload_exits_1_when_the_losses_disagree(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    status, out = _in_process(OFFLOAD, monkeypatch, capsys, *OFFLOAD_TINY, "--modes", "none", "--rtol", "-1")  # nothing
    assert status == 1, out  # agrees within a negative tolerance
    assert "DISAGREE" in out and "| offload=" not in out
