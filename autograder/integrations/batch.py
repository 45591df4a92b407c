"""Grade a folder of submissions: ``python -m autograder grade-folder SUBMISSIONS OUT
[--assignment A] [--jobs N] [--shard K/N] [--speed measure|skip] [--force] [--nbgrader-db PATH]``.

Layout of SUBMISSIONS, one student per entry:

- ``<student>.ipynb``, or
- ``<student>/<anything>.ipynb`` at any depth (nbgrader's ``submitted/<student>/<assignment>/``
  works as it is). Hidden files and folders (``.ipynb_checkpoints``) are ignored.

Each notebook is graded by the CLI (``python -m autograder grade``) in its own process with a
time limit: a broken, hostile or endless notebook costs its student a zero with the reason, and
grading goes on with the next one. ``--jobs N`` grades N at once, each on cores (and GPUs) of
its own, as many as its assignment's speed checks need (:mod:`.jobs`); by default as many as
the machine holds. ``--shard K/N`` grades one stable slice of the students (:mod:`.shards`;
``python -m autograder merge`` joins the slices, :mod:`.merge`). A rerun keeps the results of
notebooks that have not changed (:mod:`.store`; ``--force`` regrades).

Checks the machine could not judge (a speed check's SKIP "not graded here") are re-timed at the
end, one notebook at a time on the whole machine (:mod:`.retime`; not under ``--speed skip``).
What stays unjudged counts by one rule for every student (:func:`.gradebook.tally`): in
``max_score`` always, so an assignment has one maximum, for 0 points (a SKIP never earns
points), and named in ``needs_timing``.

OUT receives ``grades.csv`` (student, assignment, score, max_score, status, needs_timing,
...), the class summaries (``checks.csv``, ``scores.png``, ``gradebook.csv``:
:mod:`.gradebook`), ``shard.json`` (the class and the slice) and, per student,
``<student>/results.json`` (Gradescope's format: what the student may read), ``report.json``
(the full report), ``output.txt`` (the table the CLI printed) and ``grading.json`` (the row
and the notebook's fingerprint). A student with several notebooks gets one sub-folder per
notebook.

Everything in OUT is written again from memory after the last notebook, so code that ran during
grading cannot leave altered results behind.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..invoke import run_grader
from ..results import atomic_write, failure_results
from ..sandbox.isolation import reference_exposed
from . import gradebook, retime, store
from . import jobs as jobs_
from .progress import Progress
from .shards import parse_shard, select, shard_of
CSV_FIELDS = ["student", "assignment", "score", "max_score", "status", "not_graded_points",
              "needs_timing", "notebook", "message"]
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
    score: float               # by the class rule (gradebook.tally)
    max_score: float           # all the assignment's points, judged here or not
    status: str
    not_graded_points: float   # points of the checks not judged (SKIP lines), in max_score
    message: str
    key: str                   # folder of this result inside OUT
    results: dict              # Gradescope results.json
    report: dict               # full report (may be empty)
    output: str                # what the CLI printed
    seconds: float = 0.0       # how long grading took
    needs_timing: str = ""     # functions of the checks not judged ("f, g (--speed skip)")

    def line(self) -> str:
        """One line for the log."""
        return (f"{self.key or self.notebook}: {self.status}, {self.score:g}/{self.max_score:g} "
                f"({self.seconds:.0f} s)" + (f": {self.message[:100]}" if self.message else "")
                + (f"; needs timing: {self.needs_timing}" if self.needs_timing else ""))


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


def grade_one(notebook: Path, workdir: Path, assignment: str | None = None,
              timeout: float = DEFAULT_TIMEOUT, student: str = "", relpath: str = "",
              key: str = "", seed: int | None = None, env: dict | None = None,
              cpus: list[int] | None = None, on_start=None, only: str | None = None,
              speed: str | None = None) -> Graded:
    """Grade one notebook with the CLI in a fresh process; never raises for a bad notebook.

    ``workdir`` is a scratch folder for the CLI's results.json (read back right after it exits);
    ``env``, ``cpus`` and ``on_start`` come from the job it runs in (:mod:`.jobs`); ``only``
    and ``speed`` are the CLI's ``--only`` and ``--speed``. The row is :func:`settled`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    results_path = workdir / "results.json"
    results_path.unlink(missing_ok=True)
    args = ["grade", str(Path(notebook).resolve()), "--json", str(results_path)]
    args += ["--assignment", assignment] if assignment else []
    args += ["--seed", str(seed)] if seed is not None else []
    args += ["--only", only] if only else []
    args += ["--speed", speed] if speed else []
    run = run_grader(args, timeout=timeout, env=env, cpus=cpus, on_start=on_start)
    output = run.output[-OUTPUT_TAIL:]
    try:
        results = json.loads(results_path.read_text())
        results = results if isinstance(results, dict) else {}
    except (OSError, ValueError):
        results = {}
    report = run.report or {}
    name = report.get("assignment") or assignment or ""
    if run.timed_out:
        status, message = TIMEOUT, f"grading took longer than {timeout:g} s and was stopped"
    elif report.get("error"):
        status, message = UNGRADABLE, str(report["error"])
    elif report.get("results") is not None and "score" in report and run.returncode == 0:
        status, message = GRADED, ""
    else:
        status = CRASHED
        message = (f"the grader stopped (exit code {run.returncode}) without a report: "
                   + " | ".join(output.strip().splitlines()[-3:]))[:500]
    if status != GRADED:
        results = results if status == UNGRADABLE and results else failure_results(
            f"Not graded: {message}")
    return settled(Graded(student=student, notebook=relpath or str(notebook), assignment=name,
                          score=0.0, max_score=0.0, status=status, not_graded_points=0.0,
                          message=message, key=key or student, results=results,
                          report=report, output=output, seconds=run.seconds))


