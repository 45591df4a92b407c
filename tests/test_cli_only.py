"""``python -m autograder grade --only``: names functions or checks (an instructor re-grades one
check; a test times out one deadlocked run instead of three), and a name that is neither is
refused with the assignment's functions, where it used to grade nothing and print 0 / 0.

Tier: quick (one grading of a released stub, a few seconds).
"""
from __future__ import annotations

from conftest import REPO, grade

from autograder.checking.spec import load_spec

RELEASE = REPO / "assignments" / "a10_pipeline_schedules" / "pipeline_schedules.ipynb"


def test_only_takes_check_names_and_function_names(offline_env):
    report = grade(RELEASE, "--only", "run_schedule_timelines,zero_bubble_h1", "--speed",
                   "skip", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    h1 = {c.name for c in load_spec("a10_pipeline_schedules").checks
          if c.function == "zero_bubble_h1"}
    assert {r["name"] for r in report["results"]} == h1 | {"run_schedule_timelines"}, \
        report["stdout"]


def test_an_unknown_name_is_refused_with_the_functions(offline_env):
    report = grade(RELEASE, "--only", "run_schedule,no_such_check", env=offline_env)
    assert report["returncode"] == 2 and report["results"] == [], report
    assert ("--only names no function or check of a10_pipeline_schedules: no_such_check (its "
            "functions: interleaved_1f1b, zero_bubble_h1") in report["stdout"], report["stdout"]
