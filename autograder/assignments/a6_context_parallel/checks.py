"""Checks for Assignment 6: context parallelism.

Graded: ``merge_attention`` (in the sandbox's process), ``zigzag_shard``/``zigzag_unshard``,
``ring_attention``, ``ulysses_attention`` and ``train_cp`` (their contracts are in the
notebook). ``merge_attention`` is judged publicly against softmax attention over the
concatenated keys of its two parts (torch's own ops, float64) and, with the instructor's answer
key, on hidden cases against the key's merge. Each of the last four runs once on 4 processes,
where every rank tries it on each group of :data:`.ranks.GROUPS` it belongs to (n = 4, 3
without global rank 0, 2, 1); all of the function's checks judge that one run
(:func:`_run_of`). The grader computes the truth itself (:mod:`.expected`): full attention on
the whole float64 sequence with its gradients, one process training on the whole sequence; the
zig-zag layouts are values (``public_cases.json``). Communication, matmuls and what the ring's
autograd graph keeps for backward are counted by the ranks' harness, and judged only for right
results; a group where the function raised fails with its error, by group (:func:`_each`).
``train_cp``'s unknown-mode check judges the ValueError alone. ``ring_attention`` and
``train_cp`` run with the student's own versions of the functions they call (as in the
student's self-check). Points: spec.py.
"""
from __future__ import annotations

import math
import re

import torch

from autograder.checking.expect import (assert_close, float32_tolerance_of_all,
                                        fresh_generator, sequence, shared_rank_replies, tensor)
from autograder.keys import answer_key

from . import expected as E
from . import ranks as R
from .probes import probe_merge, probe_ranks
from .spec import SPEC

graded = SPEC.graded
EPS = torch.finfo(torch.float64).eps
#: float64 against float64 where only the order of the additions differs (training)
TIGHT = dict(rtol=1e-10, atol=1e-12)
INF = float("inf")


def _tol64(reference: torch.Tensor) -> dict:
    """Float64 rounding of a result of this size: a few thousand ulps of its largest entry."""
    finite = reference[torch.isfinite(reference)]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    return dict(rtol=0, atol=4096 * EPS * max(1.0, scale))


def _run_of(student, name, *extra):
    """``(seed, replies)``: the 4 ranks' replies of ``name``'s one run, shared by its checks."""
    return shared_rank_replies(student, name, R.WORLD, probe_ranks,
                               lambda seed: (name, seed, *extra))


#: what a rank that waited on a crashed peer reports (not the cause)
LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|[Tt]imed out|timeout")


def _each(who, replies, keys, groups=None):
    """``(group index, n, r, where, key, case)`` for every group, rank in it and case key; a
    group where ``who`` raised fails with that rank's error (a waiting peer's only if no rank
    has another), the groups before it judged first."""
    for i, (label, members) in enumerate(R.GROUPS):
        if groups is not None and i not in groups:
            continue
        crashes = [(r, g, replies[g][(i, "crash")]) for r, g in enumerate(members)
                   if (i, "crash") in replies[g]]
        if crashes:
            r, g, error = min(crashes, key=lambda c: bool(LOST_PEER.search(c[2])))
            hint = " (on one rank nothing is sent: gloo cannot send to oneself)" \
                if len(members) == 1 and "not connected" in error else ""
            raise AssertionError(f"{who} on {label}, group rank {r} (global rank {g}) raised "
                                 f"{error}{hint}")
        for r, g in enumerate(members):
            where = f"on {label}, group rank {r} (global rank {g})"
            for key in keys:
                case = replies[g].get((i, key))
                assert isinstance(case, dict), "the ranks' reply was tampered with"
                yield i, len(members), r, where, key, case


def _close(desc, want, what, seed, **tol):
    assert_close(tensor(desc, what)["value"], want, what, seed=seed, **(tol or _tol64(want)))


# ---------------------------------------------------------------------------- merge_attention

def _merge_results(student, label, make_cases):
    """``(seed, cases, replies)``: ``merge_attention`` on the cases ``make_cases(g, dtype)``
    makes from a fresh generator, float64 then float32, in one sandbox call (cached per label)."""
    def run():
        g, seed = fresh_generator()
        cases = [case for dtype in (torch.float64, torch.float32) for case in make_cases(g, dtype)]
        return seed, cases, student.call(probe_merge, cases)
    seed, cases, replies = student.shared(f"merge {label}", run)
    assert isinstance(replies, list) and len(replies) == len(cases), "the reply was tampered with"
    return seed, cases, replies


