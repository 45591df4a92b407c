"""``python -m autograder``: the grader's commands.

- ``grade NOTEBOOK [--assignment A] [--only F,CHECK] [--seed N] [--speed skip] [--json
  results.json] [--report report.json]``: grade one submission. The flow a newcomer can follow:
  :func:`autograder.submission.load_submission` (trusted notebook + the student's answer cells)
  -> :func:`autograder.checking.harness.run_checks` (pytest, the student code in a sandboxed
  child) -> :mod:`autograder.report` (the table) and :mod:`autograder.results` (JSON shapes).
- ``grade-folder SUBMISSIONS OUT [--jobs N] [--shard K/N]``: grade a class
  (:mod:`autograder.integrations.batch`); ``merge OUT1 OUT2 ... --out OUT`` joins shards;
  ``gradescope build|run`` (:mod:`~autograder.integrations.gradescope`); ``edition OUT`` (the
  student edition, :mod:`~autograder.integrations.edition`).
- ``calibrate [--assignment A]``: measure the reference's call times on this machine, from
  which grading derives its call timeouts (:mod:`autograder.checking.timeouts`).
- ``grade-objects``: internal, what ``check()`` in a notebook sends.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autograder", description="Grade workshop assignments.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grade", help="grade one submitted notebook")
    g.add_argument("notebook", help="the submitted .ipynb")
    g.add_argument("--assignment", help="assignment name (default: detected from the notebook)")
    g.add_argument("--json", metavar="PATH", help="write Gradescope results.json here")
    sub.add_parser("grade-folder", add_help=False,
                   help="grade every notebook under SUBMISSIONS into OUT (grades.csv and "
                        "per-student results); see grade-folder --help")
    sub.add_parser("merge", add_help=False,
                   help="join the OUT folders of grade-folder --shard runs; see merge --help")
    sub.add_parser("gradescope", add_help=False, help="Gradescope bundles: gradescope --help")
    sub.add_parser("edition", add_help=False, help="the student edition: edition --help")
    c = sub.add_parser("calibrate", help="time the reference solutions here (sets call timeouts)")
    c.add_argument("--assignment", action="append", help="only these (default: all)")
    k = sub.add_parser("grade-objects", help="internal: grades what check() sends from a kernel")
    k.add_argument("pickle")
    k.add_argument("--assignment", required=True)
    for cmd in (g, k):
        cmd.add_argument("--only", metavar="NAMES",
                         help="grade only the checks of these functions, or these checks "
                              "(comma-separated names)")
        cmd.add_argument("--seed", type=int, help="the inputs' seed (a report prints its own)")
        cmd.add_argument("--report", metavar="PATH", help="write the full report as JSON here")
        cmd.add_argument("--progress", metavar="PATH",
                         help="append each check's result here as it ends, a JSON line each "
                              "(what check() shows while a grading runs)")
        cmd.add_argument("--speed", choices=("measure", "skip"),
                         default=os.environ.get("AUTOGRADER_SPEED", "measure"),
                         help="skip: speed checks SKIP with that reason, nothing is timed (for "
                              "a machine whose timings mean nothing, e.g. shared; default: "
                              "$AUTOGRADER_SPEED or measure)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tools = {"grade-folder": "batch", "merge": "merge", "gradescope": "gradescope",
             "edition": "edition"}
    if argv[:1] and argv[0] in tools:
        # only the tool asked for: `edition` runs on a host with Python alone (make
        # docker-work, before any venv), where the grading tools' imports (psutil, torch) fail
        import importlib

        return importlib.import_module(f".integrations.{tools[argv[0]]}", __package__).main(
            argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "calibrate":
        return calibrate(args.assignment)
    from .checking.harness import run_checks
    from .notebook import runnable_cells
    from .registry import get
    from .report import table
    from .results import failure_results, gradescope, write_json
    from .sandbox.isolation import reference_exposed
    from .submission import SubmissionError, load_submission

    if args.command == "grade":
        try:
            if (why := reference_exposed()) is not None:
                raise SubmissionError(f"grading refused: {why}")
            sub = load_submission(args.notebook, args.assignment)
            if (why := _only_error(sub.assignment, args.only)) is not None:
                raise SubmissionError(why)
        except SubmissionError as exc:
            print(f"Cannot grade {args.notebook}: {exc}\nScore: 0")
            if args.json:
                write_json(args.json, failure_results(f"Cannot grade this submission: {exc}"))
            if args.report:
                write_json(args.report, {"assignment": args.assignment, "score": 0,
                                         "max_score": 0, "error": str(exc), "results": []})
            return 2
        report = run_checks(sub.assignment, sub.cells, only=args.only, problems=sub.problems,
                            seed=args.seed, measure_speed=args.speed == "measure",
                            progress=_progress_writer(args.progress))
    else:  # grade-objects: the kernel's own definitions, after the trusted set-up cells
        setup = [c for c in runnable_cells(get(args.assignment).release) if c[0] == "setup"]
        report = run_checks(args.assignment, setup, objects=Path(args.pickle).read_bytes(),
                            only=args.only, seed=args.seed,
                            measure_speed=args.speed == "measure",
                            progress=_progress_writer(args.progress))
    print(table(report))
    if getattr(args, "json", None):
        write_json(args.json, gradescope(report))
    if args.report:
        write_json(args.report, report.to_dict())
    return 0


def _only_error(assignment: str, only: str | None) -> str | None:
    """What is wrong with ``--only``: a name that is neither a function nor a check of the
    assignment (it would grade nothing, silently), or None."""
    if not only:
        return None
    from .checking.harness import only_names
    from .checking.spec import load_spec

    checks = load_spec(assignment).checks
    unknown = sorted(only_names(only) - {c.function for c in checks} - {c.name for c in checks})
    if not unknown:
        return None
    return (f"--only names no function or check of {assignment}: {', '.join(unknown)} (its "
            f"functions: {', '.join(dict.fromkeys(c.function for c in checks))})")


def _progress_writer(path: str | None):
    """``--progress PATH``: each result as a JSON line, flushed as it ends. In a terminal (and
    without it), each check's line as it ends, before the table."""
    import json
    from dataclasses import asdict

    from .results import result_lines

    terminal = not path and sys.stdout.isatty()
    if not path and not terminal:
        return None

    def write(result) -> None:
        if terminal:
            print(result_lines(asdict(result))[0], flush=True)
            return
        with open(path, "a") as f:
            f.write(json.dumps(asdict(result)) + "\n")

    return write


def calibrate(names: list[str] | None) -> int:
    """Grade each reference solution here and keep its calls' times (see timeouts.py)."""
    from .checking import timeouts
    from .invoke import run_grader
    from .registry import ASSIGNMENTS

    for name in names or list(ASSIGNMENTS):
        a = ASSIGNMENTS[name]
        if not a.source.exists():
            print(f"{name}: no reference solution here (student edition?): not calibrated")
            continue
        run = run_grader(["grade", str(a.source), "--assignment", name], timeout=1800)
        results = (run.report or {}).get("results") or []
        if not results or any(r["status"] == "failed" for r in results):
            print(f"{name}: the reference did not pass here; not calibrated\n{run.output[-1500:]}")
            return 1
        path = timeouts.save(name, {r["name"]: r["call_seconds"] for r in results})
        slowest = max(results, key=lambda r: r["call_seconds"])
        print(f"{name}: calibrated from {len(results)} checks in {run.seconds:.0f} s (longest "
              f"call {slowest['call_seconds']:.2f} s in {slowest['name']}); saved in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
