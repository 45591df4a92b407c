"""Assignment 3 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks (and of that function's speedup, which
counts only for correct code).

Tier: both: reference full marks and stub zero are quick (one grading each); planted bugs are
full.
"""
from __future__ import annotations

import re
import time

import nbformat
import pytest

from conftest import (REPO, assert_full_marks, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, plant_bugs)

SOURCE = REPO / "solutions" / "a3_model_pipeline" / "model_pipeline.ipynb"
RELEASE = REPO / "assignments" / "a3_model_pipeline" / "model_pipeline.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # the stages come out in reverse order
    "split_into_stages": ("for (a, b), d in zip(bounds, devices)]",
                          "for (a, b), d in zip(bounds[::-1], devices)]"),
    # the micro-batches are concatenated in the wrong order
    "pipelined_forward": ("    return torch.cat(micro)\n", "    return torch.cat(micro[::-1])\n"),
    # a backward may run on the last stage before its forward
    "one_f_one_b_schedule": ('if i < m and ran("F", i, s) and (s == p - 1',
                             "if i < m and (s == p - 1"),
    # off by one in the bubble's denominator
    "bubble_fraction": ("(num_microbatches + num_stages - 1)", "(num_microbatches + num_stages)"),
    # a mean per micro-batch instead of the mean over the whole batch
    "pipeline_train_step": ("loss(out, y_mbs[i].to(device)).sum() / X.shape[0]",
                            "loss(out, y_mbs[i].to(device)).mean()"),
}


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env, timeout=540)
    seconds = time.monotonic() - start
    assert_full_marks(report)
    for r in report["results"]:  # a measured speedup is shown with the reference's, in the same run
        if r["function"].endswith("_speedup") and r["status"] == "passed":
            assert re.search(r": \d+\.\d\dx \(reference \d+\.\d\dx; median of \d+ interleaved "
                             r"rounds\)$", r["message"]), r
    assert seconds < 90, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    assert_stubs_score_zero(grade(RELEASE, env=offline_env, timeout=540))


# Every check grades one function with the reference versions of the others, so a grading run
# with several bugs planted is, for each function, the run with its bug alone. Two runs with
# disjoint sets: a check that leaked another function's bug would cost points in the run where
# its own function is correct (model_parallel_forward and gpipe_schedule are correct in both).
BUG_GROUPS = [("split_into_stages", "one_f_one_b_schedule", "pipeline_train_step"),
              ("pipelined_forward", "bubble_fraction")]


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("functions", BUG_GROUPS, ids=["+".join(g) for g in BUG_GROUPS])
def test_planted_bugs_lose_exactly_their_functions_points(functions, offline_env, tmp_path):
    assert sorted(BUGS) == sorted(f for g in BUG_GROUPS for f in g)
    path = tmp_path / "submission.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4),
                              {f: BUGS[f] for f in functions}), path)
    assert_only_these_lose_points(grade(path, env=offline_env, timeout=540), functions)
