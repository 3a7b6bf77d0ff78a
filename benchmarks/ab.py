"""A/B a benchmark between a base commit and the working tree, in alternating rounds.

    python benchmarks/ab.py --base d6a71bd --rounds 5 -- python benchmarks/sleep_tools.py ...

The base commit is exported (``git archive``) into a temporary folder; each round runs the
command once in the base tree and once in this tree (the order alternating round by round, so
a machine that slows down or speeds up during the run weighs on both alike), each with its own
``pipeflow`` first on ``PYTHONPATH`` and its own folder as the working directory.  The figure
read from each run is the last match of ``--figure`` in its output (default: the last
``<number> ms``).  The result is one line:

    ab: head/base 0.973 (median of 5 rounds; base 368.0 ms, head 358.1 ms)

The ratio is that of the two medians.  Exit status 1 when a run fails or prints no figure.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = r"([\d.]+) ms"


def commit_of(revision: str) -> str:
    """The commit `revision` names in this repository.

    Raises:
        SystemExit: it names no commit (unknown, or a tree or file such as ``HEAD:docs``).
    """
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ab: --base {revision!r} names no commit of {ROOT}: give a commit, branch or tag "
                         f"(git log --oneline lists them)")
    return done.stdout.strip()


def export(commit: str, into: Path) -> Path:
    """The tree of `commit`, written into `into` (no git state changes)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def figure_of(text: str, pattern: str) -> float | None:
    """The last match of `pattern` (its first group) in `text`, or None."""
    found = re.findall(pattern, text)
    if not found:
        return None
    last = found[-1]
    return float(last[0] if isinstance(last, tuple) else last)


def run_in(tree: Path, command: list[str], pattern: str, timeout_s: float) -> float:
    """Run `command` in `tree` (its pipeflow imported) and return its figure.

    Raises:
        SystemExit: the command failed or printed no figure.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    text = done.stdout + done.stderr
    value = figure_of(text, pattern)
    if done.returncode != 0 or value is None:
        raise SystemExit(f"ab: {' '.join(command)} in {tree} ended with status {done.returncode}"
                         f"{'' if value is not None else ' and printed no figure matching ' + repr(pattern)}:\n"
                         f"{text[-3000:]}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the A/B comparison the command line describes; print the ``ab:`` line."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="python benchmarks/ab.py --base <commit> [--rounds N] [--figure REGEX] "
                                           "-- <command ...>")
    parser.add_argument("--base", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--figure", default=FIGURE, help="regex whose first group is the figure (default: last '<n> ms')")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    args = parser.parse_args(argv[:split])
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1 round is needed for a median")
    command = argv[split + 1:]
    if not command:
        raise SystemExit("ab: no benchmark command after --")
    commit = commit_of(args.base)
    with tempfile.TemporaryDirectory(prefix="pipeflow-ab-") as tmp:
        base = export(commit, Path(tmp))
        figures: dict[str, list[float]] = {"base": [], "head": []}
        for k in range(args.rounds):
            order = (("base", base), ("head", ROOT)) if k % 2 == 0 else (("head", ROOT), ("base", base))
            for name, tree in order:
                figures[name].append(run_in(tree, command, args.figure, args.timeout))
            print(f"round {k + 1}: base {figures['base'][-1]:g}, head {figures['head'][-1]:g}", flush=True)
    a, b = statistics.median(figures["base"]), statistics.median(figures["head"])
    print(f"ab: head/base {b / a:.3f} (median of {args.rounds} rounds; base {a:g} ms, head {b:g} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
