"""What an instructor reads across a class, written next to ``grades.csv``, and the one rule
for a check this machine could not judge (:func:`tally`):

- a check that SKIPs counts in ``max_score`` for every student, so an assignment has one
  maximum, and **earns nothing**, whatever the reason: the machine could not judge it (too few
  cores or GPUs, or too loaded: "not graded here"), the run was asked not to time it
  (``--speed skip``: :data:`~autograder.results.SPEED_NOT_MEASURED`), or it is a hidden check
  graded without the answer key. A SKIP never earns points anywhere (nbgrader's bridge,
  Gradescope's ``results.json`` and the CLI count it the same way);
- ``needs_timing`` names its function, until a run that can judge it does so.

- ``checks.csv``: per assignment and check, how many students passed, failed or were skipped
  on it (the part of an assignment the class found hard);
- ``scores.png``: a histogram of the scores of each assignment;
- ``gradebook.csv``: one row per student, one column of points per assignment (the shape of a
  learning platform's grade import, e.g. Moodle's "Import grades: CSV file": map ``student``
  to the user's ID number or username, and each column to a grade item);
- ``export_nbgrader``: the scores into an nbgrader gradebook database, one grade per graded
  function (nbgrader's grade cells), so ``nbgrader export`` and the formgrader show them.
"""
from __future__ import annotations

import csv
import io
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..keys import is_reserved
from ..results import SKIP_EARNS_NOTHING, SKIPPED, SPEED_NOT_MEASURED, atomic_write

GRADED = "graded"
#: how ``needs_timing`` marks a speed check that the run was asked not to time
NOT_MEASURED_MARK = " (--speed skip)"


def points_of(result: dict) -> float:
    """The points a check counts for in the class's grade: a SKIP earns nothing."""
    if result.get("status") == SKIPPED:
        return 0.0
    return float(result.get("points", 0))


@dataclass
class Tally:
    score: float
    max_score: float        # every check's points: one maximum per assignment
    not_judged: float       # points of the checks that SKIPped (counted by :func:`points_of`)
    needs_timing: str       # their functions, "f, g (--speed skip)"


def tally(results: list[dict]) -> Tally:
    """A report's checks under the class rule (the module's docstring)."""
    needs = []
    for r in results:
        if r.get("status") == SKIPPED:
            mark = (NOT_MEASURED_MARK if r.get("message") == SPEED_NOT_MEASURED else
                    " (hidden: no answer key here)" if is_reserved(r) else "")
            needs.append(f"{r.get('function', r.get('name', '?'))}{mark}")
    return Tally(sum(points_of(r) for r in results),
                 sum(float(r.get("max_points", 0)) for r in results),
                 sum(float(r.get("max_points", 0)) for r in results if r.get("status") == SKIPPED),
                 ", ".join(dict.fromkeys(needs)))


def assignment_points(assignment: str | None) -> float:
    """All the points of ``assignment`` (0 for an unknown one)."""
    from ..checking.spec import functions_of

    try:
        return float(sum(functions_of(assignment).values())) if assignment else 0.0
    except (ImportError, AttributeError):
        return 0.0


def rule_text() -> str:
    """The rule as the CLI states it after a class run or a merge."""
    return ("A check this machine could not judge (SKIP \"not graded here\": too few cores or "
            "GPUs, or too loaded even when re-timed alone at the end of the run) counts in "
            "max_score for every student and earns 0, as does one not measured on purpose "
            "(--speed skip): a SKIP never earns points. needs_timing names them: rerun "
            "grade-folder on hardware that can time them (without --speed skip) and only those "
            "are timed. A hidden check graded without the answer keys (\"hidden: no answer key "
            "here\": solutions/ absent) counts in max_score and earns 0: grade with the keys "
            "(the instructor's repository, or make docker-grade REFERENCE=1).")


def rule_lines(rows, shown: int = 10) -> list[str]:
    """What the CLI prints after a class run or a merge when some check was not judged: who
    still needs a timing, and the rule their score was counted by."""
    waiting = [g for g in rows if g.status == GRADED and g.needs_timing]
    if not waiting:
        return []
    names = "; ".join(f"{g.key}: {g.needs_timing}" for g in waiting[:shown])
    more = f"; and {len(waiting) - shown} more" if len(waiting) > shown else ""
    return [f"{len(waiting)} of {len(rows)} notebook(s) still need a timing (needs_timing in "
            f"grades.csv): {names}{more}", rule_text()]


