"""Correct code never loses a point: every reference solution, graded under many seeds while a
busy process runs on every core, gets full marks on every check each time. ``--seeds N`` sets
how many (2 in the default suite, to keep it within its time; ``--seeds 50`` for a long run).

Speed checks are left out here: under a busy process per core they can only SKIP (the
reference cannot show a speedup either), and they are graded in full, on a quiet machine, by
each assignment's full-marks test; their fairness under noise comes from paired rounds and a
sign test (autograder/checking/speed.py), tested there."""
from __future__ import annotations

import secrets

import pytest

from conftest import REPO, grade

from autograder.checking.spec import load_spec
from autograder.registry import ASSIGNMENTS


def correctness_functions(assignment: str) -> list[str]:
    """The functions that have a check other than a speed check."""
    return list(dict.fromkeys(c.function for c in load_spec(assignment).checks if not c.speed))


@pytest.mark.slow
@pytest.mark.parametrize("assignment", list(ASSIGNMENTS))
def test_reference_gets_full_marks_under_load_for_every_seed(assignment, busy_cores, request,
                                                             offline_env):
    source = REPO / "solutions" / assignment / ASSIGNMENTS[assignment].notebook
    first = secrets.randbits(30)
    seeds = [first + i for i in range(request.config.getoption("--seeds"))]
    only = correctness_functions(assignment)
    wanted = [c.name for c in load_spec(assignment).checks if c.function in only and not c.speed]
    for seed in seeds:
        report = grade(source, "--seed", str(seed), "--only", ",".join(only), env=offline_env,
                       timeout=900)
        where = f"{assignment} with --seed {seed} (busy cores: {busy_cores})"
        assert report.get("seed") == seed, where + report.get("stdout", "")[-2000:]
        statuses = {r["name"]: r["status"] for r in report["results"]}
        assert set(wanted) <= set(statuses), (where, statuses)
        lost = {n: s for n, s in statuses.items() if n in wanted and s != "passed"}
        assert not lost, f"{where}: {lost}\n{report.get('stdout', '')[-3000:]}"
        print(f"{where}: {len(wanted)} checks passed")
