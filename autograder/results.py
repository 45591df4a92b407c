"""What a grading run produces, and the shapes it is written in, each defined once.

- :class:`CheckResult` and :class:`Report`: one run's outcome (the JSON report is
  ``Report.to_dict()``);
- :data:`TAG` and :func:`result_lines`: how a check's status reads for people (the CLI table,
  ``check()`` in a notebook, nbgrader's test cells);
- :func:`gradescope` and :func:`failure_results`: Gradescope's ``results.json``;
- :func:`atomic_write`: every file the grader writes.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
TAG = {PASSED: "PASS", FAILED: "FAIL", SKIPPED: "SKIP"}
#: Why a speed check SKIPs under ``--speed skip``: nothing was timed, and (unlike a SKIP for
#: hardware that cannot show a speedup) the timed code was not run either.
SPEED_NOT_MEASURED = ("speed not measured: this grading run was asked not to time anything "
                      "(--speed skip or AUTOGRADER_SPEED=skip); no points were measured here")
#: The one rule for a SKIP, in every front end (the CLI, nbgrader's test cells, results.json):
#: whatever its reason, a check that was not judged earns nothing.
SKIP_EARNS_NOTHING = "A skipped check earns no points: it was not judged on this machine."


@dataclass
class CheckResult:
    name: str
    function: str
    max_points: float
    points: float
    status: str        # passed | failed | skipped
    seconds: float
    message: str = ""
    call_seconds: float = 0.0   # the longest single call into the student's code


@dataclass
class Report:
    assignment: str
    hardware: str
    isolation: str
    seed: int = 0
    results: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_score(self) -> float:
        """Points that could be earned here (skipped checks are not counted)."""
        return sum(r.max_points for r in self.results if r.status != SKIPPED)

    def to_dict(self) -> dict:
        return {"assignment": self.assignment, "hardware": self.hardware,
                "isolation": self.isolation, "seed": self.seed, "score": self.score,
                "max_score": self.max_score, "notes": self.notes,
                "results": [asdict(r) for r in self.results]}


def result_lines(result: dict, points: float | None = None) -> list[str]:
    """``PASS  name  (1/1)`` and its indented message: one check, as every front end shows it."""
    got = result["points"] if points is None else points
    lines = [f"{TAG[result['status']]}  {result['name']}  ({got:g}/{result['max_points']:g})"]
    if result.get("message"):
        lines.append(f"      {result['message']}")
    return lines


def failure_results(message: str) -> dict:
    """Gradescope's results.json for a submission that could not be graded."""
    return {"score": 0, "output": message, "tests": []}


def gradescope(report: Report) -> dict:
    """Gradescope's results.json: one test per check; a skipped check scores 0 of 0 (its points
    are left out of what could be earned here, as in the report) with the reason."""
    tests = []
    for r in report.results:
        out = r.message if r.status != PASSED else ""
        if r.status == SKIPPED:
            out = f"Not graded on this machine: {r.message}\n{SKIP_EARNS_NOTHING}"
        tests.append({"name": f"{r.function}: {r.name}", "score": r.points,
                      "max_score": 0 if r.status == SKIPPED else r.max_points,
                      "status": PASSED if r.status == PASSED else FAILED, "output": out})
    return {"score": report.score, "output": "\n".join(
        [f"Hardware: {report.hardware}", f"Seed: {report.seed}", *report.notes]),
        "tests": tests, "visibility": "visible", "stdout_visibility": "hidden"}


def atomic_write(path: str | Path, text: str) -> None:
    """Write via a temporary file and a rename: a symlink planted at ``path`` is replaced,
    never followed, and a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, data) -> None:
    atomic_write(path, json.dumps(data, indent=2))
