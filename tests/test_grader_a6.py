"""Assignment 6 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks.

Every grading run starts one 4-process run per function, so bugs that break different functions
are planted together: ``ring_attention`` is graded with the reference ``merge_attention``, and
``train_cp`` with the reference ring and Ulysses, so each bug costs its own function only. The
second bug of ``ring_attention`` and of ``train_cp`` gets a second run (``--only`` those two), and
a ring that all-gathers K/V (right values, wrong communication) a third.

Tier: both: reference full marks and stub zero are quick (one grading each); planted bugs are
full.
"""
from __future__ import annotations

import pytest

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, planted_copy, points_by_function)

SOURCE = REPO / "solutions" / "a6_context_parallel" / "context_parallel.ipynb"
RELEASE = REPO / "assignments" / "a6_context_parallel" / "context_parallel.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # no running max: exp(lse) overflows at lse ~ 1000 (inf / inf = NaN)
    "merge_attention": ("    top = torch.where(empty, torch.zeros_like(top), top)\n",
                        "    top = torch.zeros_like(top)\n"),
    # the causal mask of the diagonal block hides the diagonal itself
    "ring_attention": ("        mask = pos[:, None] >= pos[None, :]\n",
                       "        mask = pos[:, None] > pos[None, :]\n"),
    # chunks 2n-1-r and r on odd ranks
    "zigzag_shard": ("    return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim)\n",
                     "    pair = [chunks[r], chunks[2 * n - 1 - r]]\n"
                     "    return torch.cat(pair[::-1] if r % 2 else pair, dim)\n"),
    # the sequence chunks that the first all-to-all brings are laid along the heads, not
    # along the sequence
    "ulysses_attention": (
        "    q_h, k_h, v_h = got.permute(1, 2, 3, 0, 4, 5).reshape(3, B, h, n * L, D)\n",
        "    q_h, k_h, v_h = got.permute(1, 2, 0, 3, 4, 5).reshape(3, B, h, n * L, D)\n"),
    # the gradients are not reduced: each rank steps with its own tokens' gradient
    "train_cp": ("                dist.all_reduce(p.grad, group=group)   # SUM: the whole-sequence "
                 "gradient\n", "                pass\n"),
}
SECOND_BUGS = {
    # the accumulators of dK/dV make n-1 hops, not n: they end one rank short of home
    "ring_attention": (
        "            if n > 1:                               # the accumulator follows its K/V\n",
        "            if step < n - 1:                        # the accumulator follows its K/V\n"),
    # the gradients averaged over the group instead of summed
    "train_cp": ("                dist.all_reduce(p.grad, group=group)   # SUM: the whole-sequence "
                 "gradient\n", "                dist.all_reduce(p.grad, group=group)\n"
                 "                p.grad /= n\n"),
}
# Right values from an all-gather of K and V (functional collectives, with autograd): a
# collective, and scores of the local queries against the whole sequence
ALL_GATHER_RING = {"ring_attention": (
    "    return _RingAttention.apply(q, k, v, causal, group, layout)\n",
    "    n, r = dist.get_world_size(group), dist.get_rank(group)\n"
    "    from torch.distributed._functional_collectives import all_gather_tensor_autograd\n"
    "    world = group if group is not None else dist.group.WORLD\n"
    "    K = all_gather_tensor_autograd(k.contiguous(), 2, world)\n"
    "    V = all_gather_tensor_autograd(v.contiguous(), 2, world)\n"
    "    length = q.size(-2)\n"
    "    pos_q = _positions(layout, r, n, length, q.device)\n"
    "    pos_k = torch.cat([_positions(layout, j, n, length, q.device) for j in range(n)])\n"
    "    scores = q @ K.transpose(-2, -1) / math.sqrt(q.size(-1))\n"
    "    if causal:\n"
    "        scores = scores.masked_fill(pos_q[:, None] < pos_k[None, :], float('-inf'))\n"
    "    return torch.softmax(scores, -1) @ V\n")}


def write(tmp_path, name, bugs):
    return planted_copy(SOURCE, tmp_path, name, bugs)


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    assert_grades_full_marks_within(SOURCE, 300, offline_env)


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, "--speed", "skip", env=offline_env)
    assert_stubs_score_zero(report)


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """Five bugs in five functions, in one grading run: each loses all of its function's
    points, every other function keeps all of its own."""
    report = grade(write(tmp_path, "bugs", BUGS), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_lose_points(report, BUGS)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "NaN" in failed["merge_attention_exact_in_float64"], failed
    assert "zigzag_shard (chunk r, then chunk 2n-1-r" in failed["zigzag_shard_and_unshard"]
    assert "train_cp(mode='ring')" in failed["train_cp_ring_matches_one_process_training"]


@pytest.mark.full
@pytest.mark.slow
def test_second_bugs_of_the_ring_and_of_training(offline_env, tmp_path):
    """dK/dV accumulators one hop short of home; gradients averaged instead of summed."""
    report = grade(write(tmp_path, "second", SECOND_BUGS), "--only", ",".join(SECOND_BUGS),
                   "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == set(SECOND_BUGS)
    assert all(points == 0 for points in points_by_function(report).values()), report["stdout"]
    assert all(r["status"] == "failed" and r["message"] for r in report["results"])
    failed = {r["name"]: r["message"] for r in report["results"]}
    assert "the gradient of k" in failed["ring_attention_contiguous_outputs_and_gradients"]


@pytest.mark.full
@pytest.mark.slow
def test_a_ring_that_all_gathers_loses_the_communication_check(offline_env, tmp_path):
    """Right outputs and gradients from an all-gather of K/V: the value checks pass, the
    point-to-point check fails (and the memory check: scores against the whole sequence)."""
    report = grade(write(tmp_path, "gather", ALL_GATHER_RING), "--only", "ring_attention",
                   "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    status = {r["name"]: r for r in report["results"]}
    for name in ("ring_attention_contiguous_outputs_and_gradients",
                 "ring_attention_zigzag_outputs_and_gradients"):
        assert status[name]["status"] == "passed", status[name]
    p2p = status["ring_attention_point_to_point_within_bounds"]
    assert p2p["status"] == "failed" and "ALLGATHER" in p2p["message"], p2p
    memory = status["ring_attention_memory_and_causal_skipping"]
    assert memory["status"] == "failed" and "batch*heads*L*L" in memory["message"], memory
