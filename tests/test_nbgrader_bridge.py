"""The notebook bridge: check() as a self-check in a kernel, and nbgrader autograde taking its
verdicts from an isolated grading run (a student who redefines check() gains nothing)."""
from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO

pytestmark = pytest.mark.slow

SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"


def execute(path: Path, env: dict, monkeypatch) -> nbformat.NotebookNode:
    for key in ("COURSE_DATA", "COURSE_OFFLINE", "COURSE_FULL", "MPLBACKEND", "PATH"):
        monkeypatch.setenv(key, env[key])
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def test_check_in_a_kernel_passes_the_reference_and_fails_stubs(offline_env, monkeypatch):
    errors = lambda nb: {c.source: o for c in nb.cells if c.cell_type == "code"  # noqa: E731
                         for o in c.outputs if o.output_type == "error"}
    solved = execute(SOURCE, offline_env, monkeypatch)
    assert not errors(solved), errors(solved)  # the experiments ran too, with the reference
    stubs = execute(RELEASE, offline_env, monkeypatch)
    failed = errors(stubs)
    tests = [c.source for c in stubs.cells if c.source.startswith("check(")]
    assert set(tests) <= set(failed), "every test cell must fail on the stubs"
    assert all(failed[t].ename == "AssertionError" and "NotImplementedError" in failed[t].evalue
               for t in tests if "speedup" not in t)


def _nbgrader(course: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "nbgrader"
    proc = subprocess.run([str(exe), *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (args, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def test_nbgrader_autograde_ignores_a_redefined_check(offline_env, tmp_path):
    course = tmp_path / "course"
    shutil.copytree(REPO / "solutions" / "a1_data_parallel", course / "solutions" / "a1_data_parallel")
    shutil.copy(REPO / "nbgrader_config.py", course)
    _nbgrader(course, offline_env, "generate_assignment", "a1_data_parallel", "--force")
    released = nbformat.read(course / "assignments" / "a1_data_parallel" / "data_parallel.ipynb", 4)
    reference = {c.metadata["nbgrader"]["grade_id"]: c.source
                 for c in nbformat.read(SOURCE, 4).cells if c.metadata.get("nbgrader", {}).get("solution")}
    cheat = ("import autograder\n"
             "def check(*args, **kwargs):\n    print('PASS')\n"
             "autograder.check = check\n")
    for student, answers in {"honest": reference, "cheater": {"copy_params": cheat}}.items():
        nb = nbformat.from_dict(released)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if cell.cell_type == "code" and gid in answers:
                cell.source = answers[gid]
        _nbgrader(course, offline_env, "db", "student", "add", student)
        folder = course / "submitted" / student / "a1_data_parallel"
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / "data_parallel.ipynb")
    _nbgrader(course, offline_env, "autograde", "a1_data_parallel")
    _nbgrader(course, offline_env, "export", "--to", str(tmp_path / "grades.csv"))
    rows = {r["student_id"]: r for r in csv.DictReader(open(tmp_path / "grades.csv"))}
    # 13 points of correctness + 2 for the speedup cell (correct, not measurable on CPU);
    # the written answer (2 points) waits for manual grading.
    assert float(rows["honest"]["raw_score"]) == 15
    assert float(rows["cheater"]["raw_score"]) == 0
    assert float(rows["honest"]["max_score"]) == 17
    graded = nbformat.read(course / "autograded" / "cheater" / "a1_data_parallel" / "data_parallel.ipynb", 4)
    outs = [o for c in graded.cells if c.source.startswith('check("copy_params")') for o in c.outputs]
    assert any(o.output_type == "error" for o in outs)
