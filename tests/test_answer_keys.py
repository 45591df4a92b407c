"""Answer keys stay with the instructor: nothing a student receives holds a working answer.

What a student receives is the student edition (``python -m autograder edition``: the lab image
copies the same folders). These tests build it and look for answers in three ways:

1. by name: no function or class in it is named like a graded function (or like the names the
   grader's own expectations once had), and no hidden-case table is named in it;
2. by text: no three consecutive code lines of an answer key are in it (a copied key);
3. by behaviour (full tier): every function or class defined anywhere in it whose signature
   fits a graded function is put into the released stub under that name and graded with the
   key: none may earn a point the stub does not.

Plus: the keys are where autograder/keys.py looks, the hidden checks need them, and without a
key (``AUTOGRADER_ANSWER_KEY=absent``, the student's view) a hidden check is reserved, never
awarded.

Tier: both: names and text are quick; grading the injected candidates is full.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import REPO, grade

from autograder.checking.spec import load_spec
from autograder.keys import KEY_FILE, has_key, key_path
from autograder.registry import ASSIGNMENTS

#: The names the grader's expectations (and lessons) had for answers before the keys moved out
#: (issue #31), and the graded function each stood for: a function under one of these names in
#: the edition is that answer by another name.
OLD_ANSWER_NAMES = {"buckets": "assign_buckets", "shard": "shard_bounds",
                    "state_bytes": "model_state_bytes", "comm_bytes": "comm_bytes_per_step",
                    "optimizer_state_per_element": "model_state_bytes",
                    "merge": "merge_attention", "route": "route", "capacity": "expert_capacity",
                    "keep_mask": "expert_capacity", "balance_loss": "load_balancing_loss",
                    "switch_loss": "load_balancing_loss", "moe_forward": "MoELayer",
                    "per_rank_memory": "per_rank_memory", "step_time": "step_time",
                    "best_config": "best_config"}
#: Names of hidden-case tables.
HIDDEN_TABLES = ("BEST_CASES",)


def code_cells(nb_path: Path):
    for i, cell in enumerate(nbformat.read(nb_path, as_version=4).cells):
        if cell.cell_type == "code":
            yield i, cell


def parseable(src: str) -> str:
    return "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in src.splitlines())


def graded_functions() -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{name: (assignment, parameters)}`` of every function or class students write."""
    return {f.name: (a, f.params) for a in ASSIGNMENTS for f in load_spec(a).functions}


def definitions(edition: Path):
    """``(where, module or None, node, source)`` of every function and class defined in the
    edition: Python files (any depth) and every notebook's code cells except the released
    assignments' answer cells (those are the stubs themselves)."""
    for path in sorted(edition.rglob("*")):
        rel = path.relative_to(edition)
        if path.suffix == ".py":
            src = path.read_text(errors="ignore")
            cells = [(str(rel), src, ".".join(rel.with_suffix("").parts))]
        elif path.suffix == ".ipynb":
            cells = [(f"{rel} cell {i}", parseable(c.source), None) for i, c in code_cells(path)
                     if not c.metadata.get("nbgrader", {}).get("solution")]
        else:
            continue
        for where, src, module in cells:
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    yield where, module, node, src


# ---------------------------------------------------------------- the keys themselves

def test_every_key_is_in_solutions_and_every_hidden_check_has_one():
    for a in ASSIGNMENTS:
        hidden = [c.name for c in load_spec(a).checks if c.hidden]
        if hidden:
            assert key_path(a).is_file(), f"{a} has hidden checks {hidden} but no {key_path(a)}"
        if key_path(a).is_file():
            assert key_path(a).parent == REPO / "solutions" / a
    assert not [p for p in REPO.rglob(KEY_FILE) if "solutions" not in p.relative_to(REPO).parts
                and ".venv" not in p.parts], "an answer key outside solutions/"


def test_nbgrader_does_not_release_a_key():
    assert not list((REPO / "assignments").rglob(KEY_FILE))
    config = (REPO / "nbgrader_config.py").read_text()
    assert re.search(r"CourseDirectory\.ignore\s*=.*answer_key\.py", config, re.S)


# ---------------------------------------------------------------- 1. by name