def student_results(report: dict) -> dict:
    """``results.json`` for the student (Gradescope's format, :func:`autograder.results.gradescope`)
    with the class rule: a skipped check shows 0 out of its maximum, why it was not judged, and
    that a skipped check earns no points."""
    from dataclasses import fields

    from ..results import CheckResult, Report, gradescope

    names = {f.name for f in fields(CheckResult)}
    checks = [CheckResult(**{"seconds": 0.0, **{k: v for k, v in r.items() if k in names}})
              for r in report["results"]]
    out = gradescope(Report(report.get("assignment", ""), report.get("hardware", ""),
                            report.get("isolation", ""), report.get("seed", 0), checks,
                            list(report.get("notes", []))))
    for test, r in zip(out["tests"], report["results"]):
        if r.get("status") == SKIPPED:
            test.update(score=0.0, max_score=float(r.get("max_points", 0)), status="failed",
                        output=f"Not graded on the grading machine: {r.get('message', '')}\n"
                               f"{SKIP_EARNS_NOTHING}")
    t = tally(report["results"])
    out["score"] = t.score
    if t.needs_timing:
        out["output"] += f"\nNeeds timing: {t.needs_timing}"
    return out


def check_summary(rows) -> list[dict]:
    """``[{assignment, check, function, points, passed, failed, skipped, students}]``."""
    counts: dict[tuple, dict] = {}
    for g in rows:
        if g.status != GRADED:
            continue
        for r in g.report.get("results", []):
            key = (g.assignment, r["name"])
            c = counts.setdefault(key, {"assignment": g.assignment, "check": r["name"],
                                        "function": r.get("function", ""),
                                        "points": r.get("max_points", 0), "passed": 0,
                                        "failed": 0, "skipped": 0, "students": 0})
            c["students"] += 1
            status = r.get("status")
            if status in ("passed", "failed", "skipped"):
                c[status] += 1
    return list(counts.values())


def _csv(fieldnames, dicts) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fieldnames, lineterminator="\n")
    w.writeheader()
    w.writerows(dicts)
    return buf.getvalue()


def wide_rows(rows) -> tuple[list[str], list[dict]]:
    """Columns and rows of ``gradebook.csv`` (a student with several notebooks of one
    assignment gets their best score)."""
    assignments = sorted({g.assignment for g in rows if g.assignment})
    table: dict[str, dict] = defaultdict(dict)
    for g in rows:
        if g.assignment:
            best = table[g.student].get(g.assignment)
            table[g.student][g.assignment] = g.score if best is None else max(best, g.score)
    out = [{"student": s, **{a: f"{v[a]:g}" if a in v else "" for a in assignments}}
           for s, v in sorted(table.items())]
    return ["student", *assignments], out


def histogram_png(path: Path, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = defaultdict(list)
    for g in rows:
        if g.assignment:
            by[g.assignment].append((g.score, g.max_score))
    if not by:
        return
    fig, axes = plt.subplots(1, len(by), figsize=(4 * len(by), 3), squeeze=False)
    for ax, (name, scores) in zip(axes[0], sorted(by.items())):
        top = max(m for _, m in scores) or 1
        ax.hist([s for s, _ in scores], bins=min(20, max(5, int(top) + 1)), range=(0, top))
        ax.set(title=f"{name} ({len(scores)})", xlabel="score", ylabel="students")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)
    os.replace(tmp, path)


def write_summary(out: Path, rows) -> None:
    checks = check_summary(rows)
    atomic_write(out / "checks.csv", _csv(["assignment", "check", "function", "points",
                                           "passed", "failed", "skipped", "students"], checks))
    fields, wide = wide_rows(rows)
    atomic_write(out / "gradebook.csv", _csv(fields, wide))
    histogram_png(out / "scores.png", rows)


def export_nbgrader(db: str | Path, rows) -> int:
    """Write each graded row into the nbgrader gradebook ``db`` (an sqlite file): the
    assignment, its notebook and the grade cell of each graded function (``check_<function>``,
    the ``grade_id`` of the release's test cell, as ``nbgrader generate_assignment`` records
    it) with the points earned as ``auto_score``. Returns how
    many submissions were written."""
    from nbgrader.api import Gradebook

    from ..checking.spec import functions_of
    from ..registry import get

    url = str(db) if "://" in str(db) else f"sqlite:///{Path(db).resolve()}"
    # nbgrader creates a new database with the `alembic` command of its environment
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [bin_dir, os.environ.get("PATH")]))
    written = 0
    with Gradebook(url) as gb:
        for g in rows:
            if g.status != GRADED or not g.assignment:
                continue
            notebook = Path(get(g.assignment).notebook).stem
            points = functions_of(g.assignment)
            gb.update_or_create_assignment(g.assignment)
            gb.update_or_create_notebook(notebook, g.assignment)
            for function, p in points.items():  # the release's test cells: check_<function>
                gb.update_or_create_grade_cell(f"check_{function}", notebook, g.assignment,
                                               max_score=p, cell_type="code")
            gb.update_or_create_student(g.student)
            gb.update_or_create_submission(g.assignment, g.student)
            earned = defaultdict(float)
            for r in g.report.get("results", []):
                earned[r["function"]] += points_of(r)   # the class rule, as grades.csv
            for function in points:
                grade = gb.find_grade(f"check_{function}", notebook, g.assignment, g.student)
                grade.auto_score = earned.get(function, 0.0)
            gb.db.commit()
            written += 1
    return written
