"""What a grading sends into its student sandboxes, and what of ``solutions/`` is in it: the
recording driver and the leak search that tests/test_no_reference_in_sandbox.py (A3-A10) and
tests/test_a1_a2_hardening.py (A1, A2) share.

:func:`record_gradings` grades each job in one fresh process whose harness sandboxes (those that
run the submission) record the cells they load, the pickled objects and every probe's
arguments; a speed check's reference sandbox is not the harness's and is not recorded.
:func:`leaks` then looks for lines of the reference's answers (and answer keys) and for the
markers of code compiled from the reference or loaded from a key.
"""
from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys

from conftest import REPO

#: Grades each job {name: [notebook, only, speed, assignment]} in this one process, the
#: harness's sandboxes recording what they are sent; writes {"records": [(job, what, pickled
#: bytes)], "reports": {job: report}} to argv[1].
DRIVER = r"""
import json, pickle, sys, tempfile
from pathlib import Path

import autograder.checking.harness as harness
from autograder.cli import main
from autograder.sandbox import Sandbox

records, reports, current = [], {}, {}


class Recording(Sandbox):
    def begin_start(self):
        records.append((current["job"], "cells", pickle.dumps(self.cells)))
        records.append((current["job"], "objects", pickle.dumps(self.objects)))
        super().begin_start()

    def call(self, probe, *args, timeout=30.0):
        records.append((current["job"], f"{probe.__module__}.{probe.__qualname__}",
                        pickle.dumps(args)))
        return super().call(probe, *args, timeout=timeout)


harness.Sandbox = Recording
for job, (notebook, only, speed, _) in json.loads(sys.argv[2]).items():
    current["job"] = job
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        code = main(["grade", notebook, "--only", only, "--speed", speed, "--report", str(out)])
        reports[job] = {"code": code, **json.loads(out.read_text())}
Path(sys.argv[1]).write_bytes(pickle.dumps({"records": records, "reports": reports}))
"""

#: What code compiled from the reference (reference_namespace's file names) or loaded from an
#: answer key (autograder.keys' module names) carries when pickled.
MARKERS = ("<reference ", "autograder_answer_keys", "answer_key.py")
#: A run of text in a pickle: long enough to hold a line worth finding (a tensor's bytes make
#: short runs at most).
TEXT = re.compile(r"[^\x00-\x08\x0b-\x1f\ufffd]{31,}")


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) > 30}


def solution_lines(assignments, keys: bool = True) -> set[str]:
    """Lines of the reference answer cells of ``assignments`` that their released notebooks
    lack, and (with ``keys``) of every answer key."""
    from autograder.notebook import is_answer_cell, read_notebook
    from autograder.registry import get

    lines: set[str] = set()
    for a in map(get, assignments):
        if not a.source.exists():
            continue
        released = set().union(*(_lines("".join(c.get("source", "")))
                                 for c in read_notebook(a.release).cells))
        lines |= set().union(*(_lines("".join(c.get("source", "")))
                               for c in read_notebook(a.source).cells
                               if is_answer_cell(c))) - released
    if keys:
        for key in (REPO / "solutions").glob("*/answer_key.py"):
            lines |= _lines(key.read_text())
    return lines


def record_gradings(jobs: dict, env, tmp_path, timeout: float = 900) -> dict:
    """Run :data:`DRIVER` on ``jobs``; what it recorded and reported, with the jobs."""
    out = tmp_path / "records.pickle"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(out), json.dumps(jobs)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = pickle.loads(out.read_bytes())
    assert {job for job, *_ in got["records"]} == set(jobs)
    return {**got, "jobs": jobs}


def leaks(got: dict, lines: set[str], markers=MARKERS, report_markers=()) -> list:
    """What of ``lines`` and ``markers`` reached the student's sandboxes (and, for
    ``report_markers`` and every line, the reports); asserts that each sandbox's cells are
    exactly the submission's own."""
    from autograder.submission import load_submission

    found = []
    for job, what, data in got["records"]:
        if what == "cells":  # the submission's own cells, nothing added
            notebook, _, _, assignment = got["jobs"][job]
            assert pickle.loads(data) == load_submission(notebook, assignment).cells, \
                f"{job}: the sandbox's cells changed"
            continue
        found += [(job, what, m) for m in markers if m.encode() in data]
        text = "\n".join(TEXT.findall(data.decode("utf-8", errors="replace")))
        found += [(job, what, line) for line in lines if line in text]
    for job, report in got["reports"].items():
        text = json.dumps(report)
        found += [(job, "report", line) for line in lines if line in text]
        found += [(job, "report", m) for m in report_markers if m in text]
    return found
