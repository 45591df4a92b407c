"""Build a sample class to measure folder grading: 10 submissions per assignment (4 reference
solutions, 2 released stubs, 4 with one planted bug each: the bugs of tests/test_grader_a*.py),
plus tiny offline Fashion-MNIST files. Used for the measurements in docs/instructor.md.

    python scripts/sample_class.py OUT      # OUT/submissions/<student>.ipynb, OUT/kinds.csv, OUT/data
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import paste_reference_answers, plant_bugs, write_tiny_fashion_mnist  # noqa: E402
from autograder.registry import ASSIGNMENTS  # noqa: E402


def bugs_of(name: str) -> dict:
    short = name.split("_")[0]
    module = __import__(f"test_grader_{short}")
    # A4 plants its bugs in the functions that run in the sandbox and in its classes apart
    return getattr(module, "BUGS", None) or module.LEAF_BUGS


def build(out: Path) -> list[tuple[str, str, str]]:
    subs = out / "submissions"
    subs.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, a in ASSIGNMENTS.items():
        short = name.split("_")[0]
        source = nbformat.read(a.source, as_version=4)
        bugs = list(bugs_of(name).items())[:4]
        kinds = ["solution"] * 4 + ["stub"] * 2 + [f"bug:{f}" for f, _ in bugs]
        for i, kind in enumerate(kinds, 1):
            student = f"{short}-{i:02d}"
            if kind == "solution" and i % 2:
                nb = nbformat.read(a.source, as_version=4)
            elif kind == "solution":
                nb = nbformat.read(a.release, as_version=4)
                paste_reference_answers(nb, a.source)
            elif kind == "stub":
                nb = nbformat.read(a.release, as_version=4)
            else:
                function = kind.removeprefix("bug:")
                nb = plant_bugs(nbformat.reads(nbformat.writes(source), as_version=4),
                                {function: dict(bugs)[function]})
            nbformat.write(nb, subs / f"{student}.ipynb")
            rows.append((student, name, kind))
    with open(out / "kinds.csv", "w", newline="") as f:
        csv.writer(f).writerows([("student", "assignment", "kind"), *rows])
    write_tiny_fashion_mnist(out / "data")
    return rows


if __name__ == "__main__":
    print(f"{len(build(Path(sys.argv[1])))} submissions in {sys.argv[1]}/submissions")
