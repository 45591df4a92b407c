"""No text of ``solutions/`` (the reference notebooks, the answer keys) reaches a sandbox that
runs student code (issue 39: a submission once sent the reference's cells, which the grader had
put into its sandbox, back out in an error message).

For A3-A9, each assignment's reference notebook is graded with ``--only`` functions that call
other graded functions (where the grader once sent the reference's versions of those along),
in one process whose student sandboxes record everything sent to them: the cells they load,
the pickled objects, and every probe's arguments. The cells must be the submission's own
(trusted set-up cells and its answer cells, nothing added); the objects and the probes'
arguments must hold no line of a reference answer cell that the released notebook does not
also have, no line of an answer key, and nothing compiled from the reference
(``<reference ...>`` code) or loaded from a key (``autograder_answer_keys``). A speed check's
reference sandbox (which never runs student code) is not recorded: it is not the harness's.

Tier: full (seven gradings of one or two functions each in one process: 15-30 s on 2 cores,
over the quick tier's 20 s budget per test when the machine is busy).
"""
from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys

import pytest

from conftest import REPO

#: (assignment, the functions graded: each calls other graded functions)
GRADED = [
    ("a3_model_pipeline", "bubble_fraction,split_into_stages"),
    ("a4_sharding", "ShardedLinear,BucketedDDP"),
    ("a5_tensor_parallel", "ParallelMLP"),
    ("a6_context_parallel", "ring_attention"),
    ("a7_expert_parallel", "MoELayer"),
    ("a8_composition", "best_config"),
    ("a9_resilience", "async_save"),
]

#: Grades each job in this one process, with the harness's sandboxes recording what they are
#: sent; writes [(assignment, what, pickled bytes)] and the reports to argv[1].
DRIVER = r"""
import json, pickle, sys, tempfile
from pathlib import Path

import autograder.checking.harness as harness
from autograder.cli import main
from autograder.registry import get
from autograder.sandbox import Sandbox

records, reports, current = [], {}, {}


class Recording(Sandbox):
    def begin_start(self):
        records.append((current["a"], "cells", pickle.dumps(self.cells)))
        records.append((current["a"], "objects", pickle.dumps(self.objects)))
        super().begin_start()

    def call(self, probe, *args, timeout=30.0):
        records.append((current["a"], f"{probe.__module__}.{probe.__qualname__}",
                        pickle.dumps(args)))
        return super().call(probe, *args, timeout=timeout)


harness.Sandbox = Recording
for job in json.loads(sys.argv[2]):
    current["a"], only = job
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        code = main(["grade", str(get(job[0]).source), "--only", only, "--speed", "skip",
                     "--report", str(out)])
        reports[job[0]] = {"code": code, **json.loads(out.read_text())}
Path(sys.argv[1]).write_bytes(pickle.dumps({"records": records, "reports": reports}))
"""


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) > 30}


def solution_lines() -> set[str]:
    """Lines of the reference answer cells that their released notebooks lack, and of every
    answer key."""
    from autograder.notebook import is_answer_cell, read_notebook
    from autograder.registry import ASSIGNMENTS

    lines: set[str] = set()
    for a in ASSIGNMENTS.values():
        if not a.source.exists():
            continue
        released = set()
        for cell in read_notebook(a.release).cells:
            released |= _lines("".join(cell.get("source", "")))
        for cell in read_notebook(a.source).cells:
            if is_answer_cell(cell):
                lines |= _lines("".join(cell.get("source", ""))) - released
    for key in (REPO / "solutions").glob("*/answer_key.py"):
        lines |= _lines(key.read_text())
    return lines


#: What code compiled from the reference (reference_namespace's file names) or loaded from an
#: answer key (autograder.keys' module names) carries when pickled.
MARKERS = (b"<reference ", b"autograder_answer_keys", b"answer_key.py")


#: A run of text in a pickle: long enough to hold one of those lines.
TEXT = re.compile(r"[^\x00-\x08\x0b-\x1f\ufffd]{31,}")


@pytest.mark.full
@pytest.mark.slow
def test_no_solution_text_reaches_a_student_sandbox(offline_env, tmp_path):
    from autograder.registry import get
    from autograder.submission import load_submission

    lines = solution_lines()
    assert len(lines) > 500, len(lines)  # the reference answers and keys were read
    out = tmp_path / "records.pickle"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(out), json.dumps(GRADED)],
                          cwd=REPO, env=offline_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = pickle.loads(out.read_bytes())
    for assignment, only in GRADED:  # each grading ran its checks and passed them
        report = got["reports"][assignment]
        assert report["code"] == 0 and report["results"], (assignment, report)
        assert {r["function"].removesuffix("_speedup") for r in report["results"]} == \
            set(only.split(",")), (assignment, report["results"])
        assert all(r["status"] != "failed" for r in report["results"]), report["results"]
    leaks = []
    seen = set()
    for assignment, what, data in got["records"]:
        seen.add(assignment)
        if what == "cells":  # the submission's own cells, nothing else
            cells = load_submission(get(assignment).source, assignment).cells
            assert pickle.loads(data) == cells, f"{assignment}: the sandbox's cells changed"
            continue
        leaks += [(assignment, what, m.decode()) for m in MARKERS if m in data]
        # the pickle's strings, as runs of text (a tensor's bytes make short runs at most)
        text = "\n".join(TEXT.findall(data.decode("utf-8", errors="replace")))
        leaks += [(assignment, what, line) for line in lines if line in text]
    assert seen == {a for a, _ in GRADED}
    assert not leaks, f"{len(leaks)} line(s) of solutions/ sent to a student sandbox: {leaks[:5]}"
