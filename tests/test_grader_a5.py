"""Assignment 5 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function(s) it breaks.

Every grading run starts several 4-process runs, so bugs that break different functions are
planted together. ``ParallelMLP``, ``train_2d`` and ``cross_check`` are graded with the
submission's own layers (as in the student's self-check), so bugs in ``ColumnParallelLinear``
and ``RowParallelLinear`` also cost ``ParallelMLP``'s and ``cross_check``'s checks that use
them. The rank-reversed slices, which leave every block's output right, get a run of their own
restricted to the two layers (and cross_check, with a bug of its own); the bugs that only the
later rules catch (a dense layer changed by from_linear, 3-D inputs only, an all-gather's
output, the sequence-parallel layout, an error on the ranks) get two more runs: the layers' and
the loss's, then cross_check's and train_2d's (which the 3-D-only layer would break too).

Tier: both: reference full marks and stub zero are quick (one grading each); planted bugs are
full.
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
REVERSED_SLICES = {
    "ColumnParallelLinear": (
        "    n, r = dist.get_world_size(group), dist.get_rank(group)\n",
        "    n = dist.get_world_size(group)\n    r = n - 1 - dist.get_rank(group)\n"),
    # parallelize_module on mlp itself, not on a deep copy: the blocks are right, mlp is not
    "cross_check": ("\"sequence_parallel\": parallelize_module(copy.deepcopy(mlp), mesh, rows)",
                    "\"sequence_parallel\": parallelize_module(mlp, mesh, rows)"),
}
# Bugs that only the rules added later catch, one grading run (--only their functions).
NEW_RULES = {
    # from_linear freezes the dense layer: every slice, output and gradient stays right; only
    # the check that the dense layer is unchanged after from_linear sees it
    "ColumnParallelLinear": (
        "        rows = _my_slice(linear.out_features, group)\n",
        "        rows = _my_slice(linear.out_features, group)\n"
        "        linear.requires_grad_(False)  # the dense layer is not trained any more\n"),
    # (batch, sequence, features) inputs only: right on 3-D inputs, fails on 4-D ones
    "RowParallelLinear": (
        "        y = _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)\n",
        "        y = _ReduceFromGroup.apply(torch.einsum(\"bsi,oi->bso\", x, self.weight),\n"
        "                                   self.group)\n"),
    # each rank's (max, sum of exponentials) all-gathered and merged: right values, 3 x batch
    # elements in (passes a bound on inputs alone) but n x 2 x batch + batch out
    "vocab_parallel_cross_entropy": (
        "        top = logits.max(dim=-1).values\n"
        "        if dist.get_world_size(group) > 1:\n"
        "            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)\n",
        "        own = logits.max(dim=-1).values\n"
        "        stats = torch.stack([own, (logits - own[:, None]).exp().sum(dim=-1)])\n"
        "        ranks = dist.get_world_size(group)\n"
        "        every = stats.new_empty((ranks * 2, batch))\n"
        "        dist.all_gather_into_tensor(every, stats, group=group)\n"
        "        every = every.view(ranks, 2, batch)\n"
        "        top = every[:, 0].max(dim=0).values\n"
        "        total = (every[:, 1] * (every[:, 0] - top).exp()).sum(dim=0)\n"),
    # the sequence-parallel block's output left replicated (all tokens on every rank)
    "cross_check": ("RowwiseParallel(output_layouts=Shard(0))", "RowwiseParallel()"),
    # an error on the ranks (train_2d runs on 2 and 4 processes only): the message names it
    "train_2d": ("        loss.backward()\n",
                 "        loss.backward()\n        optimizer = None\n        optimizer.step()\n"),
}
# the all-gather bug's sums: the merged sum of exponentials, the target's logit all-reduced
NEW_RULES_SECOND = ("        sums = _all_reduce(torch.stack([exp.sum(dim=-1), picked]), group)\n",
                    "        sums = torch.stack([total, _all_reduce(picked, group)])\n")


def write(tmp_path, name, bugs, *more):
    """The reference with ``bugs`` planted (and each further ``(function, (old, new))``)."""
    path = tmp_path / f"{name}.ipynb"
    nb = plant_bugs(nbformat.read(SOURCE, as_version=4), bugs)
    for function, bug in more:
        plant_bugs(nb, {function: bug})
    nbformat.write(nb, path)
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


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """Four bugs in four functions, in one grading run: each of the four loses points (the
    checks its bug breaks), and so do ParallelMLP and cross_check, which run with these (own,
    broken) layers; every other function keeps all of its points."""
    report = grade(write(tmp_path, "bugs", BUGS), env=offline_env)
    # the layers' slices stay right with these bugs: their slice checks keep their point;
    # ParallelMLP and cross_check's own block fail with the layers (confirmed by a grading of
    # the two layer bugs alone: ParallelMLP's checks, cross_check's "ours" and train_2d's fail)
    assert_only_these_lose_points(report, [*BUGS, "ParallelMLP", "cross_check"],
                                  all_of_them=False)
    print(report["stdout"])
    messages = " ".join(r["message"] for r in report["results"])
    assert "the gradient of the input" in messages      # the column layer's missing f
    assert "the loss (vs F.cross_entropy" in messages   # the local maximum


@pytest.mark.full
@pytest.mark.slow
def test_rank_reversed_slices_lose_both_layers_points(offline_env, tmp_path):
    """Reversed slices cost both layers all their points; cross_check changing mlp in place
    (its blocks right) loses the point of the check that mlp is unchanged, not the other."""
    graded = ("ColumnParallelLinear", "RowParallelLinear", "cross_check")
    report = grade(write(tmp_path, "reversed", REVERSED_SLICES), "--only", ",".join(graded),
                   env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == set(graded)
    points = points_by_function(report)
    assert points["ColumnParallelLinear"] == points["RowParallelLinear"] == 0, report["stdout"]
    assert all(r["status"] == "failed" and r["message"] for r in report["results"]
               if r["function"] != "cross_check"), report["stdout"]
    status = {r["name"]: r for r in report["results"] if r["function"] == "cross_check"}
    assert status["cross_check_sequence_parallel_block"]["status"] == "passed", report["stdout"]
    changed = status["cross_check_ours_and_torch_equal_the_dense_block"]
    assert changed["status"] == "failed" and "leave mlp unchanged" in changed["message"], changed


@pytest.mark.full
@pytest.mark.slow
def test_bugs_only_the_later_rules_catch(offline_env, tmp_path):
    """A dense layer changed by from_linear, a layer right on 3-D inputs only, an all-gather
    whose output grows with the ranks, a sequence-parallel block that returns every token, an
    error on the ranks: each loses its function's points (only the checks it breaks, where it
    leaves the others right), with a message that says why. Two runs: cross_check and train_2d
    run with the submission's own layers, which the 3-D-only layer breaks (on 2-D inputs), so
    their own bugs are graded in a run of their own, beside correct layers."""
    results = []
    for run, functions in enumerate([
            ("ColumnParallelLinear", "RowParallelLinear", "vocab_parallel_cross_entropy"),
            ("cross_check", "train_2d")]):
        own = {f: bug for f, bug in NEW_RULES.items() if f in functions}
        more = [("vocab_parallel_cross_entropy", NEW_RULES_SECOND)] \
            if "vocab_parallel_cross_entropy" in own else []
        path = write(tmp_path, f"later_{run}", own, *more)
        report = grade(path, "--only", ",".join(functions), env=offline_env)
        assert report["returncode"] == 0, report["stdout"] + report["stderr"]
        print(report["stdout"])
        assert {r["function"] for r in report["results"]} == set(functions)
        results += report["results"]
    failed = {r["name"]: r["message"] for r in results if r["status"] == "failed"}
    assert all(failed.values()), failed
    assert set(failed) == {
        "column_parallel_slices_shapes_and_errors",           # only the dense layer changed
        "row_parallel_slices_shapes_and_errors", "row_parallel_outputs_and_gradients",
        "vocab_parallel_cross_entropy_communication_bound",  # values right, output too big
        "cross_check_sequence_parallel_block",
        "train_2d_two_by_two_matches_dense_training", "train_2d_one_by_two_and_two_by_one",
        "train_2d_uses_the_tp_groups"}, failed
    assert "from_linear must leave `linear` unchanged" in failed[
        "column_parallel_slices_shapes_and_errors"]
    assert "einsum" in failed["row_parallel_outputs_and_gradients"]
    assert "gave back" in failed["vocab_parallel_cross_entropy_communication_bound"]
    assert "has shape" in failed["cross_check_sequence_parallel_block"]
    rank_failure = failed["train_2d_two_by_two_matches_dense_training"]
    assert "with 4 processes, rank" in rank_failure and "'NoneType' object has no attribute " \
        "'step'" in rank_failure, rank_failure
    # the student's cell and line, as a one-process failure shows them (line 26 of the cell is
    # `loss.backward()`; the planted `optimizer.step()` is two lines below)
    assert "in cell train_2d, line 28" in rank_failure, rank_failure
