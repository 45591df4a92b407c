"""What a grading run produces, and the shapes it is written in, each defined once.

- :class:`CheckResult` and :class:`Report`: one run's outcome (the JSON report is
  ``Report.to_dict()``);
- :data:`TAG`, :func:`result_lines`, :func:`checks_lines` and :func:`student_message`: how a check's status and
  message read for people (the CLI table, ``check()`` in a notebook, nbgrader's test cells);
- :func:`gradescope` and :func:`failure_results`: Gradescope's ``results.json``;
- :func:`atomic_write`: every file the grader writes.
"""
from __future__ import annotations

import json
import os
import re
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
    message = student_message(result.get("message") or "", result["function"])
    lines += [f"      {line}" for line in message.split("\n") if message]
    return lines


#: A stub's failure, as the sandbox reports it: ``NotImplementedError`` with no text of its own,
#: raised in the grader's process or in a rank of a multi-process run.
_STUB = re.compile(r"(?:RuntimeError: with \d+ processes, rank \d+ failed: )?NotImplementedError:?\s*")
#: A frame of the student's code: ``  in cell C, line N[, in F: source]``.
_FRAME = re.compile(r"  in cell (?P<cell>.+?), line (?P<line>\d+)(?:, in (?P<function>[\w<>]+))?"
                    r"(?:: (?P<source>.*))?")


def checks_lines(results: list[dict], points=None, stubs: tuple[str, ...] = (),
                 said: set | None = None) -> list[str]:
    """:func:`result_lines` of each result in order, each message read by
    :func:`student_message`, and a FAIL whose reason an earlier line already gave reading "(the
    same as above)": a stub's six checks say "not written yet" once. ``points(result)`` gives
    the points shown (nbgrader's rule), else the result's own; ``said``: the reasons given by
    earlier calls (results shown one at a time), updated."""
    said, lines = (set() if said is None else said), []
    for r in results:
        r = dict(r, message=student_message(r.get("message") or "", r["function"], stubs))
        these = result_lines(r, None if points is None else points(r))
        if r["status"] == FAILED and r["message"] and r["message"] in said:
            these[1:] = ["      (the same as above)"]
        said.add(r["message"])
        lines += these
    return lines


def student_message(message: str, function: str, stubs: tuple[str, ...] = ()) -> str:
    """``message`` as a student should read it. A stub (a function that still raises the
    released ``NotImplementedError()``) reads "allreduce is not written yet (it raises
    NotImplementedError in cell allreduce, line 4)", not a bare ``NotImplementedError:``.

    Which function raised comes from the message's last frame; where it shows none (``check()``
    in a notebook: the kernel's code is not in a cell the grader ran), from ``stubs``, the
    functions the caller found unwritten. Reports keep the message as the grader made it; every
    front end shows it through here."""
    lines = message.split("\n")
    if not _STUB.fullmatch(lines[0]):
        return message
    frames = [m for m in map(_FRAME.fullmatch, lines[1:]) if m]
    rest = [line for line in lines[1:] if not _FRAME.fullmatch(line)
            and not re.fullmatch(r"\(rank\(s\) [\d, ]+ failed as well\)", line)]
    runs = function.removesuffix("_speedup")
    where = ""
    if frames:
        last = frames[-1]
        if last["source"] is not None and not last["source"].startswith("raise NotImplementedError"):
            return message  # raised by what that line calls (torch, say), not by a stub
        names = (last["function"] if last["function"] not in (None, "<module>") else last["cell"],)
        where = f" in cell {last['cell']}, line {last['line']}"
    else:
        names = (runs,) if runs in stubs else tuple(sorted(stubs))
    if not names:
        head = (f"{runs} raised NotImplementedError with no message: is a part of it, or of "
                "a function it calls, not written yet?")
    elif len(names) == 1:
        head = f"{names[0]} is not written yet (it raises NotImplementedError{where})"
    else:
        head = f"{' and '.join(names)} are not written yet (they raise NotImplementedError)"
    if names and runs not in names:
        head += f"; {runs} calls {'it' if len(names) == 1 else 'them'}"
    return "\n".join([head, *rest])


def failure_results(message: str) -> dict:
    """Gradescope's results.json for a submission that could not be graded."""
    return {"score": 0, "output": message, "tests": []}


def gradescope(report: Report) -> dict:
    """Gradescope's results.json: one test per check; a skipped check scores 0 of 0 (its points
    are left out of what could be earned here, as in the report) with the reason."""
    tests = []
    for r in report.results:
        out = student_message(r.message, r.function) if r.status != PASSED else ""
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
