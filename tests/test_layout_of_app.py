"""The shape of the house: no import circle in app/, lower floors never reach up into the wiring, few rooms flat.

    python -m pytest -q tests/test_layout_of_app.py

Every import statement of every module is read with `ast`: top-level ones, those inside functions, and those under
`if TYPE_CHECKING:` (a circle of type hints is still a circle a reader must walk). Importing `app.a.b` also runs
`app/a/__init__.py`, so it counts as an import of the package too.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app"
MAX_FLAT_MODULES = 16  # .py files directly in app/, __init__.py included


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def app_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(APP.rglob("*.py"))}


def imported_modules(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The app modules that `path` imports anywhere in its text, and the packages whose __init__ that runs."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from app.amp import policy`
    modules = set()
    for name in found:
        parts = name.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # the parent packages run first
    return {name for name in modules if name in known}


def import_graph() -> dict[str, set[str]]:
    modules = app_modules()
    known = set(modules)
    return {name: imported_modules(path, known) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules around it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_of_app_is_in_an_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_circle_through_a_function_and_type_checking(tmp_path):
    # The finder itself must be able to fail: a circle made only of a TYPE_CHECKING import and one inside a function.
    graph = {"app.a": {"app.b"}, "app.b": {"app.c"}, "app.c": {"app.a"}, "app.d": {"app.a"}}
    assert find_cycle(graph) == ["app.a", "app.b", "app.c", "app.a"]
    assert find_cycle({"app.a": {"app.b"}, "app.b": set()}) is None
    (tmp_path / "app").mkdir()
    source = tmp_path / "app" / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.y import Y\n"
        "def f():\n    from app import z\n"
    )
    assert imported_modules(source, {"app", "app.y", "app.z"}, root=tmp_path) == {"app", "app.y", "app.z"}


@pytest.mark.parametrize("floor", ["app.amp", "app.tasks", "app.telemetry", "app.storage", "app.host", "app.inputs"])
def test_lower_floors_never_import_the_wiring_or_the_loop(floor):
    graph = import_graph()
    upward = {
        module: sorted(targets & {"app.wiring", "app.loop", "app.train", "app.predict"})
        for module, targets in graph.items()
        if module == floor or module.startswith(floor + ".")
    }
    assert not any(upward.values()), {module: targets for module, targets in upward.items() if targets}


def test_at_most_16_modules_stand_flat_in_app():
    flat = sorted(path.name for path in APP.glob("*.py"))
    assert len(flat) <= MAX_FLAT_MODULES, f"{len(flat)} modules flat in app/: {', '.join(flat)}"


def test_every_package_opens_with_a_map_of_its_modules():
    folders = {path.parent for path in APP.rglob("*.py")} - {APP}
    for folder in sorted(folders):
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.relative_to(ROOT)} has no __init__.py: setuptools would not package it"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = [p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        missing = [name for name in modules if name not in doc]
        assert not missing, f"{init.relative_to(ROOT)}'s docstring does not name {', '.join(missing)}"


@pytest.mark.parametrize(
    "old, new",
    [("app.run", "app.wiring"), ("app.checkpoint", "app.storage.checkpoints"), ("app.folders", "app.storage.folders")],
)
def test_an_old_import_path_fails_with_one_line_naming_the_new_place(old, new):
    # In a fresh interpreter: a user's script that still imports the old path.
    result = subprocess.run(
        [sys.executable, "-c", f"import {old}"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError:") and new in last, last
    importlib.import_module(new)  # and the new place is real
