"""The grader's shape: one folder per assignment behind one contract, no import cycles, small
files, points in one place, and no pytest where student code runs.

Tier: quick: the grader's shape, read from its files in seconds.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO

from autograder.checking.spec import load_spec
from autograder.registry import ASSIGNMENTS

GRADER = REPO / "autograder"


def _module(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: grader modules it imports}``, module-level and function-level imports alike."""
    modules = {_module(p): p for p in GRADER.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                stem = f"{base}.{node.module}" if node.level and node.module else (
                    base if node.level else node.module or "")
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    assert graph["autograder.cli"], "the import graph found no imports at all"
    planted = {**graph, "autograder.registry": graph["autograder.registry"] | {"autograder.cli"}}
    assert cycles(planted), "a cycle through registry -> cli -> registry went unnoticed"


def test_no_import_cycles_and_the_registry_is_a_leaf():
    graph = import_graph()
    assert cycles(graph) == []
    assert graph["autograder.registry"] == set()


def test_the_sandbox_imports_nothing_from_the_layers_above_it():
    """The sandbox (and its worker, which runs beside student code) sits below checking/ and
    the assignments: nothing of theirs is imported there. The answer keys' loader imports only
    the registry, and nothing of the sandbox loads a key."""
    graph = import_graph()
    sandbox = {m: deps for m, deps in graph.items() if m.startswith("autograder.sandbox")}
    assert sandbox and not {m: sorted(d for d in deps if d.startswith(
        ("autograder.checking", "autograder.assignments", "autograder.keys")))
        for m, deps in sandbox.items() if any(d.startswith(
            ("autograder.checking", "autograder.assignments", "autograder.keys")) for d in deps)}
    assert graph["autograder.keys"] <= {"autograder.registry"}


def test_no_grader_file_over_450_lines():
    long = {str(p.relative_to(REPO)): n for p in GRADER.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_one_folder_per_assignment_behind_the_contract(assignment):
    folder = GRADER / "assignments" / assignment
    assert (folder / "spec.py").is_file() and (folder / "checks.py").is_file()
    spec = load_spec(assignment)
    assert spec.assignment == assignment
    tests = re.findall(r"(?m)^def test_(\w+)\(", (folder / "checks.py").read_text())
    assert sorted(tests) == sorted(c.name for c in spec.checks), \
        "every check in the spec has a test_<name> in checks.py, and nothing else is a test"
    names = {f.name for f in spec.functions}
    for c in spec.checks:
        assert c.runs in names, f"{c.name} runs {c.runs}, which the spec does not declare"
    for f in spec.functions:
        assert set(f.helpers) <= names


@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
@pytest.mark.parametrize("root", ["assignments", "solutions"])
def test_notebook_points_agree_with_the_spec(assignment, root):
    """Points live in spec.py; each check("f") test cell is worth what the spec gives f."""
    a = ASSIGNMENTS[assignment]
    nb = json.loads((REPO / root / assignment / a.notebook).read_text())
    cells = {}
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        calls = re.findall(r"""check\(\s*["'](\w+)["']""", "".join(cell["source"]))
        if meta.get("grade") and not meta.get("solution") and calls:
            cells[calls[0]] = float(meta["points"])
    assert cells == load_spec(assignment).points()


def test_code_that_runs_beside_student_code_never_imports_pytest():
    """Probes, rank code and the sandbox worker are imported in the student's processes."""
    modules = ["autograder.sandbox.worker", "autograder.checking.ranks",
               "autograder.checking.collectives", "autograder.checking.training"]
    for a in ASSIGNMENTS:
        for kind in ("spec", "probes", "ranks"):
            if (GRADER / "assignments" / a / f"{kind}.py").exists():
                modules.append(f"autograder.assignments.{a}.{kind}")
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            "print('pytest' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_one_declared_python_minimum():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in pyproject
    assert "3.11" in (REPO / "README.md").read_text()
    assert "python:3.11" in (REPO / "docker" / "Dockerfile").read_text()
