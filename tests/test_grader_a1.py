"""Assignment 1 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks, and of train_batch where train_batch calls
the broken function: it runs with the student's own split_batch and allreduce (no reference
code enters the sandbox that runs student code, issue 39).

Tier: both: reference full marks and stub zero are quick (one grading each); planted bugs and
seed repeats are full.
"""
from __future__ import annotations

import time

import nbformat
import pytest

from conftest import (REPO, assert_full_marks, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, plant_bugs, points_by_function)

SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    "copy_params": ("p.detach().to(device, copy=True).requires_grad_()",
                    "p.detach().to(device, copy=True)"),
    "allreduce": ("    for i in range(1, len(data)):\n        data[i].copy_(data[0])\n", ""),
    "split_batch": ("    return shards_of_sizes(X, y, devices, sizes)\n\n\ndef shards_of_sizes",
                    "    return [X[i::n].to(d) for i, d in enumerate(devices)], "
                    "[y[i::n].to(d) for i, d in enumerate(devices)]\n\n\ndef shards_of_sizes"),
    "split_batch_weighted": ("    for i in by_remainder[: b - sum(sizes)]:\n        sizes[i] += 1\n", ""),
    "train_batch": ("loss(lenet(Xs, params), ys).sum()", "loss(lenet(Xs, params), ys).mean()"),
}


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    seconds = time.monotonic() - start
    assert_full_marks(report)
    assert seconds < 60, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    assert_stubs_score_zero(grade(RELEASE, env=offline_env))


#: function -> the functions that call it and break with it. train_batch calls the student's
#: own allreduce: without the copy back, replicas 1, 2, ... keep their own gradients and drift
#: apart (on one device nothing is copied: that check still passes). The planted split_batch
#: bug deals the examples out in turn instead of in contiguous runs: train_batch still sums
#: every example's loss once, so its step stays right.
ALSO_BREAKS = {"allreduce": ["train_batch"]}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("function", list(BUGS))
def test_planted_bug_loses_exactly_that_functions_points(function, offline_env, tmp_path):
    path = tmp_path / "submission.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4), {function: BUGS[function]}),
                   path)
    report = grade(path, env=offline_env)
    callers = ALSO_BREAKS.get(function, [])
    assert_only_these_lose_points(report, [function, *callers], all_of_them=not callers)
    assert points_by_function(report)[function] == 0, report["results"]
    for caller in callers:  # the caller's failures say which of its helpers is wrong
        failed = [r for r in report["results"]
                  if r["function"] == caller and r["status"] == "failed"]
        assert failed and all(f"your {function}" in r["message"] for r in failed), failed


@pytest.mark.full
@pytest.mark.slow
def test_seed_repeats_a_grade(offline_env, tmp_path):
    """A report names its seed; --seed with it repeats the same inputs (the failure messages
    quote them), so a regrade reproduces a grade."""
    path = tmp_path / "submission.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4),
                              {"allreduce": BUGS["allreduce"]}), path)
    first = grade(path, "--only", "allreduce", env=offline_env)
    again = grade(path, "--only", "allreduce", "--seed", str(first["seed"]), env=offline_env)
    other = grade(path, "--only", "allreduce", "--seed", str(first["seed"] + 1), env=offline_env)
    assert f"Seed: {first['seed']}" in first["stdout"]
    messages = [[r["message"] for r in rep["results"]] for rep in (first, again, other)]
    assert all("seed" in m for m in messages[0]), messages[0]
    assert messages[0] == messages[1]
    assert messages[0] != messages[2]
