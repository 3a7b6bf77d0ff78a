"""benchmarks/ab.py: a benchmark's figure read from the base commit's tree and this one's, alternately."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab  # noqa: E402


def test_the_figure_is_the_last_match_of_the_pattern() -> None:
    assert ab.figure_of("step 3 ms\nmedian step 41.5 ms | 780 samples/s", ab.FIGURE) == 41.5
    assert ab.figure_of("nothing timed", ab.FIGURE) is None
    assert ab.figure_of("a=1 b=2", r"b=(\d+)") == 2.0


def test_each_tree_runs_with_its_own_pipeflow_and_one_line_compares_them() -> None:
    command = "import os, pipeflow; print(f'{len(os.path.dirname(pipeflow.__file__))} ms')"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab.py"), "--base", "HEAD", "--rounds", "1", "--",
                           sys.executable, "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    head = float(len(str(ROOT / "pipeflow")))
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("ab: head/base ") and f"head {head:g} ms" in last, last  # this tree's own package
    assert f"base {head:g} ms" not in last  # the base ran from its exported copy


def test_a_base_that_names_no_commit_and_no_rounds_are_refused_in_one_line(capsys) -> None:
    """Issue 57: an unknown base was a 13-line CalledProcessError, --rounds 0 a StatisticsError,
    and a tree (HEAD:docs) was taken as a base."""
    import pytest

    for base in ("no-such-revision", "HEAD:docs"):
        with pytest.raises(SystemExit, match=rf"ab: --base '{base}' names no commit of .*: give a commit"):
            ab.main(["--base", base, "--", "true"])
    with pytest.raises(SystemExit) as stop:
        ab.main(["--base", "HEAD", "--rounds", "0", "--", "true"])
    assert stop.value.code == 2 and "--rounds 0: at least 1 round" in capsys.readouterr().err