def test_the_edition_defines_no_answer_by_name(edition):
    graded = set(graded_functions())
    found = []
    for where, _, node, _ in definitions(edition):
        grader_machinery = where.startswith("autograder") and not where.startswith(
            "autograder/assignments")
        bad = graded if grader_machinery else graded | set(OLD_ANSWER_NAMES)
        if node.name in bad:
            found.append(f"{where}: {node.name}")
    for path in edition.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".ipynb", ".md", ".json"):
            text = path.read_text(errors="ignore")
            found += [f"{path.relative_to(edition)}: {t}" for t in HIDDEN_TABLES if t in text]
    assert not found, "answers in the student edition:\n" + "\n".join(found)


# ---------------------------------------------------------------- 2. by text

def test_no_key_text_in_the_edition(edition):
    """The edition builder refuses any three consecutive code lines of a key; checked here on
    the built edition, and the search is shown to find a planted copy."""
    from autograder.integrations.edition import key_regions, leaks

    regions = key_regions(REPO)
    assert len(regions) == sum(has_key(a) for a in ASSIGNMENTS) > 0
    assert not leaks(edition, regions)
    planted = edition.parent / "planted"
    planted.mkdir(exist_ok=True)
    (planted / "notes.py").write_text(regions[0])
    assert leaks(planted, regions)


# ---------------------------------------------------------------- 3. by behaviour

def _fits(node, name: str, params: tuple[str, ...]) -> bool:
    """A definition fits a graded function when it has its name or the old answer name that
    stood for it, or is of the same kind (class or function) and takes the same parameters."""
    if OLD_ANSWER_NAMES.get(node.name) == name and not isinstance(node, ast.ClassDef):
        return True
    if isinstance(node, ast.ClassDef) != name[:1].isupper():
        return False
    if node.name == name or OLD_ANSWER_NAMES.get(node.name) == name:
        return True
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        if init is None:
            return False
        args = [a.arg for a in init.args.args[1:]]
    else:
        args = [a.arg for a in node.args.args + node.args.kwonlyargs]
    return set(args) == set(params) and len(params) > 0


def _injection(where, module, node, src, name) -> str:
    """Source that binds ``name`` to the candidate, appended to the stub's answer cell."""
    if module is not None and node.col_offset == 0:
        return f"from {module} import {node.name} as {name}\n"
    imports = "".join(ast.get_source_segment(src, n) + "\n" for n in ast.parse(src).body
                      if isinstance(n, (ast.Import, ast.ImportFrom)))
    body = ast.get_source_segment(src, node)
    lines = body.splitlines()
    body = "\n".join([lines[0]] + [l[node.col_offset:] if l[:node.col_offset].isspace() else l
                                   for l in lines[1:]])
    prelude = ("import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
               "import torch.distributed as dist\n")
    return f"{prelude}{imports}{body}\n{name} = {node.name}\n"


def candidates(edition: Path) -> dict[str, list[tuple[str, str]]]:
    """``{assignment: [(graded name, injection source)]}`` for every fitting definition."""
    graded = graded_functions()
    out: dict[str, list[tuple[str, str]]] = {}
    for where, module, node, src in definitions(edition):
        for name, (assignment, params) in graded.items():
            if _fits(node, name, params) and not (
                    where.startswith("assignments") and node.name == name):
                out.setdefault(assignment, []).append(
                    (name, f"# candidate from {where}\n" + _injection(where, module, node, src, name)))
    return out


def _answer_cell(nb, name: str):
    for cell in nb.cells:
        if cell.cell_type != "code" or not cell.metadata.get("nbgrader", {}).get("solution"):
            continue
        try:
            tree = ast.parse(parseable(cell.source))
        except SyntaxError:
            continue
        if any(getattr(n, "name", None) == name for n in tree.body):
            return cell
    raise AssertionError(f"no answer cell defines {name}")


@pytest.mark.full
@pytest.mark.slow
def test_no_definition_in_the_edition_earns_a_point(edition, tmp_path, offline_env):
    """Each fitting definition, injected into the released stub under the graded name and
    graded with the key, earns nothing. Candidates for different functions of one assignment
    share a grading run (each function's checks see only their own candidate)."""
    found = candidates(edition)
    graded = 0
    for assignment, pairs in sorted(found.items()):
        release = ASSIGNMENTS[assignment].release
        rounds: list[dict[str, str]] = []
        for name, source in pairs:
            slot = next((r for r in rounds if name not in r), None)
            if slot is None:
                rounds.append(slot := {})
            slot[name] = source
        for i, injected in enumerate(rounds):
            nb = nbformat.read(release, as_version=4)
            for name, source in injected.items():
                cell = _answer_cell(nb, name)
                cell.source += "\n\n" + source
            path = tmp_path / f"{assignment}-{i}.ipynb"
            nbformat.write(nb, path)
            report = grade(path, "--speed", "skip", "--only", ",".join(injected),
                           env=offline_env, timeout=900)
            graded += 1
            earned = {r["name"]: r["points"] for r in report["results"] if r["points"] > 0}
            assert not earned, (f"{assignment}: injected definitions earned points {earned}:\n"
                                + "\n".join(injected.values()))
    print(f"{sum(len(p) for p in found.values())} candidates in {graded} grading runs")


