"""Generate docs/reference/configuration.md (and one page per top-level key under
docs/reference/config/, and the error catalogue docs/reference/errors.md) from the config schemas: every key, its type, its
default and what it does.

It walks the structured configs (the dataclasses of ``pipeflow/config/schema.py``, registered in
Hydra's ConfigStore) and the YAML groups under ``configs/``: a field's description is its inline
comment or the comment block above it (a model's: the ``Args:`` entry of its builder's docstring);
a group option's is the first comment line of its YAML file; a default is the schema's, overlaid
with the default option's YAML values.  Nothing is written by hand, so a renamed or added key shows
up here at once; ``tests/test_docs.py`` fails when the committed page differs from this output.

    python scripts/config_reference.py            # rewrite the page
    python scripts/config_reference.py --check    # exit 1 when the page is stale
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "configuration.md"
SECTIONS = PAGE.parent / "config"  # one generated page per top-level key
CONFIGS = ROOT / "configs"


def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's field descriptions from its source: the inline comment of the field's line,
    after the comment lines right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0]
    found: dict[str, str] = {}
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        inline = [comments[node.lineno]] if node.lineno in comments and not lines[node.lineno - 1].strip().startswith("#") else []
        found[node.target.id] = " ".join(above + inline).strip()
    return found


def docstring_args(function: Any) -> dict[str, str]:
    """The ``Args:`` entries of a Google-style docstring, joined onto one line each (``a, b:``
    entries give both names the text)."""
    doc = inspect.getdoc(function) or ""
    match = re.search(r"^Args:\n(.*?)(?:\n\S|\Z)", doc, re.S | re.M)
    if not match:
        return {}
    found: dict[str, str] = {}
    names: list[str] = []
    for line in match.group(1).splitlines():
        entry = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if entry:
            names = entry.group(1).split(", ")
            for name in names:
                found[name] = entry.group(2).strip()
        elif line.strip() and names:
            for name in names:
                found[name] += " " + line.strip()
    return {name: first_sentence(text) for name, text in found.items()}


def first_sentence(text: str) -> str:
    """`text` up to the end of its first sentence (a page of every key stays short)."""
    match = re.search(r"[.;:] (?=[A-Z(`])", text)
    return text[:match.start() + 1] if match and match.start() > 40 else text


def type_name(kind: Any) -> str:
    """A field's type as written in the schema (``int``, ``str | None``, ``list[int]``); a choice
    (an Enum of :mod:`pipeflow.config.choices`) as its words (``static | per_step``)."""
    if isinstance(kind, str):
        from pipeflow.config import choices as config_choices

        return re.sub(r"\b[A-Z]\w+\b", lambda m: _choice_words(getattr(config_choices, m.group(0), None)) or m.group(0),
                      kind)
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "")


def _choice_words(kind: Any) -> str | None:
    """The words of a choice (an Enum), joined as its alternatives; None for another type."""
    from enum import Enum

    if isinstance(kind, type) and issubclass(kind, Enum):
        return " | ".join(str(member.value) for member in kind)
    return None


def value_text(value: Any) -> str:
    """A default as a YAML-ish literal (null, true, [a, b])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value == "???":
        return "(required)"
    return str(value)


def default_of(spec: dataclasses.Field) -> Any:
    """A dataclass field's default (calling its factory)."""
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return spec.default_factory()  # type: ignore[misc]
    return "???"


def prose(text: str) -> str:
    """A docstring's reST markup as markdown: ``x`` and :class:`x` become `x`."""
    return re.sub(r":(?:class|mod|func|data|meth):`~?([^`]*)`", r"`\1`", text).replace("``", "`")


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return prose(text).replace("|", "\\|").replace("\n", " ")


def rows(schema: type, prefix: str, values: dict[str, Any], notes: dict[str, str],
         seen: dict[str, str] | None = None, where: str = "") -> list[str]:
    """Table rows for the fields of `schema` under `prefix`, nested dataclasses expanded (once per
    page: `seen` maps a type to `where` it was, and a later one points there); `values` (a YAML
    option's) override the schema's defaults, `notes` describe fields lacking a comment."""
    seen = {} if seen is None else seen
    comments = dict(notes)
    for klass in reversed(schema.__mro__):  # a field a base class declares: the base's comment
        comments.update({k: v for k, v in field_comments(klass).items() if v})
    out = []
    for spec in dataclasses.fields(schema):
        if spec.name.startswith("_"):
            continue
        default = values.get(spec.name, default_of(spec))
        key = f"{prefix}{spec.name}"
        if dataclasses.is_dataclass(default):
            doc = (inspect.getdoc(type(default)) or "").replace("\n", " ")
            nested = values.get(spec.name) if isinstance(values.get(spec.name), dict) else {}
            own = {**{f.name: getattr(default, f.name) for f in dataclasses.fields(default)}, **nested}
            same = repr((type(default), own))  # the same keys with the same defaults: shown once a page
            if same in seen:
                out.append(f"| `{key}.*` | {type(default).__name__} | | {cell(comments.get(spec.name) or doc)} "
                           f"Keys and defaults as under {seen[same]}. |")
                continue
            seen[same] = f"{where or prefix.rstrip('.')}"
            out.append(f"| `{key}` | {type(default).__name__} | | {cell(comments.get(spec.name) or doc)} |")
            out += rows(type(default), f"{key}.", own, {}, seen, where)
            continue
        out.append(f"| `{key}` | {cell(type_name(spec.type))} | `{cell(value_text(default))}` | "
                   f"{cell(comments.get(spec.name, ''))} |")
    return out