def _merge_tolerance(dtype, lse, out) -> dict:
    """16 roundings of ``dtype`` of max(1, |lse|), and of max(1, |lse|) * max(1, |out|) for
    out (over the rows with keys): a merge turns an absolute rounding of an lse (relative to
    |lse|; float32 inputs are rounded values) into a relative error of its weights, so that
    bounds what correct code strays by (measured: under 1/15 of it over 300 seeds)."""
    eps = torch.finfo(dtype).eps
    scale = max(1.0, lse.abs().max().item()) if lse.numel() else 1.0
    span = max(1.0, out.abs().max().item()) if out.numel() else 1.0
    return {"lse": 16 * eps * scale, "out": 16 * eps * scale * span}


def _judge_merge(student, label, make_cases, truth_of):
    """Every case of one merge run: dtypes, shapes, no NaN, inputs unchanged, the rows masked in
    one part or both exactly (the contract), the others against ``truth_of(case)``."""
    seed, cases, replies = _merge_results(student, label, make_cases)
    for case, reply in zip(cases, replies):
        dtype = case["inputs"][0].dtype
        what = f"merge_attention({str(dtype).removeprefix('torch.')}, {case['what']})"
        assert reply["unchanged"] is True, f"{what} modified its inputs in place"
        out_desc, lse_desc = sequence(reply["result"], f"{what}'s result", 2)
        out = tensor(out_desc, f"{what}'s out")["value"]
        lse = tensor(lse_desc, f"{what}'s lse")["value"]
        for got, want, name in ((out, case["inputs"][0], "out"), (lse, case["inputs"][1], "lse")):
            assert got.shape == want.shape and got.dtype == dtype, (
                f"{what}: {name} has shape {tuple(got.shape)} and dtype {got.dtype}, expected "
                f"{tuple(want.shape)} and {dtype} (inputs from seed {seed})")
            assert not got.isnan().any(), f"{what}: {name} holds NaN (inputs from seed {seed})"
        a_empty, b_empty = (case["inputs"][i] == -INF for i in (1, 3))
        for rows, part, name in ((b_empty & ~a_empty, 0, "B"), (a_empty & ~b_empty, 2, "A")):
            for got, want, label_ in ((out[rows], case["inputs"][part][rows], "out"),
                                      (lse[rows], case["inputs"][part + 1][rows], "lse")):
                assert torch.equal(got, want), (
                    f"{what}: in the rows masked in part {name} only, {label_} should equal the "
                    f"other part's exactly (inputs from seed {seed})")
        both = a_empty & b_empty
        assert (out[both] == 0).all() and (lse[both] == -INF).all(), (
            f"{what}: rows masked in both parts should give out = 0 and lse = -inf")
        rows = ~(a_empty | b_empty)
        want_out, want_lse, against = truth_of(case)
        tol = _merge_tolerance(dtype, want_lse[rows], want_out[rows])
        for got, want, name in ((lse, want_lse, "lse"), (out, want_out, "out")):
            assert_close(got[rows].double(), want[rows], f"{what}: {name} (rows with keys in "
                         f"either part) {against}", rtol=0, atol=tol[name], seed=seed)


@graded
def test_merge_attention_matches_attention_over_all_keys(student):
    _judge_merge(student, "public", E.merge_parts, lambda case: (
        case["out"], case["lse"], "vs softmax attention and logsumexp over the concatenated "
        "keys, float64"))


@graded
def test_merge_attention_hidden_cases(student):
    key = answer_key(SPEC.assignment)
    assert key is not None, "the answer key is needed (the harness skips this check without it)"
    _judge_merge(student, "hidden", key.merge_cases, lambda case: (
        *key.merge(*[t.double() for t in case["inputs"]]), "vs the answer key in float64"))


# ---------------------------------------------------------------------------- zig-zag

