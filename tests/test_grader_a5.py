"""Assignment 5 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function(s) it breaks.

Every grading run starts several 4-process runs, so bugs that break different functions are
planted together: ``ParallelMLP``, ``train_2d`` and ``cross_check`` are graded with the
reference layers, so bugs in ``ColumnParallelLinear`` and ``RowParallelLinear`` cost only their
own points, and a bug in ``train_2d`` only its own. The rank-reversed slices, which leave every
block's output right, get a run of their own restricted to the two layers.
"""
from __future__ import annotations

import time

import nbformat
import pytest

from conftest import (REPO, assert_full_marks, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, plant_bugs, points_by_function)

SOURCE = REPO / "solutions" / "a5_tensor_parallel" / "tensor_parallel.ipynb"
RELEASE = REPO / "assignments" / "a5_tensor_parallel" / "tensor_parallel.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # Megatron's f without its backward: the input's gradient is never all-reduced (only
    # visible when the input needs a gradient: a second block, or the check's own input)
    "ColumnParallelLinear": (
        "        return _all_reduce(grad.contiguous().clone(), ctx.group), None\n",
        "        return grad, None\n"),
    # the bias added on every rank before the all-reduce: n times the bias
    "RowParallelLinear": (
        "        y = _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)\n",
        "        y = _ReduceFromGroup.apply(F.linear(x, self.weight, self.bias), self.group)\n"
        "        return y\n"),
    # each rank subtracts its own maximum: the ranks' sums of exponentials do not add up
    "vocab_parallel_cross_entropy": (
        "            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)\n",
        "            pass\n"),
    # gradients averaged over the tp group instead of the dp group
    "train_2d": ("                param.sub_(_all_reduce(param.grad, dp_group) / dp, alpha=lr)\n",
                 "                param.sub_(_all_reduce(param.grad, tp_group) / tp, alpha=lr)\n"),
}
# rank r takes the slice of rank n - 1 - r in both layers (_my_slice is in Part 1's cell and
# used by both): every block still equals the dense one, only per-rank checks see it
REVERSED_SLICES = {"ColumnParallelLinear": (
    "    n, r = dist.get_world_size(group), dist.get_rank(group)\n",
    "    n = dist.get_world_size(group)\n    r = n - 1 - dist.get_rank(group)\n")}


def write(tmp_path, name, bugs):
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4), bugs), path)
    return path


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    seconds = time.monotonic() - start
    assert_full_marks(report)
    print(report["stdout"])
    assert seconds < 300, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, env=offline_env)
    assert_stubs_score_zero(report)


@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """Four bugs in four functions, in one grading run: each of the four loses points (the
    checks its bug breaks); ParallelMLP and cross_check, graded with the reference layers, keep
    all of theirs."""
    report = grade(write(tmp_path, "bugs", BUGS), env=offline_env)
    # the layers' slices stay right with these bugs: their slice checks keep their point
    assert_only_these_lose_points(report, BUGS, all_of_them=False)
    print(report["stdout"])
    messages = " ".join(r["message"] for r in report["results"])
    assert "the gradient of the input" in messages      # the column layer's missing f
    assert "the loss (vs F.cross_entropy" in messages   # the local maximum


@pytest.mark.slow
def test_rank_reversed_slices_lose_both_layers_points(offline_env, tmp_path):
    layers = ("ColumnParallelLinear", "RowParallelLinear")
    report = grade(write(tmp_path, "reversed", REVERSED_SLICES), "--only", ",".join(layers),
                   env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == set(layers)
    points = points_by_function(report)
    assert points["ColumnParallelLinear"] == points["RowParallelLinear"] == 0, report["stdout"]
    assert all(r["status"] == "failed" and r["message"] for r in report["results"]), \
        report["stdout"]
