"""The package's floors: no import circle (imports inside functions count too), and the low floors (machine facts,
kernels, compiled code) import nothing that loads models, serves or trains."""

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "dflash"
GROUND = {"errors", "io", "machine"}  # import no other module of dflash's but errors
LOW = {"kernels", "compiled"}  # may stand only on the ground floor


def imports() -> dict[str, set[str]]:
    """module -> the dflash modules it imports anywhere in its code (relative imports)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((PACKAGE / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[name] = found & modules
    return graph


def reach(graph, start) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_no_import_circle():
    try:
        order = list(TopologicalSorter(imports()).static_order())
    except CycleError as e:
        pytest.fail(f"import circle: {' -> '.join(e.args[1])}")
    assert order


def test_low_floors_stand_on_the_ground_floor_only():
    graph = imports()
    for name in GROUND:
        assert graph[name] <= {"errors"}, (name, graph[name])
    for name in LOW:
        assert reach(graph, name) <= GROUND, (name, reach(graph, name) - GROUND)


def test_every_module_imports_in_dependency_order():
    order = [m for m in TopologicalSorter(imports()).static_order() if m != "__init__"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module('dflash.' + m)\n"
    r = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
