"""The committed student notebooks are exactly what nbgrader generates from solutions/.

Tier: quick: nbgrader generate per assignment, seconds each.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import REPO

ASSIGNMENTS = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())


def normalise(path: Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    return {"cells": [(c.cell_type, c.source, c.metadata) for c in nb.cells]}


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_release_matches_source(assignment, tmp_path):
    course = tmp_path / "course"
    shutil.copytree(REPO / "solutions" / assignment, course / "solutions" / assignment)
    shutil.copy(REPO / "nbgrader_config.py", course / "nbgrader_config.py")
    nbgrader = Path(sys.executable).parent / "nbgrader"
    proc = subprocess.run([str(nbgrader), "generate_assignment", assignment, "--force", "--no-db"],
                          cwd=course, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the configuration draws no warning (one on every command teaches instructors to skip them)
    assert "WARNING" not in proc.stderr, proc.stderr[-2000:]
    for generated in sorted((course / "assignments" / assignment).glob("*.ipynb")):
        committed = REPO / "assignments" / assignment / generated.name
        assert committed.exists(), f"{committed} is missing: run make release"
        assert normalise(generated) == normalise(committed), (
            f"{committed.relative_to(REPO)} is out of date with solutions/: run make release")


def test_release_has_no_solution_code():
    for assignment in ASSIGNMENTS:
        for nb_path in (REPO / "assignments" / assignment).glob("*.ipynb"):
            text = nb_path.read_text()
            assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, nb_path
