"""The house plan holds: no import cycle inside pipeflow/, and every part imports only what its
layer may (schedules < runtime < planning, observability < run; models and data stand apart).

Imports inside functions count; imports under ``if TYPE_CHECKING:`` do not.  Pure AST reading:
no module is imported, so this runs in milliseconds.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pipeflow"

# Base modules every part may import.
BASE = {"pipeflow.errors"}
# part -> the parts it may import (besides itself and BASE).
ALLOWED: dict[str, set[str]] = {
    "schedules": set(),
    "models": set(),
    "runtime": {"schedules", "models"},
    "data": {"models"},
    "planning": {"schedules", "models", "runtime"},
    "observability": {"schedules", "runtime", "planning"},
    "config": {"schedules", "models", "runtime", "data", "planning", "observability"},
    "checkpoint": {"schedules", "models", "runtime", "data", "planning", "observability", "config"},
    "run": {"schedules", "models", "runtime", "data", "planning", "observability", "config", "checkpoint"},
    "commands": {"schedules", "models", "runtime", "data", "planning", "observability", "config", "checkpoint", "run"},
    # the command-line shims at the top (python -m pipeflow.plan / .launch / .generate)
    "plan": {"commands"},
    "launch": {"commands"},
    "generate": {"commands"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("pipeflow",) + path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pipeflow modules `name` imports at run time (anywhere in the file)."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for body in node.body for n in ast.walk(body)}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
    return targets


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_inside_pipeflow():
    modules = _modules()
    edges = {m: _imports(m, p, modules) for m, p in modules.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_part_imports_only_its_lower_layers():
    modules = _modules()
    broken = []
    for module, path in sorted(modules.items()):
        part = _part(module)
        if module in BASE or not part:
            continue
        assert part in ALLOWED, f"{module}: part {part!r} is not in the house plan (tests/test_layering.py)"
        for target in sorted(_imports(module, path, modules)):
            if target in BASE or _part(target) == part or target == "pipeflow":
                continue
            if _part(target) not in ALLOWED[part]:
                broken.append(f"{module} imports {target}")
    assert not broken, "imports that break the layering:\n  " + "\n  ".join(broken)


def test_models_import_only_torch_torchvision_and_their_spec():
    allowed_roots = {"torch", "torchvision", "__future__", "dataclasses", "typing", "collections", "math",
                     "functools", "itertools", "hashlib", "time", "contextlib", "re", "random",
                     # from_module: pieces are deep copies cut from the meta skeleton (copy); the traced
                     # form fixes a forward's defaulted arguments, read from its signature (inspect)
                     "copy", "inspect",
                     # model.init_from and checkpoints read DCP's .metadata with an allowlist (dcp_metadata)
                     "os", "pickle",
                     # tensor-parallel plans name submodules by glob patterns (ModelSpec.tp_plan)
                     "fnmatch"}
    # model=hf (hf.py, hf_folder.py only): Hugging Face's own modules and lazy tensor reads, imported inside its functions;
    # it lists a folder's safetensors files (glob) and reads its config / index (json), warns on untested versions
    # hf.py says what it skips of a checkpoint (logging); hf_convert.py reads transformers' conversion mapping
    only_in = {"hf.py": {"transformers", "safetensors", "importlib", "logging"}, "hf_convert.py": {"transformers"},
               "hf_folder.py": {"transformers", "safetensors", "glob", "json", "warnings"},
               "lora.py": {"peft"},  # model.lora: peft's LoRA layers, imported inside its functions
               "hf_decode.py": {"transformers"},
               # which families are cut: their forwards' source compared (hf_forms)
               "hf_forms.py": {"transformers", "ast", "textwrap", "importlib"},
               "hf_experts.py": {"contextvars"},
               "hf_attention.py": {"transformers"},  # parallel.cp: the ring registered as an attention function  # which ep rank's experts a layer is built with  # generation: the model's own cache and masks, imported inside
               "spec.py": {"numpy"}}  # a host batch's targets counted without a tensor op (no device could wait)
    strays = []
    for path in sorted((ROOT / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            allowed = allowed_roots | only_in.get(path.name, set())
            strays += [f"{path.name} imports {r}" for r in roots if r not in allowed and r != "pipeflow"]
    assert not strays, strays


def test_top_of_the_package_shows_about_a_dozen_parts():
    """Ten parts, errors.py, and the three ``python -m pipeflow.<command>`` shims."""
    entries = [p.name for p in ROOT.iterdir() if p.name not in ("__init__.py", "__pycache__", "py.typed")]
    assert len(entries) <= 14, sorted(entries)



def test_a_moved_module_imports_from_its_old_path_with_a_warning():
    import importlib
    import warnings

    import pipeflow
    import pipeflow.config.schema as schema

    for old in ("pipeflow.run.config", "pipeflow.run.checkpoint", "pipeflow.runtime.fsdp"):
        sys_modules = __import__("sys").modules
        sys_modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(pipeflow.MOVED[old]), old
        assert any(issubclass(w.category, DeprecationWarning) and pipeflow.MOVED[old] in str(w.message)
                   for w in caught), old
    assert schema.__spec__.name == "pipeflow.config.schema"  # the alias did not take the module's own spec


def test_no_code_of_the_repository_uses_a_moved_path():
    import re

    import pipeflow

    pattern = re.compile("|".join(re.escape(old) + r"(?![A-Za-z0-9_])" for old in pipeflow.MOVED))
    repo = ROOT.parent
    users = [p for folder in ("pipeflow", "tests", "benchmarks", "scripts", "examples") for p in (repo / folder).rglob("*.py")]
    found = [f"{p.relative_to(repo)}: {m.group(0)}" for p in users + [repo / "train.py"]
             if p != ROOT / "__init__.py" and p.name != "test_layering.py" for m in pattern.finditer(p.read_text())]
    assert not found, found


def test_no_folder_holds_more_than_25_modules_and_no_module_500_lines():
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT, *ROOT.rglob("*/")] if "__pycache__" not in d.parts
               if (n := len(list(d.glob("*.py")))) > 25}
    assert not crowded, f"folders over 25 modules: {crowded}; group what belongs together"
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}; split them by concern"
