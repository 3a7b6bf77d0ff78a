"""The commit-message rule CI checks (.ci/check_commits.py) and the hook that checks it at commit time."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_commits", ROOT / ".ci" / "check_commits.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)  # type: ignore[union-attr]


def test_a_short_subject_a_blank_line_and_a_body_pass() -> None:
    assert check.problems("Weigh micro-batches by the targets their loss counts\n\nThe why.\n") == []
    assert check.problems("x" * 72) == []


def test_long_subjects_full_stops_and_a_missing_blank_line_are_named() -> None:
    assert check.problems("x" * 73) == ["a subject of 73 characters (at most 72; the why goes in the body)"]
    assert check.problems("Fix it.\nbody") == ["a subject ending with a full stop",
                                              "no blank line between the subject and the body"]
    assert check.problems("# only git's comments\n") == ["an empty subject"]


def test_the_history_since_the_rule_began_follows_it_and_the_hook_refuses_a_long_subject(tmp_path: Path) -> None:
    assert subprocess.run([sys.executable, str(ROOT / ".ci" / "check_commits.py")], cwd=ROOT).returncode == 0
    message = tmp_path / "MSG"
    message.write_text("y" * 80 + "\n")
    done = subprocess.run([str(ROOT / ".githooks" / "commit-msg"), str(message)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and "a subject of 80 characters" in done.stderr
