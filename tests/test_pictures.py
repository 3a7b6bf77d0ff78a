"""The schedule pictures and their command line: drawing lives apart from the CLI, and
``python -m pipeflow.schedules.show --help`` answers with a usage text."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pipeflow.schedules.show import main


def test_show_help_prints_a_usage_text_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m pipeflow.schedules.show")
    assert "pipeline.num_microbatches" in out and "--gallery" in out


def test_show_reports_a_bad_command_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["notakey=1"]) == 2
    assert "valid keys" in capsys.readouterr().err


def test_the_runtime_trace_imports_neither_the_cli_nor_matplotlib_until_it_draws(tmp_path) -> None:
    """Tracing a run needs matplotlib only when a step is drawn, and never the command line."""
    code = f"""
import sys
import pipeflow.observability.metrics, pipeflow.observability.trace as trace
print(sorted(m for m in sys.modules if m.startswith("matplotlib")))
step = [(0, 0.0, 1.0, [("F", "0F0", 0.0, 0.5), ("comm", "send", 0.5, 0.6)]), (1, 0.0, 1.0, [("F", "1F1", 0.6, 0.9)])]
trace.draw_step(step, 2, "t", {str(tmp_path / "t.png")!r})
print("pipeflow.schedules.show" in sys.modules, "matplotlib.pyplot" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "False True"]
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_show_draws_the_offload_copies_beside_f_and_b(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """pipeline.offload=auto on one GPipe rank: every group's copy out and back hides in the gaps
    (the makespan is the one without copies), and the picture is written."""
    from pipeflow.schedules.show import show

    out = tmp_path / "gpipe.png"
    path, bubble = show({"name": "gpipe", "ranks": 1, "microbatches": 4, "offload": "auto", "copy_cost": 0.5,
                         "B": 2.0, "out": out})
    assert path == out and out.stat().st_size > 0 and bubble == 0.0
    assert main(["schedule=gpipe", "parallel.pp=1", "pipeline.offload=sometimes", f"--out={out}"]) == 2
    assert "pipeline.offload" in capsys.readouterr().err


def test_an_overlapped_pair_is_drawn_in_two_lanes_of_its_row() -> None:
    """Issue 46: a rank's actions that overlap in time (an overlapped pair's F and B) share its row,
    the earlier on the upper half, the later below; the others fill the row."""
    from pipeflow.schedules.ir import Action
    from pipeflow.schedules.pictures import _pair_lanes

    timeline = [(0, Action("F", 0, 0), 0.0, 1.0), (0, Action("F", 1, 0), 1.0, 3.0), (0, Action("B", 0, 1), 2.0, 4.0),
                (1, Action("F", 0, 1), 1.0, 2.0), (0, Action("W", 0, 1), 4.0, 5.0)]
    assert _pair_lanes(timeline) == {1: 0, 2: 1}
