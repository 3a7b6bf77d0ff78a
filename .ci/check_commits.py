"""Check the subjects of the commits made since the rule began: at most 72 characters, a
blank line between subject and body, no full stop at the end of the subject.

    python .ci/check_commits.py            # every commit after .ci/commits_since
    python .ci/check_commits.py --message FILE   # one message (the commit-msg hook)

The rule applies from the commit named in ``.ci/commits_since`` on (older history keeps its
long subjects: rewriting landed history is worse than leaving it).  Exit status 1 with one line
per offending commit.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT = 72
ROOT = Path(__file__).resolve().parents[1]


def problems(message: str) -> list[str]:
    """What is wrong with one commit message (empty: nothing)."""
    lines = message.splitlines()
    lines = [line for line in lines if not line.startswith("#")]  # git's own comment lines
    subject = lines[0] if lines else ""
    found = []
    if not subject.strip():
        found.append("an empty subject")
    if len(subject) > LIMIT:
        found.append(f"a subject of {len(subject)} characters (at most {LIMIT}; the why goes in the body)")
    if subject.rstrip().endswith("."):
        found.append("a subject ending with a full stop")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line between the subject and the body")
    return found


def main() -> int:
    """Check the commits after ``.ci/commits_since`` (or one message file); 1 when any fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--message", help="check this message file only (the commit-msg hook)")
    args = parser.parse_args()
    if args.message:
        found = problems(Path(args.message).read_text())
        for problem in found:
            print(f"commit message: {problem}", file=sys.stderr)
        return 1 if found else 0
    since = (ROOT / ".ci" / "commits_since").read_text().split()[0]
    log = subprocess.run(["git", "-C", str(ROOT), "log", "--format=%H%x00%B%x01", f"{since}..HEAD"],
                         capture_output=True, text=True, check=True).stdout
    bad = 0
    for entry in filter(str.strip, log.split("\x01")):
        sha, _, message = entry.strip("\n").partition("\x00")
        for problem in problems(message):
            print(f"{sha[:10]} {message.splitlines()[0][:60]!r}: {problem}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
