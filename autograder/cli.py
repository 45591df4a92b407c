"""``python -m autograder grade NOTEBOOK [--json results.json]``: grade one submission;
``python -m autograder grade-folder SUBMISSIONS OUT``: grade a class (:mod:`autograder.batch`).

The flow a newcomer can follow: :func:`autograder.submission.load_submission` (trusted
notebook + the student's answer cells) -> :func:`autograder.harness.run_checks` (pytest, the
student code in a sandboxed child) -> :mod:`autograder.report` (table, Gradescope JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autograder",
                                description="Grade workshop assignments.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grade", help="grade one submitted notebook")
    g.add_argument("notebook", help="the submitted .ipynb")
    g.add_argument("--assignment", help="assignment name (default: detected from the notebook)")
    g.add_argument("--only", metavar="FUNCTIONS",
                   help="grade only the checks of these functions (comma-separated)")
    g.add_argument("--json", metavar="PATH", help="write Gradescope results.json here")
    g.add_argument("--report", metavar="PATH", help="write the full report as JSON here")
    sub.add_parser("grade-folder", help="grade every notebook under SUBMISSIONS into OUT "
                   "(grades.csv and per-student results): grade-folder SUBMISSIONS OUT "
                   "[--assignment A] [--timeout S]", add_help=False)
    k = sub.add_parser("grade-objects", help="internal: grades what check() sends from a kernel")
    k.add_argument("pickle")
    k.add_argument("--assignment", required=True)
    k.add_argument("--only")
    k.add_argument("--report", metavar="PATH", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grade-folder"]:  # SUBMISSIONS OUT [--assignment A] [--timeout S]
        from .batch import main as grade_folder

        return grade_folder(argv[1:])
    args = _parser().parse_args(argv)
    from .harness import Report, run_checks
    from .report import atomic_write, table, write_json
    from .submission import SubmissionError, load_submission

    if args.command == "grade":
        try:
            sub = load_submission(args.notebook, args.assignment)
        except SubmissionError as exc:
            print(f"Cannot grade {args.notebook}: {exc}\nScore: 0")
            if args.json:
                atomic_write(args.json, json.dumps(
                    {"score": 0, "output": f"Cannot grade this submission: {exc}", "tests": []}))
            if args.report:
                atomic_write(args.report, json.dumps(
                    {"assignment": args.assignment, "score": 0, "max_score": 0,
                     "error": str(exc), "results": []}))
            return 2
        report = run_checks(sub.assignment, sub.cells, only=args.only, problems=sub.problems)
    else:
        objects = Path(args.pickle).read_bytes()
        from .submission import cell_source, is_setup_cell, read_notebook
        from .assignments import ASSIGNMENTS

        trusted = read_notebook(ASSIGNMENTS[args.assignment].release)
        setup = [("setup", cell_source(c)) for c in trusted.cells if is_setup_cell(c)]
        report = run_checks(args.assignment, setup, objects=objects, only=args.only)
    print(table(report))
    if getattr(args, "json", None):
        write_json(report, args.json)
    if args.report:
        atomic_write(args.report, json.dumps(report.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
