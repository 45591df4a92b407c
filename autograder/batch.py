"""Grade a folder of submissions: ``python -m autograder.batch SUBMISSIONS OUT [--assignment A]``.

Layout of SUBMISSIONS, one student per entry:

- ``<student>.ipynb``, or
- ``<student>/<anything>.ipynb`` at any depth (nbgrader's ``submitted/<student>/<assignment>/``
  works as it is). Hidden files and folders (``.ipynb_checkpoints``) are ignored.

Each notebook is graded by the CLI (``python -m autograder grade``) in its own process with a
time limit: a broken, hostile or endless notebook costs its student a zero with the reason, and
grading goes on with the next one. Notebooks are graded one after the other on purpose: speedup
checks need the machine to themselves.

OUT receives ``grades.csv`` (student, assignment, score, max_score, status, ...) and, per
student, ``<student>/results.json`` (Gradescope's format: what the student may read),
``report.json`` (the full report) and ``output.txt`` (the table the CLI printed). A student with
several notebooks gets one sub-folder per notebook.

Everything in OUT is written again from memory after the last notebook, so code that ran during
grading cannot leave altered results behind.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from .sandbox import kill_tree

REPO = Path(__file__).resolve().parents[1]
CSV_FIELDS = ["student", "assignment", "score", "max_score", "status", "not_graded_points",
              "notebook", "message"]
DEFAULT_TIMEOUT = 900.0
OUTPUT_TAIL = 4000

# status values in grades.csv
GRADED = "graded"        # the checks ran; score is the grade (may be 0)
UNGRADABLE = "error"     # the file is not a gradable notebook of a known assignment
TIMEOUT = "timeout"      # grading did not finish in time
CRASHED = "crashed"      # the grader itself stopped without a report


@dataclass
class Graded:
    student: str
    notebook: str              # path relative to the submissions folder
    assignment: str
    score: float
    max_score: float           # points that could be earned on this machine
    status: str
    not_graded_points: float   # points of checks skipped on this machine (SKIP lines)
    message: str
    key: str                   # folder of this result inside OUT
    results: dict              # Gradescope results.json
    report: dict               # full report (may be empty)
    output: str                # what the CLI printed


def find_submissions(root: Path, exclude: list[Path] = ()) -> list[tuple[str, Path]]:
    """``[(student, notebook)]`` under ``root``, sorted; skips hidden paths, links and ``exclude``."""
    root = Path(root)
    exclude = [Path(e).resolve() for e in exclude]
    found = []
    for path in sorted(root.rglob("*.ipynb")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_symlink() or not path.is_file():
            continue
        if any(path.resolve().is_relative_to(e) for e in exclude):
            continue
        student = rel.stem if len(rel.parts) == 1 else rel.parts[0]
        found.append((student, path))
    return found


def _failure_results(message: str) -> dict:
    return {"score": 0, "output": message, "tests": []}


def grade_one(notebook: Path, workdir: Path, assignment: str | None = None,
              timeout: float = DEFAULT_TIMEOUT, student: str = "", relpath: str = "",
              key: str = "") -> Graded:
    """Grade one notebook with the CLI in a fresh process; never raises for a bad notebook.

    ``workdir`` is a scratch folder for the CLI's report files (read back here, right after the
    CLI exits).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    report_path, results_path = workdir / "report.json", workdir / "results.json"
    for stale in (report_path, results_path):
        stale.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "autograder", "grade", str(Path(notebook).resolve()),
           "--report", str(report_path), "--json", str(results_path)]
    if assignment:
        cmd += ["--assignment", assignment]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    start = time.monotonic()
    spare = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, spare)  # its group, every descendant, escaped ones too
        output, _ = proc.communicate()
        timed_out = True
    output = (output or "")[-OUTPUT_TAIL:]
    seconds = time.monotonic() - start

    def read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    report, results = read(report_path), read(results_path)
    name = report.get("assignment") or assignment or ""
    if timed_out:
        status, message = TIMEOUT, f"grading took longer than {timeout:g} s and was stopped"
    elif report.get("error"):
        status, message = UNGRADABLE, str(report["error"])
    elif report.get("results") is not None and "score" in report and proc.returncode == 0:
        status, message = GRADED, ""
    else:
        status = CRASHED
        message = (f"the grader stopped (exit code {proc.returncode}) without a report: "
                   + " | ".join(output.strip().splitlines()[-3:]))[:500]
    if status == GRADED:
        score, max_score = float(report["score"]), float(report.get("max_score", 0))
        not_graded = sum(float(r.get("max_points", 0)) for r in report["results"]
                         if r.get("status") == "skipped")
        if not results:
            results = _failure_results("the grader wrote no results.json")
    else:
        score, max_score, not_graded = 0.0, float(report.get("max_score", 0) or 0), 0.0
        results = results if status == UNGRADABLE and results else _failure_results(
            f"Not graded: {message}")
    print(f"{student or notebook}: {status}, {score:g}/{max_score:g} ({seconds:.0f} s)", flush=True)
    return Graded(student=student, notebook=relpath or str(notebook), assignment=name,
                  score=score, max_score=max_score, status=status,
                  not_graded_points=not_graded, message=message, key=key or student,
                  results=results, report=report, output=output)


