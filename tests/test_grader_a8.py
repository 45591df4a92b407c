"""Assignment 8 through the CLI: the reference scores full, the stubs zero, each planted bug loses
exactly the points of the function it breaks (with the answer key: its public and its hidden
checks), with a message that names what is wrong; without the key (the student's view) the
reference earns every public point and the hidden checks are reserved; and, without processes,
the grader's own parts: public_cases.json is the key's public_cases(), best_config's public and
hidden cases are decided by more than float rounding, and the grader trains the notebook's
model.

Bugs that break different functions are planted together: one grading run holds a bug in each
of the four functions (train_3d's: the mesh's dimensions in the wrong order), another the bugs
of issue #32 (step_time's bandwidth by ``size * stride <= node_size``, best_config without 1F1B
below pp micro-batches, train_3d's loss not averaged over dp): each loses exactly the checks
that judge what it breaks (a ValueError check keeps its point when only the values are wrong).
best_config runs with the submission's own per_rank_memory and step_time (as in the student's
self-check), so its own bugs' messages are checked beside a correct cost model, ``--only
best_config``, one grading each; so is step_time with issue #42's bandwidth rule, lesson 16's old
sentence (``tp <= node_size`` puts the tp groups inside a node), ``--only step_time``.
train_3d's other bugs (the gradients averaged over the world, losses returned on every stage,
micro-batch losses not scaled) are one grading each, ``--only train_3d`` (about 5 s each: the 8
processes start from the fork server in milliseconds). A pipeline that deadlocks (a gradient
never sent back) costs one launch timeout (60 s: gloo's receives wait for ever), fails
train_3d's four checks together, keeps the cost model's points and leaves no process behind.

Tier: both: reference full marks (with and without the key), stub zero and the grader's parts
are quick (one grading each, or none); planted bugs are full.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import time
import uuid
from fractions import Fraction

import pytest
import torch

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_checks_fail,
                      assert_public_points_without_the_key, assert_stubs_score_zero, grade,
                      planted_copy, points_by_function, processes_tagged)

from autograder.assignments.a8_composition import expected as E
from autograder.assignments.a8_composition import ranks as R
from autograder.assignments.a8_composition.spec import SPEC
from autograder.keys import answer_key

SOURCE = REPO / "solutions" / "a8_composition" / "composition.ipynb"
RELEASE = REPO / "assignments" / "a8_composition" / "composition.ipynb"
#: The budget of one grading of the reference on 2 cores with --speed skip (8 processes).
GRADING_SECONDS = 30

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # activations of one micro-batch only, whatever the schedule keeps in flight
    "per_rank_memory": ('        in_flight = m if sched == "gpipe" else min(pp - i, m)\n',
                        "        in_flight = 1\n"),
    # the bubble one stage too long
    "step_time": ("bubble=(pp - 1) * (c + tp_mb)", "bubble=pp * (c + tp_mb)"),
    # a configuration that needs exactly the memory there is does not fit
    "best_config": ('if memory <= hw_cfg["memory"]', 'if memory < hw_cfg["memory"]'),
    # the mesh's dimensions in the wrong order (the coordinates still (pp, dp, tp)'s)
    "train_3d": ('init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))',
                 'init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))'),
}
#: The checks each of BUGS fails (the others pass): a value bug keeps its ValueError point.
BUGS_FAIL = {
    "per_rank_memory_exact_bytes_on_public_cases",
    "per_rank_memory_exact_bytes_on_hidden_and_random_cases",
    "step_time_matches_the_cost_model_on_public_cases",
    "step_time_matches_the_cost_model_on_hidden_and_random_cases",
    "best_config_public_cases", "best_config_hidden_cases",
    "train_3d_state_on_pp2_dp2_tp2_8_ranks_matches_one_process",
    "train_3d_state_on_three_meshes_of_4_ranks_matches_one_process",
    "train_3d_losses_match_one_process", "train_3d_each_mode_on_its_own_group",
}
#: Issue #32's bugs, planted together: function -> (old, new, the checks it fails, text in each
#: failure).
ISSUE_BUGS = {
    # a group that spans no more ranks than a node is taken as inside one (tp = 3 on nodes of
    # 8: ranks 6, 7, 8 are on two)
    "step_time": ("""\
    for first in range(pp * dp * tp):          # a group's first rank, and its last
        if first // stride % size == 0 and first // node != (first + (size - 1) * stride) // node:
            return hw_cfg["inter_bw"]
    return hw_cfg["intra_bw"]""", """    if size * stride > node:
        return hw_cfg["inter_bw"]
    return hw_cfg["intra_bw"]""", {"step_time_matches_the_cost_model_on_public_cases",
                                   "step_time_matches_the_cost_model_on_hidden_and_random_cases"},
                  "'node_size': 8"),
    # torch's Schedule1F1B's limit taken for the cost model's: no 1F1B below pp micro-batches
    "best_config": ("                try:\n                    memory = max(",
                    "                if sched == \"1f1b\" and m < pp:\n"
                    "                    continue\n"
                    "                try:\n                    memory = max(",
                    {"best_config_public_cases", "best_config_hidden_cases"}, "with batch"),
    # the loss of this dp rank's rows only (the gradients still averaged: the weights right)
    "train_3d": ("            if dp > 1:\n                dist.all_reduce(total, group=dp_group)\n"
                 "            losses.append(total.item() / dp)\n",
                 "            losses.append(total.item())\n",
                 {"train_3d_losses_match_one_process"}, "the loss before update"),
}
#: train_3d's other bugs: (the bug(s), each applied in turn; the checks they fail; text each
#: failure must hold)
VALUE_CHECKS = {"train_3d_state_on_pp2_dp2_tp2_8_ranks_matches_one_process",
                "train_3d_state_on_three_meshes_of_4_ranks_matches_one_process",
                "train_3d_losses_match_one_process"}
TRAIN_BUGS = {
    "gradients averaged over the world": ([{"train_3d": (
        "            dist.all_reduce(flat, group=dp_group)\n            flat /= dp\n",
        "            dist.all_reduce(flat)\n            flat /= dist.get_world_size()\n")}],
        VALUE_CHECKS | {"train_3d_each_mode_on_its_own_group"}, "an ALLREDUCE on the world group"),
    "losses returned on every stage": ([
        {"train_3d": ("    losses = [] if last else None\n", "    losses = []\n")},
        {"train_3d": ("        if last:\n            if dp > 1:\n"
                      "                dist.all_reduce(total, group=dp_group)\n"
                      "            losses.append(total.item() / dp)\n",
                      "        if dp > 1:\n            dist.all_reduce(total, group=dp_group)\n"
                      "        losses.append(total.item() / dp)\n")}],
        {"train_3d_losses_match_one_process"}, "losses should be None on every stage but the last"),
    "micro-batch losses not scaled": ([{"train_3d": (
        "tgt.reshape(-1)) / micro_batches\n", "tgt.reshape(-1))\n")}], VALUE_CHECKS,
        None),
}


def key():
    """The answer key (solutions/a8_composition/answer_key.py): the instructor's repository
    has it."""
    module = answer_key("a8_composition")
    assert module is not None, "the answer key is missing"
    return module


def write(tmp_path, name, *bugs):
    return planted_copy(SOURCE, tmp_path, name, *bugs)


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    """A8 has no speed check: --speed skip grades every check there is."""
    assert_grades_full_marks_within(SOURCE, GRADING_SECONDS, offline_env)


@pytest.mark.full
@pytest.mark.slow
def test_a_long_tmpdir_changes_no_grade(offline_env, tmp_path):
    """Below a long TMPDIR (a cluster's scratch folder, and folder grading's job folders inside
    it) the fork server's Unix socket would pass the kernel's 107-byte limit: the sandbox's
    worker died loading the notebook and every rank-based check scored 0 (train_3d's 8 points
    here). Its ranks now start by exec there (course.launch.start_method)."""
    deep = tmp_path / ("t" * 70)
    deep.mkdir()
    report = grade(SOURCE, "--speed", "skip", env={**offline_env, "TMPDIR": str(deep)})
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == report["max_score"] == 17, report["stdout"]


@pytest.mark.slow
def test_without_the_key_the_reference_earns_every_public_point(offline_env):
    """The student's view: every public point (13), the cost model's hidden checks reserved
    (conftest.assert_public_points_without_the_key)."""
    report = assert_public_points_without_the_key(SOURCE, offline_env)
    assert report["score"] == 13
    assert {c.name for c in SPEC.checks if c.hidden} == {
        "per_rank_memory_exact_bytes_on_hidden_and_random_cases",
        "step_time_matches_the_cost_model_on_hidden_and_random_cases",
        "best_config_hidden_cases"}


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, "--speed", "skip", env=offline_env)
    assert_stubs_score_zero(report)


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """Four bugs in four functions, in one grading run (with the key): each loses all of its
    function's points, public and hidden, every other function keeps all of its own, and each
    failure says what is wrong."""
    report = grade(write(tmp_path, "bugs", BUGS), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, BUGS_FAIL)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    for where in ("public", "hidden_and_random"):
        assert "['activations']" in failed[f"per_rank_memory_exact_bytes_on_{where}_cases"], \
            failed
        message = failed[f"step_time_matches_the_cost_model_on_{where}_cases"]
        assert "Where it starts: ['bubble'] ((pp - 1) * (c + t_tp) itself)" in message, failed
    for where in ("public", "hidden"):  # it runs with the (broken) per_rank_memory and
        # step_time of the submission, which also fail both cases alone (confirmed by a grading);
        # its own bug's message: test_best_config_bugs_beside_a_correct_cost_model
        assert "your own per_rank_memory and step_time" in failed[f"best_config_{where}_cases"]
    for name in ("state_on_pp2_dp2_tp2_8_ranks_matches_one_process", "each_mode_on_its_own_group"):
        assert "made a SEND with rank" in failed[f"train_3d_{name}"], failed  # not its neighbour


@pytest.mark.full
@pytest.mark.slow
def test_issue_32_bugs_lose_exactly_the_checks_that_judge_them(offline_env, tmp_path):
    """Issue #32, in one grading run (with the key): step_time with the bandwidth rule
    ``size * stride <= node_size`` (wrong for groups that straddle a node) loses its public and
    hidden value checks and keeps its ValueError point; best_config that leaves out 1F1B below
    pp micro-batches (torch's Schedule1F1B's limit) loses its public and hidden cases; train_3d
    whose loss is not averaged over dp (the weights right) loses only the losses check's 2
    points. per_rank_memory keeps everything."""
    bugs = {f: (old, new) for f, (old, new, _, _) in ISSUE_BUGS.items()}
    report = grade(write(tmp_path, "issue_32", bugs), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, set().union(*(fails for _, _, fails, _ in ISSUE_BUGS.values())))
    assert points_by_function(report) == {"per_rank_memory": 3, "step_time": 1,
                                          "best_config": 0, "train_3d": 6}, report["stdout"]
    messages = {r["name"]: r["message"] for r in report["results"]}
    for function, (_, _, fails, text) in ISSUE_BUGS.items():
        if function == "best_config":  # it runs with the submission's (broken) step_time, which
            continue  # fails its public cases alone; its own: test_best_config_bugs_beside_...
        for name in fails:
            assert text in messages[name], (name, messages[name])


#: best_config's own bugs (BUGS' and issue #32's), each graded beside a correct cost model (it
#: runs with the submission's own per_rank_memory and step_time): the text its failures hold
BEST_CONFIG_BUGS = {"exact fit": (BUGS["best_config"], "the best needs exactly that"),
                    "no 1f1b below pp": (ISSUE_BUGS["best_config"][:2], "with batch")}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BEST_CONFIG_BUGS))
def test_best_config_bugs_beside_a_correct_cost_model(bug, offline_env, tmp_path):
    planted, text = BEST_CONFIG_BUGS[bug]
    report = grade(write(tmp_path, bug.replace(" ", "_"), {"best_config": planted}), "--only",
                   "best_config", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, {"best_config_public_cases", "best_config_hidden_cases"})
    for r in report["results"]:
        assert text in r["message"], r


#: Issue #42: lesson 16 said "with 8 GPUs per node and tp <= 8 [a tp group] lies inside one node";
#: a step_time that follows it (the dp and pp groups judged right) takes tp = 3 on nodes of 8 for
#: intra_bw, where the tp group of ranks 6, 7, 8 spans two nodes
OLD_TP_RULE = {"step_time": ('''\
    node = hw_cfg["node_size"]
''', '''\
    node = hw_cfg["node_size"]
    if mode == "tp":
        return hw_cfg["intra_bw"] if tp <= node else hw_cfg["inter_bw"]
''')}


@pytest.mark.full
@pytest.mark.slow
def test_step_time_with_lesson_16s_old_tp_rule_loses_its_value_checks(offline_env, tmp_path):
    """The old rule loses step_time's public and hidden value checks (a public case and hidden
    ones have tp = 3 or 6 on nodes of 8), keeps its ValueError point, and each failure names
    ['tp'] as where the difference starts, not the bubble (the first key of the dict that
    differs); the public one also says which bandwidth its value points to, the hidden one shows
    no expected value."""
    report = grade(write(tmp_path, "old_tp_rule", OLD_TP_RULE), "--only", "step_time",
                   env=offline_env)
    print(report["stdout"])
    fails = {"step_time_matches_the_cost_model_on_public_cases",
             "step_time_matches_the_cost_model_on_hidden_and_random_cases"}
    assert_only_these_checks_fail(report, fails)
    messages = {r["name"]: r["message"] for r in report["results"]}
    for name in fails:
        assert "Where it starts: ['tp'] (m * t_tp: the number of all-reduces, their bytes, or " \
               "bw_tp); ['bubble'] and ['total'] include it" in messages[name], messages[name]
    public = messages["step_time_matches_the_cost_model_on_public_cases"]
    assert "'node_size': 8" in public and "; expected " in public, public
    assert "['tp'] is the expected value times inter_bw / intra_bw: it took intra_bw where the " \
           "rule gives inter_bw (bw_tp is intra_bw only if every tp group has all of its ranks " \
           "on one node" in public, public
    hidden = messages["step_time_matches_the_cost_model_on_hidden_and_random_cases"]
    assert "expected" not in hidden.replace("the expected values of hidden cases are not shown",
                                            ""), hidden


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("bug", list(TRAIN_BUGS))
def test_train_3d_bugs_lose_the_checks_that_judge_them_and_are_named(bug, offline_env,
                                                                   tmp_path):
    """Each bug fails the checks that judge what it breaks, named in each failure; train_3d's
    other checks pass (the losses not scaled by 1/micro_batches: wrong weights and losses,
    right groups)."""
    bugs, fails, named = TRAIN_BUGS[bug]
    report = grade(write(tmp_path, bug, *bugs), "--only", "train_3d", "--speed", "skip",
                   env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, fails)
    for r in report["results"]:
        assert r["name"] not in fails or named is None or named in r["message"], r
    if bug == "micro-batch losses not scaled":
        message = next(r["message"] for r in report["results"]
                       if r["name"] == "train_3d_losses_match_one_process")
        assert "is each micro-batch's loss scaled by 1/micro_batches?" in message, message


#: stage 1 never sends the gradient of its input back: stage 0 waits in recv for ever
DEADLOCK = {"train_3d": ("dist.send(x.grad.contiguous(), group=pp_group, group_dst=p - 1)",
                         "pass  # the gradient never goes back")}


@pytest.mark.full
@pytest.mark.slow
def test_a_pipeline_deadlock_fails_train_3d_at_once_and_the_rest_is_graded(offline_env,
                                                                            tmp_path):
    """gloo's recv waits without a timeout: the launch's own timeout stops the 8 ranks, all of
    train_3d's checks fail with it (one wait, not four), the cost model keeps its 9 points, and
    no process is left behind."""
    tag = uuid.uuid4().hex
    start = time.monotonic()
    report = grade(write(tmp_path, "deadlock", DEADLOCK), "--speed", "skip",
                   env={**offline_env, "AUTOGRADER_RUN_TAG": tag}, timeout=300)
    seconds = time.monotonic() - start
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert points_by_function(report) == {"per_rank_memory": 3, "step_time": 3,
                                          "best_config": 3, "train_3d": 0}, report["stdout"]
    failed = [r for r in report["results"] if r["function"] == "train_3d"]
    assert len(failed) == 4 and all(r["status"] == "failed" and r["message"] for r in failed)
    assert seconds < 150, f"grading took {seconds:.0f} s"
    time.sleep(0.5)
    left = processes_tagged(tag)
    assert not left, f"processes left behind: {left}"


# ---------------------------------------------------------------------------- the grader's parts

def test_public_cases_json_is_the_keys_and_holds_no_hidden_case():
    """public_cases.json is what the key's public_cases() gives (write it again with ``python
    solutions/a8_composition/answer_key.py``), as the checks read it; none of its cases is a
    hidden one, and each function has some."""
    K = key()
    assert json.loads(E.PUBLIC_CASES_PATH.read_text()) == K.public_cases() == E.public_cases()
    assert E.PUBLIC_CASES_PATH.read_text() == K.public_cases_text()
    hidden_cost = [(m, p) for m, p, _ in K.HIDDEN_COST_CASES]
    hidden_best = [(m, hw, world) for _, m, hw, world in K.hidden_best_cases()]
    cases = E.public_cases()
    for name in ("per_rank_memory", "step_time"):
        assert len(cases[name]) >= 5
        for case in cases[name]:
            assert (case["model_cfg"], case["par_cfg"]) not in hidden_cost, case
    assert len(cases["best_config"]) >= 5
    for case in cases["best_config"]:
        assert (case["model_cfg"], case["hw_cfg"], case["world_size"]) not in hidden_best, case


def _decided_by_more_than_rounding(cases) -> set[str]:
    """Every case's fitting configurations are tied with the best or at least 1e-6 (relative)
    slower; what the answers use (for coverage)."""
    K, seen = key(), set()
    for label, model, hw, world in cases:
        fits = K.fitting(model, hw, world)
        if not fits:
            assert K.best_config(model, hw, world) is None
            seen.add("nothing fits")
            continue
        best = min(t for t, _, _ in fits)
        close = [(float((t - best) / best), par) for t, _, par in fits
                 if t != best and t - best < Fraction(1, 10**6) * best]
        assert not close, (label, close[:3])
        answer = K.best_config(model, hw, world)
        memory = max(K.per_rank_memory(model, answer)["total"])
        seen |= {k for k, ok in (("m < pp", answer["micro_batches"] < answer["pp"]),
                                 ("zero 3", answer["zero"] == 3), ("checkpoint",
                 answer["checkpoint"]), ("pp", answer["pp"] > 1), ("tp", answer["tp"] > 1),
                 ("exact limit", memory == hw["memory"]),
                 ("binds", K.best_config(model, dict(hw, memory=1 << 62), world) != answer))
                 if ok}
        seen |= {f"world {world}", f"node {hw['node_size']}"}
    return seen


def test_best_config_cases_are_decided_by_more_than_rounding():
    """In exact arithmetic every fitting configuration's time equals the best's or is at least
    1e-6 (relative) above it: float code in any summation order (within ~1e-15 of exact) and
    math.isclose(rel_tol=1e-9) tie exactly the configurations the grader ties. And the cases
    ask for what the text teaches: binding memory limits (ZeRO-3, checkpointing, pipelining
    and tensor parallelism in the answers), a limit the best meets exactly, one where nothing
    fits, a best with fewer micro-batches than stages (1F1B: issue #32), world sizes 8, 16 and
    64 on nodes of 2, 4 and 8 (the hidden ones); the public ones too, as far as their smaller
    worlds allow."""
    seen = _decided_by_more_than_rounding(key().hidden_best_cases())
    assert seen >= {"m < pp", "nothing fits", "zero 3", "checkpoint", "pp", "tp", "exact limit",
                    "binds",
                    "world 8", "world 16", "world 64", "node 2", "node 4", "node 8"}, seen
    public = [(c["what"], c["model_cfg"], c["hw_cfg"], c["world_size"])
              for c in E.public_cases()["best_config"]]
    seen = _decided_by_more_than_rounding(public)
    assert seen >= {"m < pp", "nothing fits", "zero 3", "checkpoint", "pp", "tp", "exact limit",
                    "binds"}, seen


def _without_1f1b_below_pp(K, model, hw, world):
    """best_config as torch's Schedule1F1B would have it: no 1F1B with fewer micro-batches than
    stages (issue #32's bug)."""
    fits = [f for f in K.fitting(model, hw, world)
            if not (f[2]["schedule"] == "1f1b" and f[2]["micro_batches"] < f[2]["pp"])]
    if not fits:
        return None
    best = min(t for t, _, _ in fits)
    return min((K.tie_key(memory, par), par) for t, memory, par in fits if t == best)[1]


def test_best_config_cases_need_1f1b_below_pp_micro_batches():
    """Issue #32: a best_config that leaves out 1F1B when micro_batches < pp (the limit of
    torch's Schedule1F1B class, not of the cost model) answers otherwise in hidden cases and
    in public ones (the tiny model with batch 1 on 4 GPUs of 2 per node: (dp, tp, pp, m) =
    (1, 2, 2, 1) with 1F1B), some where only the schedule differs and some where GPipe's
    memory does not fit and another mesh wins."""
    K = key()
    public = [(c["what"], c["model_cfg"], c["hw_cfg"], c["world_size"])
              for c in E.public_cases()["best_config"]]
    for cases, least in ((K.hidden_best_cases(), 4), (public, 2)):
        differ = [(what, K.best_config(m, hw, w), _without_1f1b_below_pp(K, m, hw, w))
                  for what, m, hw, w in cases]
        differ = [(what, a, b) for what, a, b in differ if a != b]
        assert len(differ) >= least, differ
        assert all(a["schedule"] == "1f1b" and a["micro_batches"] < a["pp"]
                   for _, a, _ in differ), differ
        assert any(b and (b["dp"], b["pp"]) != (a["dp"], a["pp"]) for _, a, b in differ)
    issue = next(a for what, m, hw, w in K.hidden_best_cases()
                 if what.startswith("tiny model with batch 1 on 4 GPUs")
                 for a in [K.best_config(m, hw, w)])
    assert [issue[k] for k in ("dp", "tp", "pp", "micro_batches", "schedule")] == \
        [1, 2, 2, 1, "1f1b"]


def _span_rule(hw, par, mode):
    """Issue #32's bug: a group of size ranks stride apart is inside a node when size * stride
    <= node_size (wrong for groups that straddle a node's edge)."""
    stride = {"tp": 1, "dp": par["tp"], "pp": par["dp"] * par["tp"]}[mode]
    return Fraction(hw["intra_bw"] if par[mode] * stride <= hw["node_size"] else hw["inter_bw"])


def test_bandwidth_is_intra_node_only_when_every_group_is_on_one_node(monkeypatch):
    """Issue #32: with tp = 3 on nodes of 8 the tp group of ranks 6, 7, 8 spans two nodes, so
    tp's bandwidth is inter_bw although 3 <= 8. The key says so; the span rule changes
    step_time's value on a public case (tp and dp groups that straddle), on hidden fixed cases
    (tp, and dp) and on at least one random case of every seed."""
    K = key()
    hw = dict(E.H100, intra_bw=9.0, inter_bw=1.0)
    assert K.groups(E.par(3, 3, 1, 1), "tp")[2] == [6, 7, 8]
    assert not K.one_node(hw, E.par(3, 3, 1, 1), "tp")
    assert K.one_node(hw, E.par(2, 3, 1, 1), "tp") and K.one_node(hw, E.par(1, 2, 4, 1), "pp")
    assert not K.one_node(hw, E.par(2, 3, 2, 1), "dp")      # stage 1's ranks 6, 9
    public = [(c["model_cfg"], c["par_cfg"], c["hw_cfg"], c["expected"])
              for c in E.public_cases()["step_time"]]
    hidden = list(K.HIDDEN_COST_CASES)
    seeds = [K.time_cases(torch.Generator().manual_seed(seed))[len(hidden):]
             for seed in range(20)]
    assert all(any(K.straddles(hw, p) for _, p, hw in cases) for cases in seeds)
    right = [K.step_time(m, p, hw)["total"] for m, p, hw in hidden]
    monkeypatch.setattr(K, "_bandwidth", _span_rule)
    wrong = [(p, hw) for m, p, hw, want in public
             if float(K.step_time(m, p, hw)["total"]) != want["total"]]
    assert any(set(K.straddles(hw, p)) >= {"tp", "dp"} for p, hw in wrong), wrong
    assert {mode for m, p, hw in hidden for mode in K.straddles(hw, p)} >= {"tp", "dp"}
    assert sum(K.step_time(m, p, hw)["total"] != t
               for (m, p, hw), t in zip(hidden, right)) >= 3


def test_the_graders_model_is_the_notebooks():
    """ranks.py trains (and expected.py's truth uses) a copy of the release's set-up cell's
    TinyGPT: the same classes, statement for statement."""
    from autograder.notebook import runnable_cells

    ((_, setup),) = runnable_cells(RELEASE, ["setup"])
    theirs = {n.name: ast.dump(n) for n in ast.parse(setup).body if isinstance(n, ast.ClassDef)}
    ours = {n.name: ast.dump(n) for n in ast.parse(inspect.getsource(R)).body
            if isinstance(n, ast.ClassDef) and n.name in R.GRADER_CLASSES}
    assert set(R.GRADER_CLASSES) <= set(theirs)
    for name in R.GRADER_CLASSES:
        assert ours[name] == theirs[name], f"ranks.py's {name} differs from the notebook's"


def test_collectives_may_go_on_the_pp_group_but_not_the_world():
    """torch 2.15's pipelining all-reduces on the pp group while a schedule sets up (an
    independent solution on Schedule1F1B lost train_3d_each_mode_on_its_own_group there): the pp
    group is the rank's own, like tp and dp; the world group and a foreign group stay wrong."""
    from autograder.assignments.a8_composition import ranks as a8_ranks

    dims, r = (2, 2, 2), 0  # rank 0: tp [0, 1], dp [0, 2], pp [0, 4]
    call = lambda ranks: (ranks, "ALLREDUCE", None, [], [])  # noqa: E731
    assert a8_ranks.violations(dims, r, [call((0, 4)), call((0, 1)), call((0, 2))]) == []
    assert a8_ranks.violations(dims, r, [call(tuple(range(8)))])
    assert a8_ranks.violations(dims, r, [call((0, 3))])


def _old_tp_rule(right):
    """Lesson 16's old sentence as a bandwidth rule (issue #42): a tp group of at most
    node_size ranks is inside a node; dp and pp by ``right``, the key's own rule."""
    def bandwidth(hw, par, mode):
        if mode == "tp":
            return Fraction(hw["intra_bw"] if par["tp"] <= hw["node_size"] else hw["inter_bw"])
        return right(hw, par, mode)
    return bandwidth


def _examples(source: str) -> tuple[list[dict], list[dict]]:
    """The inputs a text cell states (``model_cfg = dict(...)`` and the like, in order) and the
    values it prints (its code blocks)."""
    flat = re.sub(r"\s+", " ", source)
    inputs = [eval(expr, {"__builtins__": {}, "dict": dict})  # noqa: S307 (our own text)
              for expr in re.findall(r"(?:model|par|hw)_cfg = (dict\([^)]*\))", flat)]
    values = [ast.literal_eval(block) for block in re.findall(r"```\n(\{.*?\})\n```", source,
                                                              flags=re.S)]
    return inputs, values


def test_the_texts_examples_are_the_keys_and_the_second_tells_the_rules_apart(monkeypatch):
    """Issue #42: the values the released text prints for the examples of Parts 1 and 2 are the
    answer key's for the inputs it states (Part 2's first: Part 1's configuration on nodes of 4;
    its second: tp = 3 on 12 ranks on nodes of 8). Under lesson 16's old tp rule the first has the
    same values and the second does not, by exactly what the text says ('tp' and 'bubble')."""
    import nbformat

    cells = {c.get("id"): c.source for c in nbformat.read(RELEASE, as_version=4).cells}
    (model, cfg), (memory,) = _examples(cells["a8-03"])
    (hw, *straddle), times = _examples(cells["a8-06"])
    cases = [(model, cfg, hw), tuple(straddle)]
    assert [model, cfg, hw] == [E.TINY, E.par(2, 2, 2, 2, 1), dict(
        flops=1e9, memory=10**6, node_size=4, intra_bw=1e9, inter_bw=1e8)]
    assert straddle[1]["tp"] == 3 and straddle[2]["node_size"] == 8 and len(times) == 2
    K = key()
    assert memory == K.per_rank_memory(model, cfg)
    right = [{k: float(v) for k, v in K.step_time(*case).items()} for case in cases]
    assert times == right
    monkeypatch.setattr(K, "_bandwidth", _old_tp_rule(K._bandwidth))
    old = [{k: float(v) for k, v in K.step_time(*case).items()} for case in cases]
    assert old[0] == right[0]
    assert {k for k in right[1] if old[1][k] != right[1][k]} == {"tp", "bubble", "total"}
    said = re.sub(r"\s+", " ", cells["a8-06"])
    assert f"`'tp'` would be {old[1]['tp']!r} and `'bubble'` {old[1]['bubble']!r}" in said


def test_lesson_16s_old_tp_rule_changes_a_public_case_and_hidden_ones(monkeypatch):
    """Issue #42: the planted bug OLD_TP_RULE can fail both of step_time's value checks: its rule
    changes step_time on a public case (tp = 3 on nodes of 8) and on hidden fixed cases (tp = 3
    and 6 on nodes of 8), and on no best_config case, so only those two checks judge it."""
    K = key()
    public = [(c["model_cfg"], c["par_cfg"], c["hw_cfg"]) for c in E.public_cases()["step_time"]]
    best = K.PUBLIC_BEST_CASES + K.hidden_best_cases()
    before = {"public": [K.step_time(*case) for case in public],
              "hidden": [K.step_time(*case) for case in K.HIDDEN_COST_CASES],
              "best": [K.best_config(m, hw, w) for _, m, hw, w in best]}
    monkeypatch.setattr(K, "_bandwidth", _old_tp_rule(K._bandwidth))
    public_tp = [case[1]["tp"] for case, t in zip(public, before["public"])
                 if K.step_time(*case) != t]
    hidden_tp = [case[1]["tp"] for case, t in zip(K.HIDDEN_COST_CASES, before["hidden"])
                 if K.step_time(*case) != t]
    assert public_tp == [3] and sorted(hidden_tp) == [3, 6], (public_tp, hidden_tp)
    assert [K.best_config(m, hw, w) for _, m, hw, w in best] == before["best"]
