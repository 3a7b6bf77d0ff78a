"""Every command answers --help with a usage text and exit status 0: the `python -m pipeflow.…`
commands in-process (their main(argv)), train.py (Hydra's --help, hydra.help in configs/) in one
subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from pipeflow.data import prepare
from pipeflow.run import checkpoint, plan
from pipeflow.schedules import compare, show

ROOT = Path(__file__).resolve().parents[1]

COMMANDS: dict[str, Callable] = {
    "pipeflow.plan": plan.main,
    "pipeflow.checkpoint": checkpoint.main,
    "pipeflow.data.prepare": prepare.main,
    "pipeflow.schedules.compare": compare.main,
    "pipeflow.schedules.show": show.main,
}


def _exit_status(main: Callable, argv: list[str]) -> int:
    """main(argv)'s exit status, whether it returns it or raises SystemExit (argparse)."""
    try:
        return main(argv) or 0
    except SystemExit as stop:
        return stop.code or 0


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_module_command_answers_help_with_usage_and_exit_0(command: str, capsys: pytest.CaptureFixture) -> None:
    assert _exit_status(COMMANDS[command], ["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage:" in out, out


def test_plan_help_shows_the_usage_the_groups_and_the_plan_keys(capsys: pytest.CaptureFixture) -> None:
    assert plan.main(["model=gpt", "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m pipeflow.plan [key=value ...]")
    assert "schedule: 1f1b," in out and "memory_limit_gb:" in out and "parallel.pp" in out


def test_plan_refuses_an_unknown_option_with_its_usage(capsys: pytest.CaptureFixture) -> None:
    assert plan.main(["--top", "5"]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m pipeflow.plan" in err and "'--top'" in err


def test_train_py_help_is_hydras_help_with_our_usage_and_config_groups(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("usage: torchrun --nproc-per-node N train.py [key=value ...]"), run.stdout
    assert "schedule: 1f1b," in run.stdout and "model: " in run.stdout  # $APP_CONFIG_GROUPS
    assert "hydra.run.dir" in run.stdout and "num_microbatches: 8" in run.stdout
    assert list(tmp_path.iterdir()) == []  # --help makes no directory


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_script_compiles_on_this_python(script: str) -> None:
    """A script that does not even parse (benchmarks/schedule_efficiency.py had a quote inside a
    string of the same quotes, fine in 3.12's f-strings only) fails here, not on a lent GPU."""
    source = (ROOT / "benchmarks" / script).read_text()
    compile(source, script, "exec")
