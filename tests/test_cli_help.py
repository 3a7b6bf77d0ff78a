"""Every command answers --help with a usage text and exit status 0: the `python -m pipeflow.…`
commands in-process (their main(argv)), train.py (Hydra's --help, hydra.help in configs/) in one
warm process."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import warm

from pipeflow.data import prepare
from pipeflow.checkpoint import saving as checkpoint
from pipeflow.commands import generate, launch
from pipeflow.commands.plan import command as plan, help as plan_help
from pipeflow.schedules import compare, show

ROOT = Path(__file__).resolve().parents[1]

COMMANDS: dict[str, Callable] = {
    "pipeflow.plan": plan.main,
    "pipeflow.checkpoint": checkpoint.main,
    "pipeflow.launch": launch.main,
    "pipeflow.generate": generate.main,
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


def test_plan_help_writes_every_keys_default_as_an_override_takes_it(capsys: pytest.CaptureFixture) -> None:
    """A default made by a factory was shown as ``offload: <dataclasses._MISSING_TYPE object at 0x...>``
    (issue 38): every plan.* key is listed with its default in YAML's flow style, and the comment
    lines above a key in the schema's source come with it."""
    import dataclasses

    from pipeflow.config.schema import PlanConfig

    assert plan.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "object at 0x" not in out and "_MISSING_TYPE" not in out, out
    keys = out.split("== The planner's keys (plan.<key>=value, defaults) ==\n")[1].split("\n\n")[0].splitlines()
    shown = {line.split(":")[0]: line.split(": ", 1)[1].split("  #")[0] for line in keys if not line.startswith("#")}
    assert list(shown) == [f.name for f in dataclasses.fields(PlanConfig)]
    assert shown["offload_modes"] == "[none]" and shown["top"] == "10" and shown["tp_sizes"] == "null", shown
    assert keys[keys.index("offload_modes: [none]") - 1].startswith("# null: measured on this machine's device")

    @dataclasses.dataclass
    class Made:
        required: int
        flags: dict = dataclasses.field(default_factory=lambda: {"a": True, "b": None})
        steps: list = dataclasses.field(default_factory=lambda: [1, 2.5, "x"])

    assert [plan_help.default_text(f) for f in dataclasses.fields(Made)] == ["???", "{a: true, b: null}", "[1, 2.5, x]"]


def test_plan_refuses_an_unknown_option_with_its_usage(capsys: pytest.CaptureFixture) -> None:
    assert plan.main(["--top", "5"]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m pipeflow.plan" in err and "'--top'" in err


def test_train_py_help_is_hydras_help_with_our_usage_and_config_groups(tmp_path: Path) -> None:
    run = warm.run_python([str(ROOT / "train.py"), "--help"], cwd=tmp_path, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("usage: torchrun --nproc-per-node N train.py [key=value ...]"), run.stdout
    assert "schedule: 1f1b," in run.stdout and "model: " in run.stdout  # $APP_CONFIG_GROUPS
    assert "hydra.run.dir" in run.stdout and "num_microbatches: 8" in run.stdout
    assert list(tmp_path.iterdir()) == []  # --help makes no directory


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT / "benchmarks")) for p in (ROOT / "benchmarks").rglob("*.py")))
def test_every_benchmark_script_compiles_on_this_python(script: str) -> None:
    """A script that does not even parse (benchmarks/predictions/schedule_efficiency.py had a quote inside a
    string of the same quotes, fine in 3.12's f-strings only) fails here, not on a lent GPU."""
    source = (ROOT / "benchmarks" / script).read_text()
    compile(source, script, "exec")