@graded
def test_zigzag_shard_and_unshard(student):
    seed, replies = _run_of(student, "zigzag_shard")
    for i, n, r, where, c, case in _each("zigzag_shard/zigzag_unshard", replies,
                                         range(len(R.ZIGZAG_CASES))):
        shape, dim = R.ZIGZAG_CASES[c]
        x = R.randn(seed + 10 * c + n, *R.zigzag_shape(shape, n, 1 + c % 3))
        mine = R.take(x, dim, n, r, "zigzag")
        upstream = R.randn(seed + 5 + 10 * c, *mine.shape)
        what = f"{where}, x of shape {tuple(x.shape)}, dim={dim}"
        exact = dict(rtol=0, atol=0)
        assert "shard_error" not in case, f"{what}: zigzag_shard raised {case['shard_error']}"
        assert case["shard_traffic"] == [], (
            f"{what}: zigzag_shard communicated ({case['shard_traffic']}); it needs none")
        _close(case["shard"], mine, f"{what}: zigzag_shard (chunk r, then chunk 2n-1-r, of "
               "2n equal chunks along dim)", seed, **exact)
        assert case["shard_unchanged"], f"{what}: zigzag_shard modified x in place"
        grad = torch.zeros_like(x).index_copy(dim % x.dim(), R.zigzag_positions(
            x.size(dim), n, r), upstream)
        assert case["shard_grad"].get("kind") == "tensor", (
            f"{what}: x got no gradient through zigzag_shard (plain indexing and cat are "
            "differentiable)")
        _close(case["shard_grad"], grad, f"{what}: the gradient of x through zigzag_shard",
               seed, **exact)
        assert "unshard_error" not in case, \
            f"{what}: zigzag_unshard raised {case['unshard_error']}"
        _close(case["unshard"], x, f"{what}: zigzag_unshard of this rank's shard (the whole "
               "tensor, on every rank)", seed, **exact)
        _close(case["round_trip"], mine, f"{what}: zigzag_shard(zigzag_unshard(shard))",
               seed, **exact)
    for i, n, r, where, _, case in _each("zigzag_shard/zigzag_unshard", replies, ["bad"]):
        for name, size in (("zigzag_shard", f"x.size(1) = {2 * n + 1}"),
                           ("zigzag_unshard", "x_local.size(1) = 3")):
            assert case[name.removeprefix("zigzag_")].startswith("ValueError"), (
                f"{where}: {name} with {size} (dim=1) should raise ValueError; got "
                f"{case[name.removeprefix('zigzag_')]}")


# ---------------------------------------------------------------------------- attention

def _judge_attention(case, truth, n, r, layout, what, seed):
    """One rank's output and gradients against its shard of the whole-sequence truth."""
    ref64, ref32 = truth
    wanted = [R.take(t, 2, n, r, layout) for t in ref64]
    if ref32 is None:
        tols = [_tol64(t) for t in wanted]
    else:
        tol = float32_tolerance_of_all(ref64, ref32)
        tols = [dict(rtol=0, atol=tol)] * 4
        wanted = [t.float() for t in wanted]
    assert case["unchanged"] is True, f"{what}: q, k or v was modified in place"
    _close(case["out"], wanted[0], f"{what}: the output (vs full attention on the whole "
           "sequence)", seed, **tols[0])
    assert case["backward_ran"], (f"{what}: the output does not require grad: is it the "
                                  "output of a torch.autograd.Function with a backward?")
    grads = sequence(case["grads"], f"{what}: the gradients", 3)
    for desc, want, tol, name in zip(grads, wanted[1:], tols[1:], "qkv"):
        if desc.get("kind") == "plain" and desc.get("value") is None:
            raise AssertionError(f"{what}: {name} got no gradient")
        _close(desc, want, f"{what}: the gradient of {name}", seed, **tol)


def _judge_ring(student, layouts):
    seed, replies = _run_of(student, "ring_attention")
    for i, n, r, where, c, case in _each("ring_attention", replies, range(len(R.RING_CASES))):
        layout, causal, strided, dtype = R.RING_CASES[c]
        if layout not in layouts:
            continue
        truth = E.attention(seed + 100 * n + 10 * c, n, causal, R.H, R.L, dtype)
        what = (f"ring_attention {where}, layout={layout!r}, causal={causal}, {dtype}"
                + (", strided q, k, v" if strided else ""))
        _judge_attention(case, truth, n, r, layout, what, seed)
    return replies


