"""Turn a submitted notebook into the code the grader runs, without trusting the notebook.

Only the student's *answer cells* (nbgrader ``solution`` cells, matched by ``grade_id``) are
taken from the submission. They are placed into the trusted released notebook, whose locked
set-up cells (tagged ``setup``) run before them. Everything else in the submission (edited or
deleted test cells, changed points, new cells, outputs) has no effect on the grade.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .notebook import (SubmissionError, answer_ids, cell_source, is_answer_cell, is_setup_cell,
                       nbgrader_meta, read_notebook)
from .registry import ASSIGNMENTS

__all__ = ["Submission", "SubmissionError", "detect", "load_submission", "merge"]


@dataclass
class Submission:
    assignment: str
    cells: list[tuple[str, str]]          # (cell id, python source) in the order they run
    problems: list[str] = field(default_factory=list)  # notes for the report


def merge(trusted, submitted, assignment: str) -> Submission:
    """The runnable code: trusted set-up cells, then the submitted answer cells."""
    wanted = answer_ids(trusted)
    given = {}
    for cell in submitted.cells:
        meta = nbgrader_meta(cell)
        if cell.get("cell_type") == "code" and meta.get("grade_id") in wanted:
            given.setdefault(meta["grade_id"], cell)
    problems = []
    if not given:
        raise SubmissionError(
            f"this notebook has none of the answer cells of {assignment} "
            f"({', '.join(wanted)}): is it the notebook of another assignment?")
    missing = [gid for gid in wanted if gid not in given]
    if missing:
        problems.append(f"answer cell(s) missing from the submission: {', '.join(missing)}")
    cells = []
    for cell in trusted.cells:
        if is_setup_cell(cell):
            cells.append((nbgrader_meta(cell).get("grade_id", "setup"), cell_source(cell)))
        elif is_answer_cell(cell):
            gid = nbgrader_meta(cell)["grade_id"]
            if gid in given:
                cells.append((gid, cell_source(given[gid])))
    return Submission(assignment, cells, problems)


def detect(nb) -> str | None:
    """The assignment whose answer-cell ids the notebook shares most."""
    ids = {nbgrader_meta(c).get("grade_id") for c in nb.cells}
    best, best_hits = None, 0
    for name, a in ASSIGNMENTS.items():
        if not a.release.exists():
            continue
        hits = len(ids & set(answer_ids(read_notebook(a.release))))
        if hits > best_hits:
            best, best_hits = name, hits
    return best


def load_submission(path: str | Path, assignment: str | None = None) -> Submission:
    """Read ``path`` and merge it into the trusted release of its assignment."""
    submitted = read_notebook(path)
    name = assignment or detect(submitted)
    if name is None:
        known = ", ".join(ASSIGNMENTS)
        raise SubmissionError(f"{Path(path).name} matches none of the assignments ({known}): "
                              "it has none of their answer cells")
    if name not in ASSIGNMENTS:
        raise SubmissionError(f"unknown assignment {name!r}; known: {', '.join(ASSIGNMENTS)}")
    trusted = read_notebook(ASSIGNMENTS[name].release)
    return merge(trusted, submitted, name)
