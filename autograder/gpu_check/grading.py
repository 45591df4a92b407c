"""Grade every assignment's reference solution and released stub through the grader's CLI
(``python -m autograder grade NOTEBOOK --report out.json``), with whatever speed checks the
GPU count enables (the grader decides that from the GPUs it sees).

What should hold on any machine: the solution earns every point that can be graded here (no
failed check) and the stub scores zero because its functions raise NotImplementedError (not
because grading broke), both with exit code 0. Skipped checks are listed with
the grader's reason; those that need two or more GPUs are named as such.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from ..registry import ASSIGNMENTS as REGISTERED, REPO

#: every assignment the grader knows (it listed A1-A3 by hand, and missed A4 and A5)
ASSIGNMENTS = {a.name: a.notebook for a in REGISTERED.values()}
SPEED = re.compile(r"speedup|bandwidth|scaling|step_time")  # the names of the grader's speed checks
NEEDS_TWO = re.compile(r"2 or more (CUDA )?GPUs|needs 2 GPUs|two GPUs", re.I)


def grade(notebook: Path, out: Path, env: dict, timeout: float = 1200) -> dict:
    """The CLI's JSON report, plus ``returncode``, ``seconds`` and the end of its output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "autograder", "grade", str(notebook),
                               "--report", str(out)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"still grading after {timeout:.0f} s: stopped"
    report = json.loads(out.read_text()) if out.exists() else {"results": [], "score": 0,
                                                               "max_score": 0}
    report.update(returncode=rc, seconds=time.monotonic() - start, tail=tail)
    return report


def judge(report: dict, kind: str) -> tuple[bool, str]:
    """(as expected?, why) for a ``solution`` or a ``stub`` report."""
    if report["returncode"] != 0:
        return False, f"the grader exited {report['returncode']}: {report['tail'][-600:]}"
    failed = [r for r in report["results"] if r["status"] == "failed"]
    if kind == "solution":
        if failed or report["score"] != report["max_score"] or not report["max_score"]:
            return False, "the reference solution lost points: " + "; ".join(
                f"{r['name']}: {r['message'][:200]}" for r in failed)
        return True, f"{report['score']:g}/{report['max_score']:g}"
    if report["score"] != 0:
        passed = [r["name"] for r in report["results"] if r["status"] == "passed"]
        return False, f"the stub scored {report['score']:g}: {', '.join(passed)} passed"
    other = [r for r in failed if "NotImplementedError" not in r["message"]]
    if other or not failed:  # zero for another reason than the stub's NotImplementedError
        return False, "the stub's checks failed for another reason than NotImplementedError: " + \
            "; ".join(f"{r['name']}: {r['message'][:200]}" for r in other[:3])
    return True, f"0/{report['max_score']:g}, as a stub should"


def speed_checks(report: dict) -> dict:
    """The speed checks of a report: which passed (with their printed figure), which were
    skipped for want of a second GPU, and which for another reason."""
    speed = [r for r in report["results"] if SPEED.search(r["name"])]
    return {"passed": [f"{r['name']}: {r['message']}" for r in speed if r["status"] == "passed"],
            "need_two_gpus": [r["name"] for r in speed if r["status"] == "skipped"
                              and NEEDS_TWO.search(r["message"])],
            "skipped_otherwise": [f"{r['name']}: {r['message']}" for r in speed
                                  if r["status"] == "skipped" and not NEEDS_TWO.search(r["message"])]}


def run(section, out: Path, env: dict) -> None:
    """Grade the solution and the stub of every assignment into ``section``."""
    for name, notebook in ASSIGNMENTS.items():
        for kind, folder in (("solution", "solutions"), ("stub", "assignments")):
            path = REPO / folder / name / notebook
            report = grade(path, out / "grades" / f"{name}-{kind}.json", env)
            ok, why = judge(report, kind)
            speed = speed_checks(report)
            skipped = [f"{r['name']}: {r['message'][:160]}" for r in report["results"]
                       if r["status"] == "skipped"]
            section.add(f"{name} {kind}", "passed" if ok else "failed", why,
                        score=report["score"], max_score=report["max_score"],
                        seconds=round(report["seconds"], 1), hardware=report.get("hardware", "?"))
            if kind == "solution":
                for line in speed["passed"]:
                    section.add(f"{name} speed check", "info", line)
                if speed["need_two_gpus"]:
                    section.add(f"{name} speed checks that need 2 GPUs", "skipped",
                                ", ".join(speed["need_two_gpus"]))
                for line in speed["skipped_otherwise"]:
                    section.add(f"{name} speed check", "skipped", line[:300])
                others = [s for s in skipped if s.split(":")[0] not in
                          {*speed["need_two_gpus"], *(x.split(":")[0] for x in speed["skipped_otherwise"])}]
                if others:
                    section.add(f"{name} other skipped checks", "skipped", "; ".join(others))
