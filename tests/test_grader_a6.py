"""Assignment 6 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks.

Every grading run starts one 4-process run per function, so bugs that break different functions
are planted together. ``ring_attention`` runs with the submission's own ``merge_attention``, and
``train_cp`` with its own ring and Ulysses (as in the student's self-check), so a bug there can
cost their checks too; in these runs each of them has a bug of its own anyway. The second bug
of ``ring_attention`` and of ``train_cp`` gets a second run (``--only`` those two), a ring that
all-gathers K/V (right values, wrong communication) a third, a ring that sends to itself on one
rank (with a zig-zag training that keeps contiguous positions) a fourth, and a ring that keeps
every K/V block for backward a fifth. With the answer key (the instructor's repository) the planted bugs lose their public and hidden checks; without it
(the student's view) the reference earns every public point and the hidden check is reserved.
Without processes: public_cases.json is the key's public_cases(), and the public merge check's
tolerance holds correct merges written three ways with room to spare.

Tier: both: reference full marks (with and without the key), stub zero and the grader's parts
are quick (one grading each, or none); planted bugs are full.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_lose_points,
                      assert_public_points_without_the_key, assert_stubs_score_zero, grade,
                      planted_copy, points_by_function)

from autograder.assignments.a6_context_parallel import checks as C
from autograder.assignments.a6_context_parallel import expected as E
from autograder.assignments.a6_context_parallel import ranks as R
from autograder.assignments.a6_context_parallel.spec import SPEC
from autograder.keys import answer_key

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


# The dK/dV accumulators' last hop made on one rank too: a send to itself, which gloo refuses
# (the text: on one rank nothing is sent); n = 2, 3, 4 stay right
SELF_SEND_RING = {"ring_attention": (
    "            if n > 1:                               # the accumulator follows its K/V\n",
    "            if True:                                # the accumulator follows its K/V\n")}
# mode "ring_zigzag" shards the tokens zig-zag but gives the model contiguous positions
ZIGZAG_POSITIONS_TRAINING = {"train_cp": (
    "        ids, labels, positions = (zigzag_shard(t, -1, group) for t in (inputs, targets, "
    "positions))\n",
    "        ids, labels = (zigzag_shard(t, -1, group) for t in (inputs, targets))\n"
    "        positions = positions.chunk(n)[r]\n")}
# Right values and communication, but every K/V block that passes by in forward stays on ctx
# for backward: O(S) memory per rank
KEEPS_EVERY_BLOCK_RING = {"ring_attention": (
    "                k_blk, v_blk = _unpack(kv, k.shape, v.shape)\n"
    "                o, l = _attend(",
    "                ctx.__dict__.setdefault('blocks', []).append(kv)\n"
    "                k_blk, v_blk = _unpack(kv, k.shape, v.shape)\n"
    "                o, l = _attend(")}


def key():
    """The answer key (solutions/a6_context_parallel/answer_key.py): the instructor's repository
    has it."""
    module = answer_key("a6_context_parallel")
    assert module is not None, "the answer key is missing"
    return module


def write(tmp_path, name, *bugs):
    return planted_copy(SOURCE, tmp_path, name, *bugs)


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    assert_grades_full_marks_within(SOURCE, 300, offline_env)


@pytest.mark.slow
def test_without_the_key_the_reference_earns_every_public_point(offline_env):
    """The student's view (no answer key): every public point (15), the hidden merge check
    reserved (conftest.assert_public_points_without_the_key)."""
    report = assert_public_points_without_the_key(SOURCE, offline_env)
    assert report["score"] == 15
    assert {c.name for c in SPEC.checks if c.hidden} == {"merge_attention_hidden_cases"}


def test_public_cases_json_is_the_keys_public_cases():
    """The zig-zag layouts the grader uses are values written from the key, never drifting; they
    cover every (group size, sequence length) the checks shard."""
    path = REPO / "autograder" / "assignments" / "a6_context_parallel" / "public_cases.json"
    assert json.loads(path.read_text()) == key().public_cases()
    assert path.read_text() == key().public_cases_text()
    for _, members in R.GROUPS:
        n = len(members)
        sizes = {R.zigzag_shape(shape, n, 1 + c % 3)[dim] for c, (shape, dim) in
                 enumerate(R.ZIGZAG_CASES)} | {n * R.L}
        for size in sizes:
            held = [R.zigzag_positions(size, n, r) for r in range(n)]
            assert sorted(torch.cat(held).tolist()) == list(range(size)), (n, size)


def _merges():
    """Correct merges written three ways: the key's (logaddexp), a running-max one, a sigmoid
    one."""
    def running_max(out_a, lse_a, out_b, lse_b):
        top = torch.maximum(lse_a, lse_b)
        empty = torch.isneginf(top)
        top = torch.where(empty, torch.zeros_like(top), top)
        wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
        lse = torch.where(empty, -torch.inf, top + torch.log(wa + wb))
        total = torch.where(empty, 1.0, wa + wb)
        ca, cb = (wa / total)[..., None], (wb / total)[..., None]
        return torch.where(ca == 0, 0.0, ca * out_a) + torch.where(cb == 0, 0.0, cb * out_b), lse

    def sigmoid(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)
        gap = torch.nan_to_num(lse_a - lse_b, nan=0.0)
        dead_a, dead_b = torch.isneginf(lse_a), torch.isneginf(lse_b)
        wa = torch.where(dead_a, 0.0, torch.sigmoid(gap))[..., None]
        wb = torch.where(dead_b | (dead_a & dead_b), 0.0, torch.sigmoid(-gap))[..., None]
        wa = torch.where((dead_a & dead_b)[..., None], 0.0, wa)
        return torch.where(wa == 0, 0.0, wa * out_a) + torch.where(wb == 0, 0.0, wb * out_b), lse

    return {"key": key().merge, "running max": running_max, "sigmoid": sigmoid}


def test_merge_tolerance_holds_correct_merges_with_room_to_spare():
    """On the public cases (truth: attention over the concatenated keys) and the hidden ones
    (truth: the key in float64), float64 and float32, correct merges stray by under a quarter of
    the check's tolerance (measured: under 1/15 over 300 seeds), and a merge without the running
    maximum gives NaN near lse = +1000."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        for dtype in (torch.float64, torch.float32):
            for public, case in [(True, c) for c in E.merge_parts(g, dtype)] + \
                                [(False, c) for c in key().merge_cases(g, dtype)]:
                a_empty, b_empty = (case["inputs"][i] == -torch.inf for i in (1, 3))
                rows = ~(a_empty | b_empty)
                want_out, want_lse = (case["out"], case["lse"]) if public else \
                    key().merge(*[t.double() for t in case["inputs"]])
                tol = C._merge_tolerance(dtype, want_lse[rows], want_out[rows])
                for name, merge in _merges().items():
                    out, lse = merge(*case["inputs"])
                    assert out.dtype == dtype and not out.isnan().any(), (name, case["what"])
                    for got, want, part in ((out, want_out, "out"), (lse, want_lse, "lse")):
                        stray = (got[rows].double() - want[rows]).abs().max().item()
                        assert stray <= tol[part] / 4, (name, seed, dtype, case["what"], part)
    g = torch.Generator().manual_seed(0)
    out_a, lse_a, out_b, lse_b = E.merge_parts(g, torch.float64)[1]["inputs"]
    wa, wb = torch.exp(lse_a), torch.exp(lse_b)
    assert ((wa[..., None] * out_a + wb[..., None] * out_b) / (wa + wb)[..., None]).isnan().all()


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
    assert_only_these_lose_points(report, BUGS, all_of_them=False)
    points = points_by_function(report)
    assert all(points[f] == 0 for f in BUGS if f != "train_cp"), points
    # the unknown-mode check judges the ValueError, not the training (no gate on values)
    assert points["train_cp"] == 1, report["stdout"]
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "NaN" in failed["merge_attention_matches_attention_over_all_keys"], failed
    assert failed["merge_attention_hidden_cases"], failed
    assert "zigzag_shard (chunk r, then chunk 2n-1-r" in failed["zigzag_shard_and_unshard"]
    assert "train_cp(mode='ring')" in failed[
        "train_cp_ring_both_layouts_match_one_process_training"]


