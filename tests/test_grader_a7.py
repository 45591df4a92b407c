"""Assignment 7 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks.

Each function is graded with the reference versions of the parts it calls, so bugs that break
different functions are planted together: one grading run holds a bug in each of route,
expert_capacity (keep_mask), MoELayer, ExpertParallelMoE and train_ep; a second run (``--only``
those two) holds the second bug of ExpertParallelMoE and of train_ep. Not exchanging the counts
makes gloo kill a rank (SIGABRT): the failure must say so, not hang.

Without the answer key (``AUTOGRADER_ANSWER_KEY=absent``, the student's view) the reference
earns every public point and the hidden checks are reserved; the public cases' JSON is the key's
:func:`public_cases`, never drifting.

Tier: both: reference full marks, without the key, and stub zero are quick (one grading each);
planted bugs are full.
"""
from __future__ import annotations

import json
import runpy

import pytest

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, planted_copy, points_by_function)

from autograder.assignments.a7_expert_parallel.spec import SPEC
from autograder.keys import RESERVED, WITHOUT_KEY_ENV, is_reserved, key_path

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
def test_without_the_key_the_reference_earns_every_public_point(offline_env):
    """The student's view: every public check passes, every hidden one is reserved (SKIP with
    RESERVED, no points either way), and every function has at least one public check."""
    report = grade(SOURCE, "--speed", "skip", env={**offline_env, WITHOUT_KEY_ENV: "absent"})
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    hidden = {c.name for c in SPEC.checks if c.hidden}
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {c.name for c in SPEC.checks}
    for name, r in results.items():
        if name in hidden:
            assert is_reserved(r) and r["message"] == RESERVED and r["points"] == 0, r
        else:
            assert r["status"] == "passed" and r["points"] == r["max_points"], r
    assert report["score"] == SPEC.public_points() == 12
    public = {c.function for c in SPEC.checks if not c.hidden}
    assert public == {c.function for c in SPEC.checks}  # keep_mask is graded with expert_capacity
    assert "6 more when your instructor grades" in report["stdout"]


def test_public_cases_json_is_the_keys():
    """``public_cases.json`` holds exactly what the key's ``public_cases()`` returns."""
    path = REPO / "autograder" / "assignments" / "a7_expert_parallel" / "public_cases.json"
    key = runpy.run_path(str(key_path("a7_expert_parallel")))
    assert json.loads(path.read_text()) == key["public_cases"]()
    hidden = {tuple(c) for c in key["HIDDEN_CAPACITY"]}
    public = {tuple(c["args"]) for c in json.loads(path.read_text())["expert_capacity"]}
    assert not hidden & public, "a hidden case in the public JSON"


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
    route = failed["route_fixed_cases_invariants_and_value_error"]
    assert "ties to the lower index" not in route and "weights" in route, failed
    assert "first choices in token order" in failed["keep_mask_fixed_cases_and_the_fill_order"]
    assert "aux" in failed["MoELayer_outputs_against_a_per_token_loop"], failed
    assert "aux" in failed["MoELayer_against_the_answer_key"], failed
    assert "exchange the counts" in failed["ExpertParallelMoE_forward_against_a_per_token_loop"]
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
    assert "y (vs a per-token loop" in failed["ExpertParallelMoE_forward_against_a_per_token_loop"]
    assert "y (vs the answer key" in failed["ExpertParallelMoE_against_the_answer_key"]