TABLE = ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]


def yaml_values(path: Path) -> dict[str, Any]:
    """The values a group option's YAML file sets (its ``defaults`` list left out)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    return {k: v for k, v in data.items() if k != "defaults"}


def default_options() -> dict[str, str]:
    """The option each group takes in configs/config.yaml's defaults list."""
    from omegaconf import OmegaConf

    chosen = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONFIGS / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            for group, option in entry.items():
                if not group.startswith("override "):
                    chosen[group] = option
    return chosen


def groups_section(chosen: dict[str, str]) -> list[str]:
    """One row per config group under configs/: its options, the default in bold."""
    out = ["## Groups", "", "Pick an option with `group=option` (`schedule=zbv`); each option is a YAML file under "
           "`configs/<group>/` whose first lines say what it is.", "", "| group | options (default in bold) |",
           "| --- | --- |"]
    for folder in sorted(p for p in CONFIGS.iterdir() if p.is_dir() and any(p.glob("*.yaml"))):
        names = [f"**{p.stem}**" if chosen.get(folder.name) == p.stem else p.stem for p in sorted(folder.glob("*.yaml"))]
        out.append(f"| {folder.name} | {', '.join(names)} |")
    return out + [""]


def model_section() -> list[str]:
    """One table per model builder: its keys, with each option's default where the options of one
    builder (``model=resnet18``, ``model=resnet50``) set different ones."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance().repo["model"]
    by_base: dict[str, list[Path]] = {}
    for path in sorted((CONFIGS / "model").glob("*.yaml")):
        bases = [d for d in OmegaConf.load(path).get("defaults", []) if isinstance(d, str) and d.startswith("base_")]
        if bases:
            by_base.setdefault(bases[0], []).append(path)
    seen: dict[str, str] = {}
    out = ["Each `model=` option has its own keys: its builder's arguments (what each option is: "
           "[groups](../configuration.md#groups)).", ""]
    for base, paths in by_base.items():
        schema = store[f"{base}.yaml"].node._metadata.object_type
        target = schema.__dataclass_fields__["_target_"].default
        module, _, name = target.rpartition(".")
        notes = docstring_args(getattr(sys.modules[module], name))
        names = ", ".join(f"model={p.stem}" for p in paths)
        tables = [rows(schema, "model.", yaml_values(p), notes, seen, f"model={p.stem}") for p in paths]
        merged = [_merge_defaults(lines, [p.stem for p in paths]) for lines in zip(*tables)]
        out += [f"## {names}", "", f"Builder: `{target}`.", "", *TABLE, *merged, ""]
    return out


def data_section() -> list[str]:
    """One row per data key: which sources take it (``data=<source>``), and its default in each
    (the schema's, overlaid with the option's YAML), the commonest first."""
    from pipeflow.config.data import DATA_SCHEMAS

    kinds = {"every source": set(DATA_SCHEMAS), "token data": {"markov", "text", "tokens", "chat"},
             "file data": {"text", "tokens", "chat"}, "images": {"cifar10", "mnist", "imagefolder", "fakedata"}}
    found: dict[str, dict[str, Any]] = {}  # key -> {source: (type, default, comment)}
    for source, schema in DATA_SCHEMAS.items():
        values = yaml_values(CONFIGS / "data" / f"{source}.yaml")
        comments: dict[str, str] = {}
        for klass in reversed(schema.__mro__):
            comments.update({k: v for k, v in field_comments(klass).items() if v})
        for spec in dataclasses.fields(schema):
            found.setdefault(spec.name, {})[source] = (spec.type, values.get(spec.name, default_of(spec)),
                                                       comments.get(spec.name, ""))
    out = ["Each `data=` option takes only the keys its source reads; another is refused, naming them.", "",
           "| key | type | sources | default | what it does |",
           "| --- | --- | --- | --- | --- |"]
    for key, per_source in found.items():
        sources = set(per_source)
        named = next((kind for kind, members in kinds.items() if members == sources), ", ".join(per_source))
        kind, _, comment = next(iter(per_source.values()))
        by_value: dict[str, list[str]] = {}
        for source, (_, default, _) in per_source.items():
            by_value.setdefault(value_text(default), []).append(source)
        ranked = sorted(by_value.items(), key=lambda item: -len(item[1]))
        default = "the option's" if key == "name" else "; ".join(
            f"`{cell(text)}`" + ("" if i == 0 else f" ({', '.join(names)})") for i, (text, names) in enumerate(ranked))
        out.append(f"| `data.{key}` | {cell(type_name(kind))} | {named} | {default} | {cell(comment)} |")
    return out


def _merge_defaults(lines: tuple[str, ...], options: list[str]) -> str:
    """One table row from the same key's rows of several options: their defaults side by side
    where they differ (``resnet18` (resnet18), `resnet50` (resnet50)``)."""
    cells = [line.split(" | ") for line in lines]
    if len({c[2] for c in cells}) == 1:
        return lines[0]
    first = cells[0]
    first[2] = ", ".join(f"{c[2]} ({option})" for c, option in zip(cells, options))
    return " | ".join(first)


def section_page(title: str, intro: str, body: list[str]) -> str:
    """One generated page: its title, the do-not-edit note, a line back to the index, its tables."""
    return "\n".join([f"# {title}", "", NOTE, "", f"{intro} All keys: [configuration](../configuration.md).", "",
                      *body]).rstrip() + "\n"


NOTE = "<!-- Made from pipeflow/config/ by scripts/config_reference.py: do not edit. -->"


def errors_page() -> str:
    """The error catalogue: every class of pipeflow.errors, its base and its docstring's first
    paragraph (what it means and what the message names)."""
    import pipeflow.errors as errors

    classes = sorted((c for c in vars(errors).values() if inspect.isclass(c) and c.__module__ == errors.__name__),
                     key=lambda c: c.__name__)
    out = ["# Errors", "", NOTE.replace("config/", "errors.py"), "",
           "Every named failure is one of these classes of `pipeflow.errors`, each also the built-in "
           "exception it refines; its message names where (key, rank, stage, micro-batch) and what to do. What "
           "each looks like in a run: [failures](../guides/failures.md).", "", "| class | is a | what it means |", "| --- | --- | --- |"]
    for cls in classes:
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        meaning = re.split(r"[;.]\s+[Tt]he message", doc)[0].rstrip(".") + "."  # what it names: the guide's table
        out.append(f"| `{cls.__name__}` | {bases} | {cell(first_sentence(meaning))} |")
    return "\n".join(out) + "\n"


def render() -> dict[Path, str]:
    """Every page of the reference (the index and one page per top-level key), as the schemas and
    configs/ say now."""
    from pipeflow.config.schema import Config, register_configs

    register_configs()
    chosen = default_options()
    pages: dict[Path, str] = {}
    index = ["| key | what it holds |", "| --- | --- |",
             "| [`model.*`](config/model.md) | the model: each `model=` option's own keys |"]
    pages[SECTIONS / "model.md"] = section_page("model.*", "The model's keys.", model_section())
    for spec in dataclasses.fields(Config):
        schema = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if not dataclasses.is_dataclass(schema):
            continue
        if spec.name == "data":  # each source its own schema
            doc = (inspect.getdoc(type(schema)) or "").replace("\n", " ")
            index.append(f"| [`data.*`](config/data.md) | {cell(first_sentence(doc))} |")
            pages[SECTIONS / "data.md"] = section_page("data.*", prose(doc), data_section())
            continue
        option = CONFIGS / spec.name / f"{chosen.get(spec.name)}.yaml"
        values = yaml_values(option) if option.is_file() else {}
        doc = (inspect.getdoc(type(schema)) or "").replace("\n", " ")
        index.append(f"| [`{spec.name}.*`](config/{spec.name}.md) | {cell(first_sentence(doc))} |")
        pages[SECTIONS / f"{spec.name}.md"] = section_page(
            f"{spec.name}.*", prose(doc), [*TABLE, *rows(type(schema), f"{spec.name}.", values, {})])
    pages[PAGE.parent / "errors.md"] = errors_page()
    pages[PAGE] = "\n".join([
        "# Configuration keys", "", NOTE, "",
        "Every key can be overridden on the command line (`key=value`); `python train.py --cfg job` prints "
        "the composed config. A key that does not exist fails at once, naming the nearest ones. "
        "Keys renamed over time: [renames](renames.md).", "", *index, "", *groups_section(chosen)]).rstrip() + "\n"
    return pages


def stale_pages(pages: dict[Path, str]) -> list[str]:
    """The pages that differ from `pages`, are missing, or are generated no more."""
    stale = [str(p.relative_to(ROOT)) for p, text in pages.items()
             if not p.is_file() or p.read_text(encoding="utf-8") != text]
    extra = [str(p.relative_to(ROOT)) for p in SECTIONS.glob("*.md") if p not in pages]
    return stale + extra


def main(argv: list[str] | None = None) -> int:
    """Write the page, or with ``--check`` report whether it is stale (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed page is stale")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    pages = render()
    stale = stale_pages(pages)
    if args.check:
        print("stale: " + ", ".join(stale) + "; run python scripts/config_reference.py" if stale else "current")
        return int(bool(stale))
    SECTIONS.mkdir(parents=True, exist_ok=True)
    for path in SECTIONS.glob("*.md"):
        if path not in pages:
            path.unlink()
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(pages)} pages, {sum(len(t.encode()) for t in pages.values())} bytes")
    return 0

if __name__ == "__main__":
    sys.exit(main())