@graded
def test_ring_attention_contiguous_outputs_and_gradients(student):
    _judge_ring(student, ("contiguous",))


@graded
def test_ring_attention_zigzag_outputs_and_gradients(student):
    _judge_ring(student, ("zigzag",))


def _ring_cases(student):
    """Every case of the ring's run, once its outputs and gradients are all right."""
    replies = _judge_ring(student, ("contiguous", "zigzag"))
    return list(_each("ring_attention", replies, range(len(R.RING_CASES))))


@graded
def test_ring_attention_point_to_point_within_bounds(student):
    kv = 2 * R.B * R.H * R.L * R.D
    for i, n, r, where, c, case in _ring_cases(student):
        layout, causal = R.RING_CASES[c][:2]
        what = f"ring_attention {where}, layout={layout!r}, causal={causal}"
        for phase, hops in (("forward", n - 1), ("backward", 2 * n - 1)):
            calls = case[phase]
            assert isinstance(calls, list), "the ranks' reply was tampered with"
            others = sorted({op for op, _, _ in calls} - {"SEND", "RECV"})
            assert not others, (f"{what}: the {phase} pass issued {', '.join(others)}; ring "
                                "attention uses point-to-point communication only")
            sent = sum(elements for op, elements, _ in calls if op == "SEND")
            assert sent <= hops * kv, (
                f"{what}: the {phase} pass sent {sent} elements; at most {hops} x (|k| + |v|) "
                f"= {hops * kv} are allowed")


#: What the ring's autograd graph may keep for backward, per rank (elements): 6 local blocks
#: of q's size, 4 per-row statistics and one L x L mask, O(S/n) whatever n (the text's bound).
HELD = 6 * R.B * R.H * R.L * R.D + 4 * R.B * R.H * R.L + R.L * R.L


@graded
def test_ring_attention_memory_and_causal_skipping(student):
    block = R.B * R.H * R.L * R.L
    cases = _ring_cases(student)
    zigzag = {}
    for i, n, r, where, c, case in cases:
        layout, causal = R.RING_CASES[c][:2]
        what = f"ring_attention {where}, layout={layout!r}, causal={causal}"
        assert isinstance(case["held"], int), "the ranks' reply was tampered with"
        assert case["held"] <= HELD, (
            f"{what}: the autograd graph of the output keeps {case['held']} elements for "
            f"backward; at most 6|q| + 4*batch*heads*L + L*L = {HELD} are allowed (|q| = "
            f"{R.B * R.H * R.L * R.D}): keep only this rank's own blocks, never the K/V of others")
        counts = {p: case[f"count_{p}"] for p in ("forward", "backward")}
        for phase, count in counts.items():
            assert count["largest"] <= block, (
                f"{what}: a matmul of the {phase} pass produced {count['largest']} elements; "
                f"at most batch*heads*L*L = {block} are allowed (B, H, L = {R.B}, {R.H}, {R.L})")
        scores = counts["forward"]["scores"]
        if layout == "contiguous":
            most = (r + 1 if causal else n) * block
            assert scores <= most, (
                f"{what}: the forward pass computed {scores} score entries; at most "
                f"{'(r+1)' if causal else 'n'} * batch*heads*L*L = {most} are allowed"
                + (" (blocks that the causal mask hides entirely are skipped)" if causal else ""))
        elif causal:
            most = block * (n + 1) // 2
            assert scores <= most, (
                f"{what}: the forward pass computed {scores} score entries; the zig-zag blocks "
                f"(the diagonal whole, then half a block per step) make {most}")
            zigzag.setdefault(i, []).append((r, scores, counts["backward"]["scores"]))
    for i, entries in zigzag.items():
        for phase, k in (("forward", 1), ("backward", 2)):
            per_rank = {entry[0]: entry[k] for entry in entries}
            assert len(set(per_rank.values())) == 1, (
                f"ring_attention on {R.GROUPS[i][0]}, layout='zigzag', causal=True: the ranks "
                f"computed different numbers of score entries in the {phase} pass (group rank: "
                f"entries {per_rank}); with zig-zag every rank computes the same")


