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

from conftest import (REPO, assert_full_marks, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, plant_bugs, points_by_function)

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


def with_bugs(tmp_path, *functions):
    path = tmp_path / "submission.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4),
                              {f: BUGS[f] for f in functions}), path)
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
    assert_full_marks(report)
    print(report["stdout"])
    print(f"graded in {seconds:.1f} s, {cpu:.1f} CPU seconds")
    assert cpu < 110, f"grading took {cpu:.1f} CPU seconds ({seconds:.1f} s)"
    assert seconds < 300, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, env=offline_env)
    assert_stubs_score_zero(report)
    for r in report["results"]:
        if r["status"] == "failed":
            assert "course/launch.py" not in r["message"], r


@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """The three functions that call no other, broken together, in one whole grading run: each
    loses its points, and train_ddp, which calls make_dataloader and may call
    average_gradients, keeps all of its own (its check uses the reference helpers)."""
    leaves = ("average_gradients", "ring_allreduce", "make_dataloader")
    assert_only_these_lose_points(grade(with_bugs(tmp_path, *leaves), env=offline_env), leaves)


@pytest.mark.slow
def test_training_without_gradient_sync_loses_train_ddps_points(offline_env, tmp_path):
    report = grade(with_bugs(tmp_path, "train_ddp"), "--only", "train_ddp", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == {"train_ddp"}
    assert points_by_function(report)["train_ddp"] == 0, report["results"]
    assert all(r["status"] in ("failed", "skipped") and r["message"] for r in report["results"])
