"""The commands of the start path (docs/start/*.md), so that the path cannot rot.

Every fenced ``bash`` block of docs/start/*.md is read, one command a line (``\\`` continues a
line; ``#`` starts a comment; leading ``VAR=value`` words are the environment), and every
fenced ``python`` block whose first line is ``# <name>.py`` is a file the page asks you to write.
Each command is one of:

- ``install``: ``pip install ...`` (the suite runs inside that install);
- ``compose``: ``torchrun ... train.py`` and ``examples/multinode.sh`` (several processes or
  machines), and ``python -m pipeflow.plan ... plan.calibration=<dir>`` (which plans on what such
  a run measured): their overrides are composed with Hydra (every key exists, every value fits
  its schema; a sweep's every combination), nothing is launched;
- ``script``: ``torchrun ... <script.py>``: the script exists and compiles;
- ``run``: ``python ...`` (one process): run for real, in order, in a scratch folder that holds
  the page's files, with small settings (``train.max_steps=2``, ``plan.repeats=1``, ...) put in
  place of the page's, all in one process (``--run``).

    python scripts/start_path.py                 # list the commands and their kind
    python scripts/start_path.py --run DIR       # run the one-process ones (small settings) in DIR
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import runpy
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = ROOT / "docs" / "start"
FENCE = re.compile(r"^```(\w*)\s*$")
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# what a one-process run is cut down to: key -> value, put in place of the page's own
SMALL = {
    "train.py": {"train.max_steps": "2", "train.eval_every": "0", "train.eval_batches": "1",
                 "data.batch_size": "8", "data.seq_len": "16", "pipeline.num_microbatches": "2",
                 "data.num_tokens": "20000",
                 "pipeline.profile": "false", "metrics.tensorboard": "false", "metrics.rehearse_steps": "0",
                 "metrics.memory_steps": "[]"},
    "pipeflow.plan": {"plan.repeats": "1", "plan.top": "3", "plan.rehearse": "0", "plan.max_chunks": "2",
                      "plan.schedules": "[1f1b,zb_h1,interleaved_1f1b]", "plan.comm_latency_ms": "0.2",
                      "plan.action_overhead_ms": "0"},
}
LINKED = ("train.py", "configs", "examples", "README.md", "docs")  # what a command may name, linked into the scratch folder


@dataclass
class Command:
    """One command of a start page."""

    page: str
    text: str
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """install, compose, script or run (see the module docstring)."""
        head = self.argv[0]
        if head == "pip":
            return "install"
        if head.endswith("multinode.sh"):
            return "compose"
        if head == "torchrun":
            return "compose" if "train.py" in self.argv else "script"
        if head == "python":  # planning on a run's costs needs the torchrun run before it: composed
            return "compose" if any(a.startswith("plan.calibration=") for a in self.argv) else "run"
        raise ValueError(f"{self.page}: no rule for the command {self.text!r}")

    def overrides(self) -> list[str]:
        """The Hydra overrides of a train.py, multinode.sh or ``-m`` module command."""
        if self.argv[0].endswith("multinode.sh"):
            return self.argv[1:]
        if "train.py" in self.argv:
            return [a for a in self.argv[self.argv.index("train.py") + 1:] if a != "-m"]
        if "-m" in self.argv:
            return self.argv[self.argv.index("-m") + 2:]
        return []

    def script(self) -> str:
        """The script a ``torchrun ... <script.py>`` command runs."""
        return next(a for a in self.argv[1:] if a.endswith(".py"))


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """The fenced blocks of a markdown text: (language, lines)."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and lang is None:
            lang, lines = match.group(1), []
        elif line.startswith("```") and lang is not None:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def commands(folder: Path = START) -> list[Command]:
    """Every command of the start pages, in page order."""
    found = []
    for page in sorted(folder.glob("*.md")):
        for lang, lines in _blocks(page.read_text(encoding="utf-8")):
            if lang != "bash":
                continue
            for line in "\n".join(lines).replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if not words:
                    continue
                env = {}
                while words and ENV_WORD.match(words[0]):
                    key, _, value = words.pop(0).partition("=")
                    env[key] = value
                found.append(Command(page.name, line.strip(), env, words))
    return found


def files(folder: Path = START) -> dict[str, str]:
    """The files the start pages ask you to write: python blocks opening with ``# <name>.py``."""
    written = {}
    for page in sorted(folder.glob("*.md")):
        for lang, lines in _blocks(page.read_text(encoding="utf-8")):
            if lang == "python" and lines and re.fullmatch(r"# [\w/]+\.py", lines[0].strip()):
                written[lines[0].strip()[2:]] = "\n".join(lines[1:]) + "\n"
    return written


def small(argv: list[str]) -> list[str]:
    """`argv` with the small settings of its entry point in place of its own values."""
    entry = "train.py" if "train.py" in argv else next((a for a in argv if a in SMALL), None)
    if entry is None or any(a.startswith("--") for a in argv):
        return list(argv)
    from pipeflow.config.data import data_keys

    source = next((a.partition("=")[2] for a in argv if a.startswith("data=")), "markov")
    settings = {key: value for key, value in SMALL[entry].items()  # the data keys its source takes
                if not key.startswith("data.") or key.removeprefix("data.") in data_keys(source)}
    kept = [a for a in argv if a.partition("=")[0].lstrip("+") not in settings]
    return kept + [f"{key}={value}" for key, value in settings.items()]


def _run_one(argv: list[str]) -> None:
    """Run one ``python ...`` command in this process, as its own ``__main__``."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    args = argv[1:]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise RuntimeError(f"exit status {exc.code}") from exc


def run(workdir: Path) -> int:
    """Run every one-process command of the start path with small settings in `workdir`, in one
    process; print one line per command with its time; 1 at the first failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if not (workdir / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    for name, text in files().items():
        (workdir / name).write_text(text, encoding="utf-8")
    os.chdir(workdir)
    sys.path.insert(0, str(workdir))
    for cmd in commands():
        if cmd.kind != "run":
            continue
        argv = [w for a in small(cmd.argv) for w in (sorted(glob.glob(a)) or [a] if "*" in a else [a])]
        start = time.perf_counter()
        print(f"RUN {cmd.page}: {shlex.join(argv)}", flush=True)
        try:
            _run_one(argv)
        except Exception as exc:  # noqa: BLE001 - reported with the command that failed
            print(f"FAILED {cmd.page}: {cmd.text}: {type(exc).__name__}: {exc}", flush=True)
            return 1
        print(f"OK {time.perf_counter() - start:.1f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """List the start path's commands, or run the one-process ones (``--run DIR``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", metavar="DIR", type=Path, help="run the one-process commands here")
    args = parser.parse_args(argv)
    if args.run:
        return run(args.run.resolve())
    for cmd in commands():
        print(f"{cmd.kind:8} {cmd.page}: {cmd.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
