"""nbgrader integration that student code cannot fool.

Under ``nbgrader autograde`` the submitted notebook runs in one kernel, so anything the
student's cells do (redefine ``check``, patch ``autograder`` or ``builtins``) happens before
the test cells run. These two preprocessors (enabled in ``nbgrader_config.py``) take the
verdict out of that kernel:

- :class:`DeferChecks` runs first: it tells ``check()`` in the kernel to only print that the
  grade is decided after execution (saves time: nothing is graded twice);
- :class:`GradeInSandbox` runs after nbgrader's Execute: it grades the notebook with the
  CLI in a fresh process (answer cells placed into the trusted release, student code in the
  sandbox), and writes each ``check("<function>")`` test cell's outputs from that report:
  all checks passed -> plain output (full points); some -> the earned points as the cell's
  result (nbgrader's partial credit); a check failed and none passed -> an error (zero). A
  SKIP earns nothing (:func:`.gradebook.points_of`) but is no error: a cell whose checks were
  all skipped shows their reasons and ``0`` as its result (nbgrader scores a cell with an
  error or stderr output zero, and one with a plain output full). The student sees the same
  messages as from the CLI, nothing more.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import nbformat
from nbformat.v4 import new_output

from ..results import FAILED, SKIP_EARNS_NOTHING, SKIPPED, checks_lines
from .gradebook import points_of

try:
    from nbgrader.preprocessors import NbGraderPreprocessor
except ImportError:  # pragma: no cover - nbgrader is a dependency; keep imports cheap elsewhere
    NbGraderPreprocessor = object

CHECK_CALL = re.compile(r"""^\s*check\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""", re.MULTILINE)
DEFER_ENV = "AUTOGRADER_DEFER_CHECKS"


class DeferChecks(NbGraderPreprocessor):
    """Before execution: ``check()`` in the kernel defers to :class:`GradeInSandbox`."""

    def preprocess(self, nb, resources):
        os.environ[DEFER_ENV] = "1"
        return nb, resources


class GradeInSandbox(NbGraderPreprocessor):
    """After execution: test cells' outputs come from an isolated grading run."""

    def preprocess(self, nb, resources):
        os.environ.pop(DEFER_ENV, None)
        assignment = (resources.get("nbgrader") or {}).get("assignment")
        report = grade_notebook(nb, assignment)
        for cell in nb.cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            match = CHECK_CALL.search(cell.source) if cell.cell_type == "code" else None
            if meta.get("grade") and not meta.get("solution") and match:
                cell.outputs = cell_outputs(report, match.group(1), float(meta.get("points", 0)))
        return nb, resources


def grade_notebook(nb, assignment: str | None) -> dict:
    """Grade ``nb`` with the CLI in a fresh process; return its JSON report."""
    from ..invoke import run_grader
    from ..registry import ASSIGNMENTS

    with tempfile.TemporaryDirectory(prefix="nbgrader-grade-") as tmp:
        path = Path(tmp, "submission.ipynb")
        nbformat.write(nb, path)
        args = ["grade", str(path)] + (["--assignment", assignment]
                                       if assignment in ASSIGNMENTS else [])
        run = run_grader(args, timeout=1800)
    return run.report or {"error": run.output[-2000:] or "the grader did not run", "results": []}


def skipped_points(result: dict) -> float:
    """Points for a skipped check in nbgrader: none, whatever the reason (the class rule,
    :func:`.gradebook.points_of`): a SKIP judged nothing on this machine."""
    return points_of(result)


def cell_outputs(report: dict, function: str, cell_points: float) -> list:
    results = [r for r in report.get("results", []) if r["function"] == function]
    if not results:
        why = report.get("error") or f"no checks for {function} ran"
        return [_error(f"not graded: {why}")]
    earned = sum(points_of(r) for r in results)
    top = sum(r["max_points"] for r in results)
    lines = checks_lines(results, points_of)
    skipped = [r for r in results if r["status"] == SKIPPED]
    if skipped:
        lines.append(f"SKIP: {sum(r['max_points'] for r in skipped):g} point(s) not given. "
                     f"{SKIP_EARNS_NOTHING} The reason is above.")
    text = "\n".join(lines) + "\n"
    failed = sum(r["status"] == FAILED for r in results)
    if earned >= top:
        return [new_output("stream", name="stdout", text=text)]
    if earned <= 0 and failed:
        return [new_output("stream", name="stdout", text=text),
                _error(f"{failed} check(s) of {function} failed")]
    # partial credit, or nothing earned with nothing failed (all skipped): the cell's points
    # as its result; never an error, which would read as a failure
    fraction = earned / top if top else 0.0
    return [new_output("stream", name="stdout", text=text),
            new_output("execute_result", data={"text/plain": f"{fraction * cell_points:g}"},
                       execution_count=None)]


def _error(message: str):
    return new_output("error", ename="AssertionError", evalue=message,
                      traceback=[f"AssertionError: {message}"])
