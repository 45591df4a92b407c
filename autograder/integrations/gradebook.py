"""What an instructor reads across a class, written next to ``grades.csv``:

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
from pathlib import Path

from ..results import atomic_write

GRADED = "graded"


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
                earned[r["function"]] += float(r.get("points", 0))
            for function in points:
                grade = gb.find_grade(f"check_{function}", notebook, g.assignment, g.student)
                grade.auto_score = earned.get(function, 0.0)
            gb.db.commit()
            written += 1
    return written
