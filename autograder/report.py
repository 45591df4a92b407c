"""Printing a :class:`~autograder.harness.Report` for people, and writing it for Gradescope."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .harness import Report

STATUS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def _fmt(x: float) -> str:
    return f"{x:g}"


def table(report: Report) -> str:
    rows = [("check", "points", "status", "seconds", "message")]
    for r in report.results:
        message = " ".join(r.message.split())
        if len(message) > 160:
            message = message[:157] + "..."
        rows.append((f"{r.function}: {r.name}", f"{_fmt(r.points)}/{_fmt(r.max_points)}",
                     STATUS.get(r.status, r.status), f"{r.seconds:.1f}", message))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    lines.insert(1, "-" * min(120, len(lines[0])))
    skipped = [r for r in report.results if r.status == "skipped"]
    out = [f"Assignment {report.assignment}", *lines, "",
           f"Total: {_fmt(report.score)} / {_fmt(report.max_score)}"
           + (f"  ({_fmt(sum(r.max_points for r in skipped))} more point(s) not graded on this "
              "machine: see SKIP lines)" if skipped else "")]
    out.append(f"Hardware: {report.hardware}")
    out.append(f"Isolation: {report.isolation}")
    out += [f"Note: {n}" for n in report.notes]
    return "\n".join(out)


def gradescope(report: Report) -> dict:
    """Gradescope's results.json: one test per check; skipped checks score 0 of 0 with the reason."""
    tests = []
    for r in report.results:
        out = r.message if r.status != "passed" else ""
        if r.status == "skipped":
            out = f"Not graded on this machine: {r.message}"
        tests.append({"name": f"{r.function}: {r.name}", "score": r.points,
                      "max_score": 0 if r.status == "skipped" else r.max_points,
                      "status": "passed" if r.status == "passed" else "failed",
                      "output": out})
    return {"score": report.score, "output": "\n".join(
        [f"Hardware: {report.hardware}", *report.notes]), "tests": tests,
        "visibility": "visible", "stdout_visibility": "hidden"}


def atomic_write(path: str | Path, text: str) -> None:
    """Write via a temporary file and a rename: a symlink planted at ``path`` is replaced,
    never followed, and a reader never sees half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(report: Report, path: str | Path) -> None:
    atomic_write(path, json.dumps(gradescope(report), indent=2))
