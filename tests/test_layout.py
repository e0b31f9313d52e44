"""The package's layout, read from its imports (every import, the ones inside functions too).

Floors, from the ground up (docs/models.md, "Where the code lives"):

0. ``modeling/``: what ships to the Hub; imports nothing else of the package.
1. ``data/``, ``metrics/`` and the shared utilities (``cpu_speedups``, ``decoding``, ``flags``, ``folders``,
   ``hub``, ``memory``, ``tokenization``).
2. ``training/`` and ``conversion/``: each imports floors 0 and 1, never the other.
3. ``hf_zformer/__init__`` (the public names); beside the package, ``scripts/`` and the benchmark harness
   ``benchmarks/``, which nothing in the package imports.

A module imports only from floors below its own or from its own folder; nothing imports in a cycle;
every folder's ``__init__`` says in its first two lines what lives there and what it may import.
No file imports another's private (``_name``) names, and no function of the package or the scripts
runs over ~60 lines (its docstring aside).
"""

import ast
from pathlib import Path

import pytest
from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "hf_zformer"
SHARED = {"cpu_speedups", "decoding", "flags", "folders", "hub", "memory", "tokenization"}
FLOORS = {"modeling": 0, "data": 1, "metrics": 1, **{name: 1 for name in SHARED}, "training": 2, "conversion": 2, "": 3}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from . import x`` counts as importing ``x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            candidates = submodules or [target]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {candidate for candidate in candidates if candidate in known and candidate != name}
    return found


def _room(name: str) -> str:
    """The folder (or shared module) a module belongs to: ``training``, ``hub``, ``""`` for the package itself."""
    parts = name.split(".")[1:]
    return parts[0] if parts else ""


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_has_a_floor():
    assert {_room(name) for name in _modules()} <= set(FLOORS)


def test_nothing_imports_upward_or_across_rooms():
    wrong = []
    for name, targets in _graph().items():
        for target in targets:
            room, other = _room(name), _room(target)
            if room != other and FLOORS[other] >= FLOORS[room]:
                wrong.append(f"{name} (floor {FLOORS[room]}) imports {target} (floor {FLOORS[other]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_benchmark_harness_is_outside_the_package():
    assert not (PACKAGE / "benchmark").exists() and (REPO_ROOT / "benchmarks" / "__init__.py").is_file()
    for path in _modules().values():
        imported = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                     for alias in node.names}
        assert not {name for name in imported if name and name.split(".")[0] == "benchmarks"}, path


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(name, trail):
        state[name] = "open"
        for target in sorted(graph[name]):
            if target.startswith(name + "."):  # a package importing its own modules is no cycle
                continue
            if state.get(target) == "open":
                cycles.append(" -> ".join(trail[trail.index(target):] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_each_folder_says_what_lives_there_and_what_it_may_import(folder):
    docstring = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    lines = docstring.splitlines()
    assert len(lines) >= 2 and lines[0].strip() and lines[1].startswith("May import:"), (folder, lines[:2])


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((REPO_ROOT / folder).rglob("*.py"))
            if "__pycache__" not in path.parts]


def test_no_private_name_is_imported_from_another_file():
    found = []
    for path in _python_files("hf_zformer", "scripts", "tests"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_zformer")):
                found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not found, "\n".join(found)


MAX_FUNCTION_LINES = 60


def test_functions_are_short():
    long = {}
    for path in _python_files("hf_zformer", "scripts"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = node.body[0] if ast.get_docstring(node) is not None else None
                lines = node.end_lineno - node.lineno + 1
                lines -= docstring.end_lineno - docstring.lineno + 1 if docstring else 0
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO_ROOT)}::{node.name}"] = lines
    assert not long, long
