"""A SKIP never earns points, anywhere (issue 39): under nbgrader, in a class run's grades and
in the student's results.json, whatever the reason of the SKIP (hardware that cannot show a
speedup, ``--speed skip``, a hidden check without the answer key), and with no switch to award
them. Before, nbgrader and grade-folder awarded a hardware SKIP its points unless
``AUTOGRADER_SKIPPED=zero``, and A2's speed cell said "points given because the timed code is
correct".

The nbgrader test runs the bridge's own preprocessor (:class:`GradeInSandbox`) on A1's release
with a stand-in report, and scores its cells with nbgrader's own ``determine_grade``: the code
that sets nbgrader's points, without a kernel or a grading run. The same rule end to end:
tests/test_instructor_flow.py (nbgrader) and tests/test_batch_grading.py (grade-folder).

Tier: quick.
"""
from __future__ import annotations

import nbformat
import pytest

from autograder.integrations import gradebook, nbgrader_plugin
from autograder.keys import RESERVED
from autograder.results import (FAILED, PASSED, SKIPPED, SPEED_NOT_MEASURED, CheckResult,
                                Report, gradescope)
from conftest import REPO

RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
NO_GPUS = ("train_batch is correct, but its speedup needs 2 or more CUDA GPUs and this machine "
           "has 0: not graded here")
SKIP_REASONS = {"hardware": NO_GPUS, "--speed skip": SPEED_NOT_MEASURED, "no key": RESERVED}


def result(function, name, status, max_points, message=""):
    return {"function": function, "name": name, "status": status, "max_points": max_points,
            "points": max_points if status == PASSED else 0.0, "seconds": 0.1,
            "message": message}


def a1_report(speed_status=SKIPPED, speed_message=NO_GPUS, allreduce=PASSED):
    """A1's checks as a grading of the reference reports them on a machine without GPUs (the
    speedup SKIPs), ``allreduce``'s two checks with ``allreduce`` as status."""
    return {"assignment": "a1_data_parallel", "results": [
        result("copy_params", "copy_params_values", PASSED, 2.0),
        result("allreduce", "allreduce_sums", allreduce, 2.0, "wrong values" * (allreduce == FAILED)),
        result("allreduce", "allreduce_dtypes", PASSED, 1.0),
        result("split_batch", "split_batch_even", PASSED, 2.0),
        result("split_batch_weighted", "split_batch_weighted_sizes", PASSED, 2.0),
        result("train_batch", "train_batch_matches_single_device_sgd", PASSED, 4.0),
        result("train_batch_speedup", "train_batch_speedup_two_gpus", speed_status, 2.0,
               speed_message)]}


def nbgrader_cells(monkeypatch, report) -> dict[str, tuple[float, list]]:
    """A1's release through the bridge's preprocessor with ``report`` as its grading run:
    ``{grade_id: (nbgrader's score of the cell, its outputs)}`` of the autograded test cells."""
    from nbgrader.utils import determine_grade

    monkeypatch.setattr(nbgrader_plugin, "grade_notebook", lambda nb, assignment: report)
    nb = nbformat.read(RELEASE, as_version=4)
    nb, _ = nbgrader_plugin.GradeInSandbox().preprocess(
        nb, {"nbgrader": {"assignment": "a1_data_parallel"}})
    cells = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            cells[meta["grade_id"]] = (determine_grade(cell)[0], cell.outputs)
    return cells


@pytest.mark.parametrize("why", SKIP_REASONS)
def test_a_skipped_speed_check_scores_zero_in_nbgrader_without_an_error(monkeypatch, why):
    monkeypatch.setenv("AUTOGRADER_SKIPPED", "award")   # the old switch: no longer read
    cells = nbgrader_cells(monkeypatch, a1_report(speed_message=SKIP_REASONS[why]))
    score, outputs = cells["check_train_batch_speedup"]
    assert score == 0, outputs
    assert not [o for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
    text = "".join(o.get("text", "") for o in outputs)
    assert SKIP_REASONS[why] in text and "2 point(s) not given" in text, text
    assert "earns no points" in text and "points given because" not in text, text
    # every other cell of the reference: full points, as a plain output
    others = {k: v[0] for k, v in cells.items() if k != "check_train_batch_speedup"}
    assert others == {"check_copy_params": 2, "check_allreduce": 3, "check_split_batch": 2,
                      "check_split_batch_weighted": 2, "check_train_batch": 4}


def test_a_passed_speed_check_still_scores_full_and_a_failed_one_zero(monkeypatch):
    score, outputs = nbgrader_cells(monkeypatch, a1_report(PASSED, "1.8x (reference 1.9x)"))[
        "check_train_batch_speedup"]
    assert score == 2 and [o.output_type for o in outputs] == ["stream"]
    score, outputs = nbgrader_cells(monkeypatch, a1_report(FAILED, "your speedup is 1.01x"))[
        "check_train_batch_speedup"]
    assert score == 0 and outputs[-1].output_type == "error"


def test_partial_credit_and_failures_are_unchanged(monkeypatch):
    """A failed check among passed ones: nbgrader's partial credit (1 of allreduce's 3 points)."""
    score, outputs = nbgrader_cells(monkeypatch, a1_report(allreduce=FAILED))["check_allreduce"]
    assert score == 1 and outputs[-1].output_type == "execute_result"


@pytest.mark.parametrize("why", SKIP_REASONS)
def test_a_class_run_counts_a_skip_as_zero_out_of_one_maximum(monkeypatch, why):
    monkeypatch.setenv("AUTOGRADER_SKIPPED", "award")
    report = a1_report(speed_message=SKIP_REASONS[why])
    skip = report["results"][-1]
    assert gradebook.points_of(skip) == 0.0 and nbgrader_plugin.skipped_points(skip) == 0.0
    t = gradebook.tally(report["results"])
    assert (t.score, t.max_score, t.not_judged) == (13.0, 15.0, 2.0)
    assert t.needs_timing.startswith("train_batch_speedup")
    results = gradebook.student_results(report)      # grade-folder's and Gradescope's
    test = results["tests"][-1]
    assert results["score"] == 13.0 and test["score"] == 0.0 and test["max_score"] == 2.0
    assert SKIP_REASONS[why] in test["output"] and "earns no points" in test["output"]
    assert "AUTOGRADER_SKIPPED" not in gradebook.rule_text()
    assert "earns 0" in gradebook.rule_text() and "never earns points" in gradebook.rule_text()


def test_the_clis_results_json_gives_a_skip_nothing():
    checks = [CheckResult(**r) for r in a1_report()["results"]]
    out = gradescope(Report("a1_data_parallel", "cpu", "none", 1, checks))
    skip = out["tests"][-1]
    assert out["score"] == 13.0 and skip["score"] == 0 and skip["max_score"] == 0
    assert skip["output"].startswith("Not graded on this machine") and "earns no points" in \
        skip["output"]