@pytest.mark.full
@pytest.mark.slow
def test_second_bugs_of_the_ring_and_of_training(offline_env, tmp_path):
    """dK/dV accumulators one hop short of home; gradients averaged instead of summed."""
    report = grade(write(tmp_path, "second", SECOND_BUGS), "--only", ",".join(SECOND_BUGS),
                   "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == set(SECOND_BUGS)
    assert points_by_function(report) == {"ring_attention": 0, "train_cp": 1}, report["stdout"]
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert set(failed) == {c.name for c in SPEC.checks if c.function in SECOND_BUGS} - {
        "train_cp_unknown_mode_raises_value_error"}, failed
    assert all(failed.values()), failed
    assert "the gradient of k" in failed["ring_attention_contiguous_outputs_and_gradients"]


@pytest.mark.full
@pytest.mark.slow
def test_a_ring_that_all_gathers_loses_the_communication_check(offline_env, tmp_path):
    """Right outputs and gradients from an all-gather of K/V: the value checks pass, the
    point-to-point check fails (and the memory check: autograd keeps the gathered K and V of the
    whole sequence for backward, and scores against the whole sequence)."""
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
    assert memory["status"] == "failed" and "for backward" in memory["message"], memory


@pytest.mark.full
@pytest.mark.slow
def test_one_rank_sends_nothing_and_zigzag_training(offline_env, tmp_path):
    """Issue #32 D: a ring whose gradient accumulators make their last hop on one rank too
    (right on n = 2, 3, 4) loses the ring's points with gloo's refusal, named by the group of 1,
    after the groups before it were judged; a zig-zag training with contiguous positions loses
    the ring-training point only."""
    report = grade(write(tmp_path, "self", SELF_SEND_RING, ZIGZAG_POSITIONS_TRAINING), "--only",
                   "ring_attention,train_cp", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert points_by_function(report) == {"ring_attention": 0, "train_cp": 2}, report["stdout"]
    status = {r["name"]: r for r in report["results"]}
    ring = status["ring_attention_contiguous_outputs_and_gradients"]
    assert ring["status"] == "failed" and "a group of 1 process" in ring["message"], ring
    training = status["train_cp_ring_both_layouts_match_one_process_training"]
    assert training["status"] == "failed" and "ring_zigzag" in training["message"], training


@pytest.mark.full
@pytest.mark.slow
def test_a_ring_that_keeps_every_block_loses_only_the_memory_check(offline_env, tmp_path):
    """Issue #32 spec gap 3: right values and communication, but the K/V blocks of the other
    ranks kept on ctx for backward (O(S) per rank): only the memory check fails."""
    report = grade(write(tmp_path, "keep", KEEPS_EVERY_BLOCK_RING), "--only", "ring_attention",
                   "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] != "passed"}
    assert list(failed) == ["ring_attention_memory_and_causal_skipping"], failed
    assert "for backward" in failed["ring_attention_memory_and_causal_skipping"], failed


def test_held_for_backward_counts_saved_and_ctx_tensors():
    """What the memory check counts, without processes: tensors saved for backward (custom
    Functions and autograd's ops), tensors kept on ctx (in lists too), a storage once."""
    q, k, v = (torch.randn(R.B, R.H, R.L, R.D, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    block, rows = q.numel(), R.B * R.H * R.L

    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, keep):
            out, lse = q * 2, q.sum(-1)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.kept = [torch.cat([k, v]) for _ in range(keep)]
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None, None

    def held(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = fn()
        return R.held_for_backward(out, saved)

    assert held(lambda: Saves.apply(q, k, v, 0)) == 4 * block + rows
    assert held(lambda: Saves.apply(q, k, v, 3)) == 10 * block + rows > C.HELD
    assert held(lambda: Saves.apply(q.transpose(1, 2), k, v, 0)) == 4 * block + rows
    assert held(lambda: torch.softmax(q @ k.transpose(-2, -1), -1) @ v) == \
        3 * block + R.B * R.H * R.L * R.L
