"""Assignment 1 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks."""
from __future__ import annotations

import time

import nbformat
import pytest

from conftest import REPO, grade, points_by_function

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


def expected_full() -> dict[str, float]:
    from autograder.harness import functions_of

    return functions_of("a1_data_parallel")


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    seconds = time.monotonic() - start
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == report["max_score"] > 0
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert not failed, failed
    skipped = [r for r in report["results"] if r["status"] == "skipped"]
    assert all(r["message"] for r in skipped), "a skipped check must say why"
    assert "Total:" in report["stdout"] and "Hardware:" in report["stdout"]
    assert seconds < 60, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, env=offline_env)
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
    report = grade(path, env=offline_env)
    got = points_by_function(report)
    full = expected_full()
    for name, points in full.items():
        skipped = all(r["status"] == "skipped" for r in report["results"] if r["function"] == name)
        if name in (function, f"{function}_speedup"):  # a speedup counts only for correct code
            assert got[name] == 0, (name, report["results"])
        elif not skipped:
            assert got[name] == points, (name, [r for r in report["results"] if r["function"] == name])
