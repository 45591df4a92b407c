"""Assignment 2 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks.

Each grading run starts dozens of processes (every rank imports torch), so the bugs in the
three functions that call no other are planted together in one run: ``train_ddp`` uses
``make_dataloader`` and may use ``average_gradients``, and keeps its full points with those
bugs, because the grader runs it with the reference versions of those helpers. The bug in
``train_ddp`` itself is graded with ``--only train_ddp``.
"""
from __future__ import annotations

import resource
import time

import nbformat
import pytest

from conftest import REPO, grade, points_by_function

SOURCE = REPO / "solutions" / "a2_ddp" / "ddp.ipynb"
RELEASE = REPO / "assignments" / "a2_ddp" / "ddp.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # no division by the world size: gradients summed, not averaged
    "average_gradients": ("            p.grad /= world_size\n", ""),
    # the all-gather stops one step short: a chunk never reaches the other ranks
    "ring_allreduce": ("for step in range(world - 1):  # all-gather",
                       "for step in range(world - 2):  # all-gather"),
    # every rank shuffles with its own seed: the shards overlap and leave examples out
    "make_dataloader": ("manual_seed(self.seed + self.epoch)",
                        "manual_seed(self.seed + self.epoch + self.rank)"),
    # the training loop never synchronises the gradients
    "train_ddp": ("            F.cross_entropy(ddp(X), y).backward()\n",
                  "            with ddp.no_sync():\n"
                  "                F.cross_entropy(ddp(X), y).backward()\n"),
}


def expected_full() -> dict[str, float]:
    from autograder.harness import functions_of

    return functions_of("a2_ddp")


def with_bugs(tmp_path, *functions):
    nb = nbformat.read(SOURCE, as_version=4)
    for function in functions:
        old, new = BUGS[function]
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == function)
        assert old in cell.source, f"the planted bug for {function} no longer applies"
        cell.source = cell.source.replace(old, new)
    path = tmp_path / "submission.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the grader and everything it started: unlike the wall time, this hardly
    # depends on what else the machine runs. Two idle cores grade it in about half of it.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == report["max_score"] > 0, report["stdout"]
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert not failed, failed
    skipped = [r for r in report["results"] if r["status"] == "skipped"]
    assert all(r["message"] for r in skipped), "a skipped check must say why"
    assert points_by_function(report).keys() == expected_full().keys()
    assert "Total:" in report["stdout"] and "Hardware:" in report["stdout"]
    print(report["stdout"])
    print(f"graded in {seconds:.1f} s, {cpu:.1f} CPU seconds")
    assert cpu < 110, f"grading took {cpu:.1f} CPU seconds ({seconds:.1f} s)"
    assert seconds < 300, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == 0
    assert report["max_score"] > 0
    for r in report["results"]:
        if r["status"] == "failed":
            assert "NotImplementedError" in r["message"], r
            assert "course/launch.py" not in r["message"], r
    assert "Traceback" not in report["stdout"]


@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """The three functions that call no other, broken together, in one whole grading run: each
    loses its points, and train_ddp, which calls make_dataloader and may call
    average_gradients, keeps all of its own (its check uses the reference helpers)."""
    leaves = ("average_gradients", "ring_allreduce", "make_dataloader")
    report = grade(with_bugs(tmp_path, *leaves), env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    got, full = points_by_function(report), expected_full()
    assert got.keys() == full.keys()
    for name in leaves:
        results = [r for r in report["results"] if r["function"] == name]
        assert got[name] == 0, results
        assert all(r["status"] in ("failed", "skipped") and r["message"] for r in results), results
    train = [r for r in report["results"] if r["function"] == "train_ddp"]
    assert all(r["status"] == "skipped" for r in train) or got["train_ddp"] == full["train_ddp"], train


@pytest.mark.slow
def test_training_without_gradient_sync_loses_train_ddps_points(offline_env, tmp_path):
    report = grade(with_bugs(tmp_path, "train_ddp"), "--only", "train_ddp", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == {"train_ddp"}
    assert points_by_function(report)["train_ddp"] == 0, report["results"]
    assert all(r["status"] in ("failed", "skipped") and r["message"] for r in report["results"])
