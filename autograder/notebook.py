"""Reading notebooks: a shape check instead of nbformat (its import costs a second per grading),
the nbgrader cell kinds, and the cells that run (answer and set-up cells, magics neutralised).
"""
from __future__ import annotations

import json
import re
from pathlib import Path


class SubmissionError(Exception):
    """The file cannot be graded at all; the message says why, for the student."""


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




def runnable_cells(path: str | Path, ids: list[str] | None = None) -> list[tuple[str, str]]:
    """``(cell id, source)`` of a notebook's set-up and answer cells, in order (only those with
    ``ids``, if given): what the grader executes of a trusted notebook."""
    nb = read_notebook(path)
    cells = [(nbgrader_meta(c).get("grade_id", "setup"), cell_source(c))
             for c in nb.cells if is_setup_cell(c) or is_answer_cell(c)]
    return [c for c in cells if ids is None or c[0] in ids]
