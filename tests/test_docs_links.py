"""Every relative link in README.md and docs/ resolves: the file exists, and a ``#anchor`` names a
heading of that file (GitHub's heading ids).

Pure text reading, no torch: it runs in milliseconds.
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def _prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading ids of a markdown file (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link and image targets of a markdown file, outside code blocks and code spans."""
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        targets += LINK.findall(CODE_SPAN.sub("", line))
    return targets


def broken_links(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``file: target (why)`` for every relative link of `paths` that does not resolve (files
    named relative to `root`)."""
    problems = []
    for path in paths:
        for target in links(path):
            if target.startswith(EXTERNAL):
                continue
            where, _, anchor = target.partition("#")
            dest = (path.parent / where).resolve() if where else path
            if not dest.exists():
                problems.append(f"{path.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{path.relative_to(root)}: {target} (no heading #{anchor})")
    return problems


def documentation() -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_and_docs_links_resolve() -> None:
    problems = broken_links(documentation())
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_keeps_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "torchrun --nproc-per-node 4 train.py" in text
    assert "python -m pytest -q" in text  # .ci/run calls the README's test command


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Every key: `plan.*` × more\n\n## Tests\n## Tests\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#every-key-plan--more) [dup](other.md#tests-1) [self](#top)\n"
        "# Top\n"
        "[gone](missing.md) [bad anchor](other.md#nope) ![pic](img.png)\n"
        "`[in code](missing.md)` [web](https://example.com/x)\n"
        "```\n[fenced](missing.md)\n```\n"
    )
    problems = broken_links([page], root=tmp_path)
    assert problems == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nope (no heading #nope)",
        "page.md: img.png (no such file)",
    ]


def test_slug_follows_github() -> None:
    assert slug("The 2-D mesh: `parallel.dp` × `parallel.pp`") == "the-2-d-mesh-paralleldp--parallelpp"
    assert slug("Mixed precision: `train.precision=fp32|bf16|fp16`") == (
        "mixed-precision-trainprecisionfp32bf16fp16"
    )
    assert slug("3. Pick: predicted against measured") == "3-pick-predicted-against-measured"
