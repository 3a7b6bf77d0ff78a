"""The docs cannot rot: the configuration and error reference are what the code says now, the
pages keep their size limits, and every command of the start path (docs/start/*.md) runs.

How the start path is checked (``scripts/start_path.py`` sorts the commands):

- one-process commands (``python train.py ...``, ``python -m pipeflow.plan ...``,
  ``python -m pipeflow.data.prepare ...``) run for real, in page order, in one warm process, with
  small settings in place of the page's (``train.max_steps=2``, ``plan.repeats=1``, ...), in a
  scratch folder holding the files the pages ask you to write;
- multi-process and several-machine commands (``torchrun ... train.py``,
  ``examples/multinode.sh``) and the planner on such a run's costs (``plan.calibration=``) are
  not launched: their overrides are composed with Hydra (every key exists, every value fits its
  schema; a sweep's every combination); a ``torchrun <script.py>`` script must exist and compile;
- ``pip install`` is the install this suite runs in.
"""
from __future__ import annotations

import importlib.util
import itertools
import py_compile
import re
import sys
from pathlib import Path

import pytest
import warm

ROOT = Path(__file__).resolve().parent.parent
KB = 1024


def _script(name: str):
    """scripts/<name>.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current() -> None:
    generator = _script("config_reference")
    stale = generator.stale_pages(generator.render())
    assert not stale, f"stale: {', '.join(stale)}; run `python scripts/config_reference.py` to regenerate"


def test_hugging_face_families_page_is_current() -> None:
    """docs/reference/hf-families.md is made from tests/test_hf.py's cases (issue 58): a family added
    to model=hf without a test, or a case added without regenerating the page, fails here."""
    pytest.importorskip("transformers")
    generator = _script("hf_families")
    assert generator.PAGE.read_text() == generator.render(), "stale: run `python scripts/hf_families.py`"


def _user_pages() -> list[Path]:
    """README.md and docs/**/*.md outside docs/dev/."""
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "dev" not in p.relative_to(ROOT / "docs").parts]
    return [ROOT / "README.md", *docs]


def test_docs_keep_their_size_limits() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in _user_pages()}
    readme = sizes["README.md"]
    dev = sum(p.stat().st_size for p in (ROOT / "docs" / "dev").rglob("*.md"))
    largest = max(sizes, key=sizes.get)
    assert readme <= 8 * KB, f"README.md is {readme} bytes, over 8 KB"
    assert sizes[largest] <= 10 * KB, f"{largest} is {sizes[largest]} bytes, over 10 KB: split it"
    assert sum(sizes.values()) <= 120 * KB, f"the user docs are {sum(sizes.values())} bytes, over 120 KB"
    assert dev <= 30 * KB, f"docs/dev/ is {dev} bytes, over 30 KB"
    results = (ROOT / "benchmarks" / "RESULTS.md").stat().st_size  # one current table per benchmark
    assert results <= 25 * KB, f"benchmarks/RESULTS.md is {results} bytes, over 25 KB: keep the current tables"
    stated = re.search(r"are ([\d.]+) KB in (\d+) pages; the\s+largest, `?([\w/.-]+)`?, is ([\d.]+) KB",
                       (ROOT / "README.md").read_text(encoding="utf-8"))
    assert stated, "README.md's docs section must state the docs' total and largest page"
    total_kb, pages, name, largest_kb = stated.groups()
    assert abs(float(total_kb) - sum(sizes.values()) / KB) <= 5, "README.md states another docs total: update it"
    assert int(pages) == len(sizes) and name == largest, "README.md states another page count or largest page"


def _expand(overrides: list[str]) -> list[list[str]]:
    """Every combination of a sweep's comma-separated values (brackets and braces kept whole)."""
    choices = []
    for override in overrides:
        key, sep, value = override.partition("=")
        parts = re.split(r",(?![^\[{]*[\]}])", value) if sep and not value.startswith(("[", "{")) else [value]
        choices.append([f"{key}{sep}{part}" for part in parts])
    return [list(combo) for combo in itertools.product(*choices)]


def test_start_path_multi_process_commands_compose() -> None:
    from hydra import compose, initialize_config_dir

    from pipeflow.config.schema import register_configs

    register_configs()
    start_path = _script("start_path")
    checked = 0
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for cmd in start_path.commands():
            if cmd.kind == "script":
                py_compile.compile(str(ROOT / cmd.script()), doraise=True)
            elif cmd.kind == "compose":
                if cmd.argv[0].endswith(".sh"):
                    assert (ROOT / cmd.argv[0]).is_file(), f"{cmd.page}: {cmd.argv[0]} does not exist"
                for overrides in _expand(cmd.overrides()):
                    try:
                        compose(config_name="config", overrides=overrides)
                    except Exception as exc:  # noqa: BLE001 - the page and command say where
                        raise AssertionError(f"{cmd.page}: {cmd.text}: {exc}") from exc
                    checked += 1
    assert checked >= 5


def test_start_path_one_process_commands_run(tmp_path: Path) -> None:
    proc = warm.run_python([str(ROOT / "scripts" / "start_path.py"), "--run", str(tmp_path)], timeout=600, cwd=ROOT)
    steps = [line for line in proc.stdout.splitlines() if line.startswith(("RUN", "OK", "FAILED"))]
    assert proc.returncode == 0, ("a start-path command failed (python scripts/start_path.py --run DIR):\n"
                                  + "\n".join(steps[-3:]) + "\n" + (proc.stdout + proc.stderr)[-3000:])
    assert any(line.startswith("RUN") for line in steps)