def settled(g: Graded) -> Graded:
    """``g`` with its score, maximum, unjudged points, ``needs_timing`` and results.json counted
    from its report by the class rule (:func:`.gradebook.tally`): a first pass, a re-timing, a
    kept result and a merge all count the same way."""
    if g.status == GRADED and g.report.get("results") is not None:
        t = gradebook.tally(g.report["results"])
        g.score, g.max_score, g.not_graded_points = t.score, t.max_score, t.not_judged
        g.needs_timing, g.results = t.needs_timing, gradebook.student_results(g.report)
    elif g.status != GRADED:   # nothing earned, out of the assignment's one maximum
        g.score, g.not_graded_points, g.needs_timing = 0.0, 0.0, ""
        g.max_score = gradebook.assignment_points(g.assignment)
    return g


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


def write_grades(out: Path, rows: list[Graded]) -> None:
    atomic_write(out / "grades.csv", csv_text(rows))


class GradingRefused(Exception):
    """Grading here would expose the reference solutions to graded code."""


def plan(root: Path, out: Path, shard: tuple[int, int] | None) -> list[tuple[str, Path, str]]:
    """``[(student, notebook, key)]`` to grade in this run, and ``OUT/shard.json`` saying which
    students the whole class has and which slice each is in (``merge`` reports the missing)."""
    subs = find_submissions(root, exclude=[out])
    items = [(student, path, key) for (student, path), key in zip(subs, _keys(subs, root))]
    n = shard[1] if shard else 1
    manifest = {"shard": list(shard) if shard else [1, 1],
                "class": {key: shard_of(student, n) for student, _, key in items}}
    atomic_write(out / "shard.json", json.dumps(manifest, indent=1))
    return select(items, *shard) if shard else items


def assignment_of(path: Path, given: str | None) -> str | None:
    """The assignment a notebook will be graded as (for its job's size only)."""
    if given:
        return given
    try:
        import nbformat

        from ..submission import detect
        return detect(nbformat.read(path, as_version=4))
    except Exception:  # noqa: BLE001 - unreadable: the grader reports it, on one core
        return None


