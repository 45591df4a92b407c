"""Turn a submitted notebook into the code the grader runs, without trusting the notebook.

Only the student's *answer cells* (nbgrader ``solution`` cells, matched by ``grade_id``) are
taken from the submission. They are placed into the trusted released notebook, whose locked
set-up cells (tagged ``setup``) run before them. Everything else in the submission (edited or
deleted test cells, changed points, new cells, outputs) has no effect on the grade.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


class SubmissionError(Exception):
    """The file cannot be graded at all; the message says why, for the student."""


@dataclass
class Submission:
    assignment: str
    cells: list[tuple[str, str]]          # (cell id, python source) in the order they run
    problems: list[str] = field(default_factory=list)  # notes for the report


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def is_answer_cell(cell) -> bool:
    meta = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(meta.get("solution")) and "grade_id" in meta


def is_setup_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and "setup" in cell.get("metadata", {}).get("tags", [])


class Node(dict):
    """A JSON object whose keys also read as attributes (``cell.source``), as nbformat's
    NotebookNode. Reading a notebook needs no more than this and a shape check; importing
    nbformat (its schema validator) would add a second to every grading run."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def read_notebook(path: str | Path) -> Node:
    """Read a notebook and check its shape; any problem becomes a readable SubmissionError."""
    path = Path(path)
    if not path.is_file():
        raise SubmissionError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SubmissionError(f"{path.name} is not a text file, so not a notebook") from None
    try:
        nb = json.loads(text, object_hook=Node)
    except json.JSONDecodeError as exc:
        raise SubmissionError(f"{path.name} is not valid JSON (line {exc.lineno}: {exc.msg}); "
                              "was it saved completely?") from None
    if not isinstance(nb, dict) or "cells" not in nb:
        raise SubmissionError(f"{path.name} is JSON but not a Jupyter notebook (no 'cells')")
    if nb.get("nbformat") != 4 or not isinstance(nb.cells, list):
        raise SubmissionError(f"{path.name} is not a valid notebook: expected nbformat 4 with a "
                              f"list of cells, found nbformat {nb.get('nbformat')!r}")
    for i, cell in enumerate(nb.cells):
        if not isinstance(cell, dict):
            raise SubmissionError(f"{path.name} is not a valid notebook: cell {i} is not an object")
        cell.setdefault("metadata", Node())
        if isinstance(cell.get("source"), list) and all(isinstance(x, str) for x in cell.source):
            cell["source"] = "".join(cell.source)  # the file stores a cell's source as lines
        if not isinstance(cell.get("source"), str) or not isinstance(cell.metadata, dict) \
                or cell.get("cell_type") not in ("code", "markdown", "raw"):
            raise SubmissionError(f"{path.name} is not a valid notebook: cell {i} is malformed "
                                  "(it needs a cell_type, a source and metadata)")
    return nb


_MAGIC = re.compile(r"^(\s*)([%!].*)$", re.MULTILINE)


def cell_source(cell) -> str:
    """A cell as plain Python: IPython magics and shell lines become no-op comments."""
    return _MAGIC.sub(r"\1pass  # \2", cell.source)


def answer_ids(nb) -> list[str]:
    return [nbgrader_meta(c)["grade_id"] for c in nb.cells if is_answer_cell(c)]


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


def load_submission(path: str | Path, assignment: str | None = None) -> Submission:
    """Read ``path`` and merge it into the trusted release of its assignment."""
    from .assignments import ASSIGNMENTS, detect

    submitted = read_notebook(path)
    name = assignment or detect(submitted)
    if name is None:
        known = ", ".join(ASSIGNMENTS)
        raise SubmissionError(f"{Path(path).name} matches none of the assignments ({known}): "
                              "it has none of their answer cells")
    trusted = read_notebook(ASSIGNMENTS[name].release)
    return merge(trusted, submitted, name)
