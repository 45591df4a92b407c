"""Assignment 3 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks (and of that function's speedup, which
counts only for correct code)."""
from __future__ import annotations

import time

import nbformat
import pytest

from conftest import REPO, grade, points_by_function

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


def expected_full() -> dict[str, float]:
    from autograder.harness import functions_of

    return functions_of("a3_model_pipeline")


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env, timeout=540)
    seconds = time.monotonic() - start
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == report["max_score"] > 0
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert not failed, failed
    skipped = [r for r in report["results"] if r["status"] == "skipped"]
    assert all(r["message"] for r in skipped), "a skipped check must say why"
    assert set(points_by_function(report)) == set(expected_full())
    assert "Total:" in report["stdout"] and "Hardware:" in report["stdout"]
    assert seconds < 90, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, env=offline_env, timeout=540)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == 0
    assert report["max_score"] > 0
    for r in report["results"]:
        if r["status"] == "failed":
            assert "NotImplementedError" in r["message"], r
    assert "Traceback" not in report["stdout"]


@pytest.mark.slow
@pytest.mark.parametrize("function", list(BUGS))
def test_planted_bug_loses_exactly_that_functions_points(function, offline_env, tmp_path):
    nb = nbformat.read(SOURCE, as_version=4)
    old, new = BUGS[function]
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == function)
    assert old in cell.source, f"the planted bug for {function} no longer applies"
    cell.source = cell.source.replace(old, new)
    path = tmp_path / "submission.ipynb"
    nbformat.write(nb, path)
    report = grade(path, env=offline_env, timeout=540)
    got = points_by_function(report)
    full = expected_full()
    for name, points in full.items():
        skipped = all(r["status"] == "skipped" for r in report["results"] if r["function"] == name)
        if name in (function, f"{function}_speedup"):  # a speedup counts only for correct code
            assert got[name] == 0, (name, report["results"])
        elif not skipped:
            assert got[name] == points, (name, [r for r in report["results"]
                                                if r["function"] == name])