# ---------------------------------------------------------------------------- Ulysses

def _judge_ulysses(student):
    seed, replies = _run_of(student, "ulysses_attention")
    for i, n, r, where, c, case in _each("ulysses_attention", replies, (0, 1), R.NOT_THREE):
        truth = E.attention(seed + 100 * n + 10 * c, n, bool(c), R.U_HEADS, R.U_L, "float64")
        what = f"ulysses_attention {where}, causal={bool(c)}, {R.U_HEADS} heads"
        _judge_attention(case, truth, n, r, "contiguous", what, seed)
    return replies


@graded
def test_ulysses_attention_outputs_and_gradients(student):
    _judge_ulysses(student)


@graded
def test_ulysses_attention_all_to_alls_and_value_error(student):
    replies = _judge_ulysses(student)  # counts are given for right results only
    for i, n, r, where, c, case in _each("ulysses_attention", replies, (0, 1), R.NOT_THREE):
        calls = case["forward"]
        assert isinstance(calls, list), "the ranks' reply was tampered with"
        ops = [op for op, _, _ in calls]
        others = sorted(set(ops) - {"ALLTOALL"})
        assert not others and ops.count("ALLTOALL") <= 4, (
            f"ulysses_attention {where}, causal={bool(c)}: the forward pass issued "
            f"{ops or 'nothing'}; expected at most 4 all-to-alls and no other collective or "
            "point-to-point call")
    for i, n, r, where, _, case in _each("ulysses_attention", replies, ["bad"], (0, 2, 3)):
        heads = R.U_BAD_HEADS[n]
        assert case["error"].startswith("ValueError"), (
            f"ulysses_attention {where}: {heads} heads on {n} ranks should raise ValueError; "
            f"got {case['error']}")
        assert case["traffic"] == [], (
            f"ulysses_attention {where}: {heads} heads on {n} ranks communicated "
            f"({case['traffic']}) before raising; raise before any communication")


# ---------------------------------------------------------------------------- train_cp

def _training(student):
    source = E.setup_source()
    seed, replies = _run_of(student, "train_cp", source)
    return seed, replies, student.shared("one process", lambda: E.one_process_training(
        seed, source))


def _judge_training(student, modes):
    seed, replies, (losses, params) = _training(student)
    for i, n, r, where, mode, case in _each("train_cp", replies, modes, R.WHOLE_AND_PAIRS):
        what = f"train_cp(mode={mode!r}) {where}"
        got = case["losses"]
        values = [item.get("value") for item in got.get("items", [])] \
            if got.get("kind") in ("list", "tuple") else None
        assert values is not None and len(values) == R.T_STEPS and \
            all(isinstance(v, float) for v in values), \
            f"{what}: the losses should be a list of {R.T_STEPS} Python floats"
        for step, (v, w) in enumerate(zip(values, losses)):
            assert math.isfinite(v) and abs(v - w) <= 1e-10 * max(1.0, abs(w)), (
                f"{what}: the loss before update {step} is {v!r}; one process training on "
                f"the whole sequence had {w!r} (seed {seed})")
        got = sequence(case["params"], f"{what}: params", len(params))
        for k, (desc, want) in enumerate(zip(got, params)):
            _close(desc, want, f"{what}: parameter {k} of list(model.parameters()) after "
                   f"{R.T_STEPS} steps (vs one process on the whole sequence)", seed, **TIGHT)


@graded
def test_train_cp_ring_both_layouts_match_one_process_training(student):
    _judge_training(student, ("ring", "ring_zigzag"))


@graded
def test_train_cp_ulysses_matches_one_process_training(student):
    _judge_training(student, ("ulysses",))


@graded
def test_train_cp_unknown_mode_raises_value_error(student):
    _, replies, _ = _training(student)  # judged on the groups where no mode raised
    for i, n, r, where, _, case in _each("train_cp", replies, ["bad"], R.WHOLE_AND_PAIRS):
        assert case["error"].startswith("ValueError"), (
            f"train_cp(mode='megatron') {where} should raise ValueError; got {case['error']}")
        assert case["traffic"] == [], (
            f"train_cp(mode='megatron') {where} communicated ({case['traffic']}) before "
            "raising; raise before any communication")
