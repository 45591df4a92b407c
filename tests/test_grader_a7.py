"""Assignment 7 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the checks that judge what it breaks (each check judges only what
it is named for: a wrong keep_mask costs keep_mask's checks, not expert_capacity's values).

Each function is graded with the submission's own versions of the parts it calls (as in the
student's self-check), whose bugs can then cost its checks too; bugs that break different
functions are planted together where each caller has a bug of its own: one grading run holds a
bug in each of route, expert_capacity (keep_mask), MoELayer, ExpertParallelMoE and train_ep; a
second run (``--only`` those two) holds the second bug of ExpertParallelMoE and of train_ep
(train_ep's own two bugs get a run of their own, beside a correct ExpertParallelMoE). Not
exchanging the counts makes gloo kill a rank (SIGABRT): the failure must say so, not hang. A
third run holds code the text allows (``experts.view(-1)``: the route the text asks for returns
contiguous tensors) and bad-input handlers that change module state: they may cost their
ValueError points, and what the changed state breaks.

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

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_checks_fail,
                      assert_only_these_lose_points, assert_public_points_without_the_key,
                      assert_stubs_score_zero, grade, planted_copy, points_by_function)

from autograder.assignments.a7_expert_parallel.spec import SPEC
from autograder.keys import key_path

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


#: What the first run's bugs cost, check by check: every other check keeps its points.
BUGS_LOSE = {
    "route_fixed_cases_invariants_and_value_error",
    "route_random_cases_and_gradient_against_the_key",
    # the fill order is keep_mask's: expert_capacity's own values and errors keep their point
    "keep_mask_fixed_cases_and_the_fill_order",
    "expert_capacity_and_keep_mask_random_cases_against_the_key",
    "MoELayer_outputs_against_a_per_token_loop", "MoELayer_gradients_against_a_per_token_loop",
    "MoELayer_against_the_answer_key",
    *(c.name for c in SPEC.checks if c.function in ("ExpertParallelMoE", "train_ep")),
}
#: The second run: the combine without the weights costs the values, not from_moe's attributes
#: nor the collectives (their counts and sizes are right).
SECOND_LOSE = {
    "ExpertParallelMoE_forward_against_a_per_token_loop",
    "ExpertParallelMoE_gradients_against_a_per_token_loop",
    "ExpertParallelMoE_against_the_answer_key",
    *(c.name for c in SPEC.checks if c.function == "train_ep"),
}

# The third run: what the text allows, or costs only a ValueError point.
ALLOWED = {
    # torchtitan's TokenReorderer flattens the experts with view(-1): the submission's route
    # (the reference's answer here) returns a contiguous tensor, as the text says
    "MoELayer": ("        chosen = experts[tokens, choices]\n",
                 "        chosen = experts.view(-1)[tokens * self.k + choices]\n"),
    "ExpertParallelMoE": (
        "        if moe.num_experts % n:\n"
        "            raise ValueError(f\"{moe.num_experts} experts cannot be split over {n} ranks\")\n",
        "        if moe.num_experts % n:  # no error, and every later forward of the class breaks\n"
        "            cls.forward = lambda self, x: (_ for _ in ()).throw(RuntimeError(\"broken\"))\n"),
    # no error for a bad num_tokens, and the cell's keep_mask is replaced by a wrong one
    "expert_capacity": (
        "    if num_tokens < 0:\n"
        "        raise ValueError(f\"num_tokens must be >= 0, not {num_tokens}\")\n",
        "    if num_tokens < 0:\n"
        "        global keep_mask\n"
        "        keep_mask = lambda experts, capacity: torch.zeros(experts.shape, dtype=torch.bool)\n"
        "        return 0\n"),
}
ALLOWED_EP_VIEW = ("        chosen, order = torch.sort(experts[tokens, choices], stable=True)\n",
                   "        chosen, order = torch.sort(experts.view(-1)[tokens * self.k + choices],"
                   " stable=True)\n")
ALLOWED_LOSE = {"ExpertParallelMoE_from_moe_attributes_and_value_error",
                "expert_capacity_fixed_cases_and_value_errors",
                # MoELayer runs after it in the sandbox's own process, with the submission's
                # keep_mask, which the bad-input handler replaced (confirmed by a grading of that
                # change alone); its public checks use the same keep_mask, the key's does not
                "MoELayer_against_the_answer_key"}


def write(tmp_path, name, *bugs):
    return planted_copy(SOURCE, tmp_path, name, *bugs)


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    assert_grades_full_marks_within(SOURCE, 300, offline_env)


@pytest.mark.slow
def test_without_the_key_the_reference_earns_every_public_point(offline_env):
    """The student's view: every public point (12), the 6 hidden ones reserved
    (conftest.assert_public_points_without_the_key; keep_mask is graded with
    expert_capacity)."""
    report = assert_public_points_without_the_key(SOURCE, offline_env)
    assert report["score"] == 12


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
    """Five bugs in five functions, in one grading run: each loses the points of the checks
    that judge what it breaks (the wrong fill order: keep_mask's two checks, not
    expert_capacity's values and errors), every other check keeps its own; the rank that gloo
    killed is named."""
    report = grade(write(tmp_path, "bugs", BUGS), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_lose_points(report, BUGS, all_of_them=False)
    assert_only_these_checks_fail(report, BUGS_LOSE)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    route = failed["route_fixed_cases_invariants_and_value_error"]
    assert "ties to the lower index" not in route and "weights" in route, failed
    assert "first choices in token order" in failed["keep_mask_fixed_cases_and_the_fill_order"]
    assert "aux" in failed["MoELayer_outputs_against_a_per_token_loop"], failed
    # against the key, y is wrong first: MoELayer runs with the submission's (broken) route
    # (confirmed by a grading of the route's bug alone: MoELayer's public checks pass there)
    assert "y (vs the answer key" in failed["MoELayer_against_the_answer_key"], failed
    assert "exchange the counts" in failed["ExpertParallelMoE_forward_against_a_per_token_loop"]
    # train_ep runs with the submission's (crashing) ExpertParallelMoE, and says so (confirmed by
    # a grading of that bug alone); its own bugs: test_train_ep_bugs_beside_a_correct_layer
    assert "exchange the counts" in failed["train_ep_state_matches_one_process_training"], failed


@pytest.mark.full
@pytest.mark.slow
def test_second_bugs_of_expert_parallelism_and_of_training(offline_env, tmp_path):
    """The combine without the routing weights (its values fail; from_moe's attributes and the
    collectives, right, keep their points); the dense gradients summed, not averaged."""
    report = grade(write(tmp_path, "second", SECOND_BUGS), "--only", ",".join(SECOND_BUGS),
                   "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert {r["function"] for r in report["results"]} == set(SECOND_BUGS)
    assert_only_these_checks_fail(report, SECOND_LOSE)
    assert points_by_function(report)["train_ep"] == 0
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "y (vs a per-token loop" in failed["ExpertParallelMoE_forward_against_a_per_token_loop"]
    assert "y (vs the answer key" in failed["ExpertParallelMoE_against_the_answer_key"]


@pytest.mark.full
@pytest.mark.slow
def test_train_ep_bugs_beside_a_correct_layer(offline_env, tmp_path):
    """train_ep's own two bugs (experts' gradients not divided by n, dense ones summed), with
    the reference's ExpertParallelMoE (train_ep runs with the submission's own): every check of
    train_ep fails, each naming train_ep."""
    bugs = [{"train_ep": BUGS["train_ep"]}, {"train_ep": SECOND_BUGS["train_ep"]}]
    report = grade(write(tmp_path, "train_ep", *bugs), "--only", "train_ep", "--speed", "skip",
                   env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, {c.name for c in SPEC.checks
                                           if c.function == "train_ep"})
    assert all(r["message"].startswith("train_ep ") for r in report["results"]), report["stdout"]


@pytest.mark.full
@pytest.mark.slow
def test_allowed_code_scores_full_and_bad_inputs_cost_only_their_points(offline_env, tmp_path):
    """Issue #32: a MoELayer and an ExpertParallelMoE that call ``experts.view(-1)`` on their
    route's experts score full (it returns a contiguous tensor); a from_moe that, given experts
    the group cannot split, raises nothing and breaks the class's forward loses only its
    from_moe/ValueError point (that case runs on processes of its own, after the values); an
    expert_capacity that, given a bad num_tokens, replaces the cell's keep_mask loses its
    values-and-errors point (the errors run after every value case of the cell), and MoELayer,
    graded after it with that keep_mask, its check against the key."""
    nb = write(tmp_path, "allowed", ALLOWED, {"ExpertParallelMoE": ALLOWED_EP_VIEW})
    report = grade(nb, "--only", ",".join(ALLOWED), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, ALLOWED_LOSE)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "should raise ValueError" in failed[
        "ExpertParallelMoE_from_moe_attributes_and_value_error"], failed
    assert "expert_capacity(-1, 4, 2, 1.0) should raise ValueError" in failed[
        "expert_capacity_fixed_cases_and_value_errors"], failed
