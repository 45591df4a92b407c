"""Correct code never loses a point: every reference solution, graded under many seeds while a
busy process runs on every core, gets full marks on every check each time. ``--seeds N`` sets
how many (3 in the default suite, 2 minutes each on 2 cores; ``--seeds 50`` for a long run).

Speed checks are not run here (``--speed skip``): under a busy process per core they can only
SKIP (the reference cannot show a speedup either). They are graded in full, on a quiet machine,
by each assignment's full-marks test; their fairness under noise comes from paired rounds and a
sign test (autograder/checking/speed.py), tested there."""
from __future__ import annotations

import secrets

import pytest

from conftest import REPO, grade

from autograder.results import SPEED_NOT_MEASURED
from autograder.checking.spec import load_spec
from autograder.registry import ASSIGNMENTS


@pytest.mark.slow
@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_reference_gets_full_marks_under_load_for_every_seed(assignment, busy_cores, request,
                                                             offline_env):
    source = REPO / "solutions" / assignment / ASSIGNMENTS[assignment].notebook
    first = secrets.randbits(30)
    seeds = [first + i for i in range(request.config.getoption("--seeds"))]
    checks = load_spec(assignment).checks
    for seed in seeds:
        report = grade(source, "--seed", str(seed), "--speed", "skip", env=offline_env,
                       timeout=900)
        where = f"{assignment} with --seed {seed} (busy cores: {busy_cores})"
        assert report.get("seed") == seed, where + report.get("stdout", "")[-2000:]
        got = {r["name"]: r for r in report["results"]}
        assert set(got) == {c.name for c in checks}, (where, sorted(got))
        lost = {c.name: got[c.name]["status"] for c in checks
                if got[c.name]["status"] != ("skipped" if c.speed else "passed")}
        assert not lost, f"{where}: {lost}\n{report.get('stdout', '')[-3000:]}"
        assert all(got[c.name]["message"] == SPEED_NOT_MEASURED for c in checks if c.speed)
        print(f"{where}: {sum(not c.speed for c in checks)} checks passed")