def test_candidates_are_found():
    """The behaviour test is not vacuous: a copied reference implementation with the graded
    parameters, and an old answer name, are candidates."""
    node = ast.parse("def f(num_tokens, num_experts, k, capacity_factor):\n  return 1\n").body[0]
    assert _fits(node, "expert_capacity", ("num_tokens", "num_experts", "k", "capacity_factor"))
    node = ast.parse("def route(a, b):\n  return 1\n").body[0]
    assert _fits(node, "route", ("logits", "k"))
    node = ast.parse("def moe_forward(w, experts, x, k, c):\n  return 1\n").body[0]
    assert _fits(node, "MoELayer", ("num_experts",)) and not _fits(node, "route", ("logits", "k"))
    node = ast.parse("class Route:\n  def __init__(self, a): pass\n").body[0]
    assert not _fits(node, "route", ("logits", "k"))


# ---------------------------------------------------------------- without the key

def test_without_the_key_hidden_checks_are_reserved_not_awarded():
    from autograder.integrations.gradebook import points_of
    from autograder.integrations.nbgrader_plugin import skipped_points
    from autograder.keys import RESERVED, is_reserved

    reserved = {"name": "x", "function": "f", "status": "skipped", "points": 0.0,
                "max_points": 2.0, "message": RESERVED}
    assert is_reserved(reserved)
    assert points_of(reserved) == 0.0 and skipped_points(reserved) == 0.0
    hardware = dict(reserved, message="needs 2 GPUs")
    assert not is_reserved(hardware) and points_of(hardware) == 0.0  # a skip never earns points


def test_the_report_says_what_is_checked_where():
    from autograder.keys import RESERVED
    from autograder.report import table
    from autograder.results import CheckResult, Report

    report = Report("a7_expert_parallel", "cpu", "iso", 1, [
        CheckResult("public", "route", 1, 1, "passed", 0.1),
        CheckResult("hidden", "route", 2, 0, "skipped", 0.0, RESERVED)])
    text = table(report)
    assert "Total: 1 / 1" in text
    assert "1 point(s) checked here; 2 more when your instructor grades" in text


def test_graded_code_run_as_the_sandbox_user_cannot_read_solutions(tmp_path, monkeypatch):
    """Where no user namespaces hide solutions/ (Gradescope), root's grader runs graded code as
    AUTOGRADER_SANDBOX_USER, and a folder of mode 0700 is then closed to it."""
    import os
    import pwd

    from autograder.sandbox import Sandbox, isolation

    if os.geteuid() != 0:
        pytest.skip("only root can start graded code as another user")
    nobody = pwd.getpwnam("nobody")
    try:
        runs = not subprocess.run([sys.executable, "-c", "import torch"], user=nobody.pw_uid,
                                  group=nobody.pw_gid, extra_groups=[], capture_output=True,
                                  timeout=120).returncode
    except OSError:
        runs = False
    if not runs:
        pytest.skip(f"user nobody cannot run {sys.executable} with torch here (a parent folder "
                    "such as /root is closed to it); checked by hand, see docs/grading.md")
    secret = tmp_path / "solutions"
    secret.mkdir()
    (secret / "answer_key.py").write_text("ANSWER = 42\n")
    secret.chmod(0o700)
    tmp_path.chmod(0o755)
    monkeypatch.setenv(isolation.SANDBOX_USER_ENV, "nobody")
    monkeypatch.setattr(isolation, "_NS_OK", False)
    assert isolation.unreadable_to_sandbox(secret)
    cell = ("import os\nraise RuntimeError(f'uid={os.getuid()} read=' + str(os.access("
            f"{str(secret / 'answer_key.py')!r}, os.R_OK)))\n")
    with Sandbox([("probe", cell)]) as box:
        box.start()
        message = box.cell_errors["probe"]
    assert f"uid={nobody.pw_uid} read=False" in message, message
