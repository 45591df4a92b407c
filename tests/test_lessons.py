"""Every lesson notebook runs top to bottom in quick mode on CPU (nbclient, offline, tiny data)."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
LESSONS = sorted((REPO / "course" / "lessons").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs_in_quick_mode(path, offline_env, monkeypatch):
    for key in ("COURSE_DATA", "COURSE_OFFLINE", "COURSE_FULL", "MPLBACKEND", "PATH"):
        monkeypatch.setenv(key, offline_env[key])
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