def _keys(subs: list[tuple[str, Path]], root: Path) -> list[str]:
    """Output folder per notebook: the student's name, or name/notebook when there are several."""
    counts: dict[str, int] = {}
    for student, _ in subs:
        counts[student] = counts.get(student, 0) + 1
    keys = []
    for student, path in subs:
        if counts[student] == 1:
            keys.append(student)
        else:
            inner = path.relative_to(root).parts[1:]
            keys.append(student + "/" + "__".join(inner).removesuffix(".ipynb"))
    return keys


def _write(path: Path, text: str) -> None:
    """Replace ``path`` (never follow a link planted there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.write_text(text)
    os.replace(tmp, path)


def csv_text(rows: list[Graded]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for g in rows:
        row = {k: v for k, v in asdict(g).items() if k in CSV_FIELDS}
        row.update(score=f"{g.score:g}", max_score=f"{g.max_score:g}",
                   not_graded_points=f"{g.not_graded_points:g}")
        writer.writerow(row)
    return buf.getvalue()


def write_student(out: Path, g: Graded) -> None:
    folder = out / g.key
    _write(folder / "results.json", json.dumps(g.results, indent=2))
    _write(folder / "report.json", json.dumps(
        g.report or {"status": g.status, "message": g.message}, indent=2))
    _write(folder / "output.txt", g.output)


def write_outputs(out: Path, rows: list[Graded]) -> None:
    """grades.csv and every student's files."""
    for g in rows:
        write_student(out, g)
    _write(out / "grades.csv", csv_text(rows))


def isolation_warning() -> str | None:
    """Say so when graded code could read the reference solutions on this machine."""
    from .assignments import ASSIGNMENTS
    from .sandbox import namespaces_available

    present = [a for a in ASSIGNMENTS.values() if a.source.exists()]
    if present and not namespaces_available():
        return ("WARNING: this machine cannot give graded code its own namespaces, and solutions/ "
                "is present: a submission's code could read the reference solutions while it is "
                "graded. Grade on a host with user namespaces, or without solutions/ (see "
                "docs/instructor.md).")
    return None


def grade_folder(submissions_dir: str | Path, out_dir: str | Path, assignment: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> list[Graded]:
    """Grade every notebook under ``submissions_dir``; write ``out_dir``; return the rows."""
    root, out = Path(submissions_dir).resolve(), Path(out_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{submissions_dir}: no such folder")
    out.mkdir(parents=True, exist_ok=True)
    subs = find_submissions(root, exclude=[out])
    warning = isolation_warning()
    if warning:
        print(warning, flush=True)
    print(f"Grading {len(subs)} notebook(s) from {root} into {out}", flush=True)
    rows: list[Graded] = []
    scratch = out / ".work"
    for (student, path), key in zip(subs, _keys(subs, root)):
        g = grade_one(path, scratch, assignment, timeout, student=student,
                      relpath=str(path.relative_to(root)), key=key)
        rows.append(g)
        write_student(out, g)
        _write(out / "grades.csv", csv_text(rows))
    for stale in (scratch / "report.json", scratch / "results.json"):
        stale.unlink(missing_ok=True)
    if scratch.exists() and not any(scratch.iterdir()):
        scratch.rmdir()
    write_outputs(out, rows)  # again, from memory: undo anything graded code wrote meanwhile
    return rows


def summary(rows: list[Graded]) -> str:
    lines = [f"{'student':<24} {'assignment':<22} {'score':>12}  status"]
    for g in rows:
        lines.append(f"{g.student:<24} {g.assignment:<22} {f'{g.score:g}/{g.max_score:g}':>12}  "
                     f"{g.status}" + (f": {g.message[:80]}" if g.message else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.batch",
                                description="Grade every notebook in a folder of submissions.")
    p.add_argument("submissions", help="folder: <student>.ipynb or <student>/.../*.ipynb")
    p.add_argument("out", help="folder for grades.csv and per-student results")
    p.add_argument("--assignment", help="grade every notebook as this assignment "
                                        "(default: detected per notebook)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds per notebook (default {DEFAULT_TIMEOUT:g})")
    args = p.parse_args(argv)
    try:
        rows = grade_folder(args.submissions, args.out, args.assignment, args.timeout)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not rows:
        print(f"No notebooks found in {args.submissions}", file=sys.stderr)
        return 1
    print(summary(rows))
    print(f"Wrote {Path(args.out) / 'grades.csv'}")
    bad = [g for g in rows if g.status != GRADED]
    if bad:
        print(f"{len(bad)} notebook(s) could not be graded (status column)")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