def grade_folder(submissions_dir: str | Path, out_dir: str | Path, assignment: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, seed: int | None = None,
                 jobs: int | None = None, shard: tuple[int, int] | None = None,
                 force: bool = False, progress_stream=None,
                 speed: str | None = None) -> list[Graded]:
    """Grade every notebook under ``submissions_dir`` (or slice ``shard`` of them), ``jobs``
    at a time (None: as many as the machine holds), then re-time what could not be judged
    (:mod:`.retime`); write ``out_dir``; return the rows. ``speed``: ``measure`` or ``skip``
    (None: ``$AUTOGRADER_SPEED``, else measure)."""
    root, out = Path(submissions_dir).resolve(), Path(out_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{submissions_dir}: no such folder")
    why = reference_exposed()
    if why is not None:
        raise GradingRefused(why)
    speed = speed or os.environ.get("AUTOGRADER_SPEED", "measure")
    out.mkdir(parents=True, exist_ok=True)
    store.clear_work(out)
    items = plan(root, out, shard)
    rows: dict[int, Graded] = {}
    todo, fps = [], {}
    for i, (student, path, key) in enumerate(items):
        fps[key] = fp = store.fingerprint(path, assignment, seed)
        kept = None if force else store.read_result(out, key, fp, Graded)
        if kept is not None:
            rows[i] = settled(kept)   # by this run's rule, as a merge would
        else:
            todo.append((i, student, path, key, fp))
    cores, gpus = jobs_.usable_cores(), jobs_.visible_gpus()
    needs = [jobs_.needs_of(assignment_of(t[2], assignment), len(cores), len(gpus)) for t in todo]
    jobs = jobs or jobs_.capacity(needs, len(cores), len(gpus))
    print(f"Grading {len(todo)} of {len(items)} notebook(s) from {root} into {out}"
          + (f" (shard {shard[0]}/{shard[1]})" if shard else "")
          + (f"; {len(items) - len(todo)} kept from an earlier run (--force regrades)"
             if len(todo) < len(items) else "")
          + f"; {jobs} at a time on {len(cores)} core(s), {len(gpus)} GPU(s)"
          + ("; --speed skip: nothing is timed or re-timed" if speed != "measure" else ""),
          flush=True)
    progress = Progress(len(items), progress_stream)
    for i in sorted(rows):
        progress.update(rows[i].line() + " (kept)", rows[i].status != GRADED)
    running = jobs_.Running()
    # jobs' temporary folders (the sandboxes' among them) outside OUT, which graded code
    # has no business near
    scratch = Path(tempfile.mkdtemp(prefix="grade-folder-"))
    allocator = jobs_.Allocator(cores, gpus, scratch)

    def work(item, slot):
        i, student, path, key, fp = item
        pids = []

        def started(pid):
            pids.append(pid)
            running.started(pid)
        try:
            return grade_one(path, slot.tmp, assignment, timeout, student=student,
                             relpath=str(path.relative_to(root)), key=key, seed=seed,
                             env=slot.env(), cpus=list(slot.cores), on_start=started,
                             speed=speed)
        finally:
            for pid in pids:
                running.finished(pid)

    def done(item, g):
        rows[item[0]] = g
        store.write_result(out, g, item[4])
        write_grades(out, [rows[i] for i in sorted(rows)])
        progress.update(g.line(), g.status != GRADED)

    ordered = [rows[i] for i in sorted(rows)]

    def regrade(g, functions, slot, started):   # the first pass's seed, these checks only
        return grade_one(root / g.notebook, slot.tmp, g.assignment, timeout, student=g.student,
                         relpath=g.notebook, key=g.key, seed=g.report.get("seed", seed),
                         env=slot.env(), cpus=list(slot.cores), on_start=started,
                         only=",".join(functions), speed="measure")

    def persist(g):
        store.write_result(out, settled(g), fps[g.key])
        write_grades(out, ordered)

    try:
        jobs_.run_jobs(todo, needs, work, jobs, allocator, running, done)
        progress.close()
        ordered[:] = [rows[i] for i in sorted(rows)]
        retime.retime(ordered, regrade, persist, speed=speed, cores=cores, gpus=gpus,
                      scratch=scratch, running=running, stream=progress_stream)
    finally:
        progress.close()
        shutil.rmtree(scratch, ignore_errors=True)
    # again, from memory: undo anything graded code wrote meanwhile
    for g in ordered:
        store.write_result(out, g, fps[g.key])
    write_grades(out, ordered)
    store.clear_work(out)
    gradebook.write_summary(out, ordered)
    return ordered


def summary(rows: list[Graded]) -> str:
    lines = [f"{'student':<24} {'assignment':<22} {'score':>12}  status"]
    for g in rows:
        lines.append(f"{g.student:<24} {g.assignment:<22} {f'{g.score:g}/{g.max_score:g}':>12}  "
                     f"{g.status}" + (f": {g.message[:80]}" if g.message else "")
                     + (f" (needs timing: {g.needs_timing})" if g.needs_timing else ""))
    rule = gradebook.rule_lines(rows)
    return "\n".join(lines + ([""] + rule if rule else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder grade-folder",
                                description="Grade every notebook in a folder of submissions.")
    p.add_argument("submissions", help="folder: <student>.ipynb or <student>/.../*.ipynb")
    p.add_argument("out", help="folder for grades.csv and per-student results")
    p.add_argument("--assignment", help="grade every notebook as this assignment "
                                        "(default: detected per notebook)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds per notebook (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--seed", type=int, help="the inputs' seed for every notebook (a regrade "
                   "with a report's seed repeats its inputs)")
    p.add_argument("--jobs", type=int, help="notebooks graded at once, each on its own cores "
                   "and GPUs (default: as many as this machine holds for the assignments' "
                   "speed checks)")
    p.add_argument("--shard", metavar="K/N", help="grade only the K-th of N stable slices of "
                   "the students (join the slices' OUT folders with `merge`)")
    p.add_argument("--force", action="store_true", help="regrade notebooks whose results "
                   "in OUT are from the same notebook content")
    p.add_argument("--speed", choices=("measure", "skip"),
                   default=os.environ.get("AUTOGRADER_SPEED", "measure"),
                   help="skip: time nothing (speed checks count in max_score, earn 0 and are "
                        "named in needs_timing; a later run that measures times only those); "
                        "measure: checks the machine could not judge are re-timed at the end, "
                        "alone (default: $AUTOGRADER_SPEED or measure)")
    p.add_argument("--nbgrader-db", metavar="PATH", help="also write the scores into this "
                   "nbgrader gradebook (sqlite file; created if absent)")
    args = p.parse_args(argv)
    try:
        shard = parse_shard(args.shard) if args.shard else None
        if args.jobs is not None and args.jobs < 1:
            raise ValueError("--jobs must be 1 or more")
    except ValueError as exc:
        p.error(str(exc))
    try:
        rows = grade_folder(args.submissions, args.out, args.assignment, args.timeout, args.seed,
                            jobs=args.jobs, shard=shard, force=args.force, speed=args.speed)
    except (FileNotFoundError, GradingRefused) as exc:
        print(f"Cannot grade: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, GradingRefused) else 1
    except KeyboardInterrupt:
        print("Interrupted: finished notebooks are kept; rerun the same command to go on",
              file=sys.stderr)
        return 130
    if not rows:
        print(f"No notebooks found in {args.submissions}"
              + (f" for shard {args.shard}" if shard else ""), file=sys.stderr)
        return 0 if shard else 1
    if args.nbgrader_db:
        gradebook.export_nbgrader(args.nbgrader_db, rows)
    print(summary(rows))
    print(f"Wrote {Path(args.out) / 'grades.csv'}")
    bad = [g for g in rows if g.status != GRADED]
    if bad:
        print(f"{len(bad)} notebook(s) could not be graded (status column)")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
