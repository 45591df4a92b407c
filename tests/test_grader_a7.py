"""Assignment 7 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks.

Each function is graded with the reference versions of the parts it calls, so bugs that break
different functions are planted together: one grading run holds a bug in each of route,
expert_capacity (keep_mask), MoELayer, ExpertParallelMoE and train_ep; a second run (``--only``
those two) holds the second bug of ExpertParallelMoE and of train_ep. Not exchanging the counts
makes gloo kill a rank (SIGABRT): the failure must say so, not hang.

Tier: both: reference full marks and stub zero are quick (one grading each); planted bugs are
full.
"""
from __future__ import annotations

import pytest

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, planted_copy, points_by_function)

SOURCE = REPO / "solutions" / "a7_expert_parallel" / "expert_parallel.ipynb"
RELEASE = REPO / "assignments" / "a7_expert_parallel" / "expert_parallel.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # the weights are the probabilities at the k experts, not renormalised over them
    "route": ("    return top / top.sum(dim=-1, keepdim=True), experts\n",
              "    return top, experts\n"),
    # capacity filled in token order (token 0's choices, then token 1's, ...), no first-choice
    # priority
    "expert_capacity": (
        "    order = experts.t().reshape(-1)               # column 0 in token order, then "
        "column 1, ...\n",
        "    order = experts.t().reshape(-1)               # column 0 in token order, then "
        "column 1, ...\n    order = experts.reshape(-1)\n"),
    # f_i from the kept assignments only (after dropping)
    "MoELayer": ("        aux = load_balancing_loss(logits, experts, self.num_experts)\n",
                 "        P = torch.softmax(logits, dim=-1).mean(dim=0)\n"
                 "        f = torch.bincount(experts[keep], minlength=self.num_experts)\n"
                 "        aux = self.num_experts * (f.to(x.dtype) / experts.numel() * P)"
                 ".sum()\n"),
    # the counts are not exchanged: each rank assumes it receives what it sends
    "ExpertParallelMoE": (
        "            dist.all_to_all_single(received, counts, group=self.group)\n",
        "            received = counts.clone()\n"),
    # the experts' gradients are not divided by n (they step with the sum over the ranks)
    "train_ep": ("            for p in experts:               # already summed over every rank's "
                 "tokens\n                if p.grad is not None:\n"
                 "                    p.grad /= n\n",
                 "            for p in experts:               # already summed over every rank's "
                 "tokens\n                pass\n"),
}
SECOND_BUGS = {
    # each expert's output added back without its routing weight
    "ExpertParallelMoE": (
        "        y = torch.zeros_like(x).index_add(0, tokens, back * weights[tokens, choices]"
        ".unsqueeze(1))\n", "        y = torch.zeros_like(x).index_add(0, tokens, back)\n"),
    # the dense gradients summed over the ranks, not averaged
    "train_ep": ("                dist.all_reduce(p.grad, group=group)\n"
                 "                p.grad /= n\n",
                 "                dist.all_reduce(p.grad, group=group)\n"),
}


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
    points, every other function keeps all of its own; the rank that gloo killed is named."""
    report = grade(write(tmp_path, "bugs", BUGS), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_lose_points(report, BUGS)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "ties to the lower index" not in failed["route_values_ties_and_value_error"]
    assert "weights" in failed["route_values_ties_and_value_error"], failed
    assert "first choices in token order" in failed["keep_mask_hand_made_cases"], failed
    assert "aux" in failed["MoELayer_outputs_with_and_without_drops"], failed
    assert "exchange the counts" in failed["ExpertParallelMoE_forward_equals_the_dense_layer"]
    assert "train_ep" in failed["train_ep_state_matches_one_process_training"], failed


@pytest.mark.full
@pytest.mark.slow
def test_second_bugs_of_expert_parallelism_and_of_training(offline_env, tmp_path):
    """The combine without the routing weights; the dense gradients summed, not averaged."""
    report = grade(write(tmp_path, "second", SECOND_BUGS), "--only", ",".join(SECOND_BUGS),
                   "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == set(SECOND_BUGS)
    assert all(points == 0 for points in points_by_function(report).values()), report["stdout"]
    assert all(r["status"] == "failed" and r["message"] for r in report["results"])
    failed = {r["name"]: r["message"] for r in report["results"]}
    assert "y (vs the dense layer" in failed["ExpertParallelMoE_forward_equals_the_dense_layer"]
