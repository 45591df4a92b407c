"""A second solution of each assignment, written from the released text alone, gets full marks.

The rule this holds the assignments to: a submission that follows the released text exactly
gets full marks. ``tests/independent/<assignment>.py`` holds answer cells written by reading
``assignments/<assignment>/*.ipynb`` only (not the reference solution, not the grader); here
they are pasted into the released notebook's answer cells, as a student would type them, and
the notebook is graded like any submission. When one loses points, either the text does not
say what a check needs or the check asks for more than the text: fix one of them.

Tier: full: a whole grading per assignment of a second solution.
"""
from __future__ import annotations

import importlib.util

import nbformat
import pytest

from conftest import REPO, assert_full_marks, grade, grade_id

pytestmark = pytest.mark.full

INDEPENDENT = REPO / "tests" / "independent"
ASSIGNMENTS = sorted(p.stem for p in INDEPENDENT.glob("a*.py"))


def answers_of(assignment: str) -> dict[str, str]:
    spec = importlib.util.spec_from_file_location(f"independent_{assignment}",
                                                  INDEPENDENT / f"{assignment}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ANSWERS


def released_notebook(assignment: str):
    (path,) = sorted((REPO / "assignments" / assignment).glob("*.ipynb"))
    return nbformat.read(path, as_version=4)


def paste_answers(nb, answers: dict[str, str]) -> None:
    """In place: each code answer cell of ``nb`` gets its answer; every one must have one, and
    every answer must have its cell (a stub left behind, or an answer to a cell that no longer
    exists, would make this test prove less than it says)."""
    cells = {grade_id(c): c for c in nb.cells
             if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}
    assert cells.keys() == answers.keys(), (sorted(cells), sorted(answers))
    for gid, source in answers.items():
        assert "raise NotImplementedError" in cells[gid].source, f"{gid} is not a released stub"
        cells[gid].source = source


def test_every_assignment_has_an_independent_solution():
    released = sorted(p.name for p in (REPO / "assignments").iterdir() if p.is_dir())
    assert ASSIGNMENTS == released


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_independent_solution_scores_full_marks(assignment, offline_env, tmp_path):
    nb = released_notebook(assignment)
    paste_answers(nb, answers_of(assignment))
    path = tmp_path / f"{assignment}.ipynb"
    nbformat.write(nb, path)
    assert_full_marks(grade(path, env=offline_env, timeout=900))
