"""Checks that accepted no work (issue 39), on real gradings: a training function that trains
nothing and hands back its parameters as int64 loses its points. The float64 truth used to be
cast to the dtype the student returned; truncated to int64, LeNet's weights (and the small
nets' of A2) are zeros, like the untrained ones: A1's ``train_batch`` scored 4/4 and A2's
``train_ddp`` 3/3 (with ``--speed skip``). The comparison itself: tests/test_expect_dtypes.py;
the references keep full marks: tests/test_grader_a1.py, test_grader_a2.py.

Tier: full (two gradings, ``--only`` the function concerned, ``--speed skip``; about 30 s on 2
busy cores).
"""
from __future__ import annotations

import nbformat
import pytest

from conftest import REPO, grade, plant_bugs, points_by_function

pytestmark = [pytest.mark.full, pytest.mark.slow]

A1 = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
A2 = REPO / "solutions" / "a2_ddp" / "ddp.ipynb"

# A1: no step at all; every replica's parameters replaced by int64 copies (zeros: |w| < 1)
A1_INT64 = {"train_batch": (
    "    X_shards, y_shards = split_batch(X, y, devices)\n",
    "    for params in device_params:\n"
    "        params[:] = [p.detach().to(torch.int64) for p in params]\n"
    "    return\n"
    "    X_shards, y_shards = split_batch(X, y, devices)\n")}
# A2: reads every batch (the data checks pass), never steps, returns the parameters as int64
A2_INT64 = {"train_ddp": (
    "    return [p.detach().cpu() for p in model.parameters()]\n",
    "    return [p.detach().cpu().to(torch.int64) for p in model.parameters()]\n")}
A2_NO_STEP = {"train_ddp": ("            optimizer.step()\n", "")}


def submission(tmp_path, source, *bugs):
    nb = nbformat.read(source, as_version=4)
    for planted in bugs:
        plant_bugs(nb, planted)
    path = tmp_path / source.name
    nbformat.write(nb, path)
    return path


def assert_dtype_failures(report, function, dtype="torch.int64"):
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == {function}, report["stdout"]
    assert points_by_function(report)[function] == 0, report["stdout"]
    judged = [r for r in report["results"] if r["status"] != "skipped"]
    assert judged and all(r["status"] == "failed" for r in judged), report["stdout"]
    assert all(f"has dtype {dtype}, expected torch.float32" in r["message"]
               for r in judged), report["stdout"]


def test_a1_train_batch_that_trains_nothing_and_returns_int64_scores_zero(offline_env, tmp_path):
    report = grade(submission(tmp_path, A1, A1_INT64), "--only", "train_batch",
                   "--speed", "skip", env=offline_env)
    assert_dtype_failures(report, "train_batch")


def test_a2_train_ddp_that_trains_nothing_and_returns_int64_scores_zero(offline_env, tmp_path):
    report = grade(submission(tmp_path, A2, A2_INT64, A2_NO_STEP), "--only", "train_ddp",
                   "--speed", "skip", env=offline_env)
    assert_dtype_failures(report, "train_ddp")
