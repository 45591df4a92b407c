"""Checks for Assignment 7: mixture of experts and expert parallelism.

Graded: ``route``, ``expert_capacity`` with ``keep_mask`` (one cell), ``load_balancing_loss``,
``MoELayer`` (in the sandbox's process), ``ExpertParallelMoE`` and ``train_ep``: each of the last
two runs once on 4 processes, each rank on every group of :data:`.ranks.GROUPS` it is in
(n = 4, 2, 1), one run judged by all of the function's checks (:func:`_run_of`). The truth is
the grader's own (:mod:`.expected`, float64). Communication is counted by the ranks' harness.
A function's later checks count only when its values are right. Points: spec.py.
"""
from __future__ import annotations

import math

import torch

from autograder.checking.expect import (assert_close, float32_tolerance, fresh_generator,
                                        sequence, shared_rank_replies, tensor)

from . import expected as E
from . import ranks as R
from .probes import (probe_balance, probe_capacity, probe_keep, probe_moe, probe_ranks,
                     probe_route)
from .spec import SPEC

graded = SPEC.graded
EPS = torch.finfo(torch.float64).eps
PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


def _tol64(reference: torch.Tensor) -> dict:
    """Float64 rounding of a result of this size: a few thousand ulps of its largest entry."""
    scale = reference.abs().max().item() if reference.numel() else 1.0
    return dict(rtol=0, atol=4096 * EPS * max(1.0, scale))


def _close(desc, want, what, seed, **tol):
    assert_close(tensor(desc, what)["value"], want, what, seed=seed, **(tol or _tol64(want)))


def _grad(desc, want, what, seed, *, may_be_none=False):
    """A gradient: None is accepted (for zeros) only where ``may_be_none``."""
    if isinstance(desc, dict) and desc.get("kind") == "plain" and desc.get("value") is None:
        assert may_be_none, f"{what}: got no gradient (None)"
        return
    _close(desc, want, what, seed)


def _shared_call(student, key, make, probe, *extra):
    """``(seed, inputs, reply)`` of one probe call shared by a function's checks."""
    def run():
        g, seed = fresh_generator()
        inputs = make(g, seed)
        return seed, inputs, student.call(probe, inputs, *extra)
    return student.shared(key, run)


# ---------------------------------------------------------------------------- route

def _judge_route(student, gradients=False):
    seed, cases, (results, bad) = _shared_call(student, "route", lambda g, s: E.route_cases(g),
                                               probe_route)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    for case, res in zip(cases, results):
        logits, k = case["logits"], case["k"]
        what = f"route({case['what']})"
        w_desc, e_desc = sequence(res["result"], f"{what}'s result (weights, experts)", 2)
        experts = tensor(e_desc, f"{what}: experts")["value"]
        weights = tensor(w_desc, f"{what}: weights")["value"]
        want_w, want_e = E.route(logits.double(), k)
        assert experts.shape == want_e.shape and experts.dtype == torch.int64, (
            f"{what}: experts should be int64 of shape {tuple(want_e.shape)}; got "
            f"{experts.dtype} of shape {tuple(experts.shape)}")
        assert torch.equal(experts, want_e), (
            f"{what}: experts {experts.tolist()}; expected {want_e.tolist()} (descending "
            f"probability, ties to the lower index; inputs from seed {seed})")
        tol = _tol64(want_w) if logits.dtype == torch.float64 else dict(
            rtol=0, atol=float32_tolerance(want_w, E.route(logits, k)[0]))
        assert_close(weights, want_w.to(logits.dtype), f"{what}: weights (probabilities "
                     "renormalised over the k)", seed=seed, **tol)
        if not gradients:
            continue
        assert res["backward_ran"], f"{what}: the weights do not require grad (logits do)"
        leaf, mine = (logits.to(t).clone().requires_grad_() for t in (torch.float64, logits.dtype))
        for t in (leaf, mine):
            (E.route(t, k)[0] * case["upstream"].to(t.dtype)).sum().backward()
        tol = _tol64(leaf.grad) if logits.dtype == torch.float64 else dict(
            rtol=0, atol=float32_tolerance(leaf.grad, mine.grad))
        assert_close(tensor(res["grad"], f"{what}: the gradient of the logits")["value"],
                     leaf.grad.to(logits.dtype), f"{what}: the gradient of the logits",
                     seed=seed, **tol)
    for k, error in bad.items():
        assert str(error).startswith("ValueError"), (
            f"route with k={k} for {cases[0]['logits'].size(-1)} experts should raise "
            f"ValueError; got {error}")


@graded
def test_route_values_ties_and_value_error(student):
    _judge_route(student)


@graded
def test_route_renormalised_weights_gradient(student):
    _judge_route(student, gradients=True)  # given only with right values


# ---------------------------------------------------------------------------- capacity

def _judge_capacity(student):
    seed, cases, reply = _shared_call(student, "capacity", lambda g, s: E.CAPACITY_CASES,
                                      probe_capacity, E.CAPACITY_ERRORS)
    values, errors = reply
    assert len(values) == len(cases), "the reply was tampered with"
    for case, got in zip(cases, values):
        want = E.capacity(*case)
        assert got["type"] == "int" and got["value"] == want, (
            f"expert_capacity{case} returned {got['value']!r} ({got['type']}); expected the "
            f"int {want} (exact: capacity_factor as the decimal it prints as)")
    for case, error in zip(E.CAPACITY_ERRORS, errors):
        assert str(error).startswith("ValueError"), \
            f"expert_capacity{case} should raise ValueError; got {error}"


def _judge_keep(student, which):
    seed, cases, results = _shared_call(student, "keep", lambda g, s: E.keep_cases(g),
                                        probe_keep)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    for c, (case, res) in enumerate(zip(cases, results)):
        if (c < E.HAND_MADE_KEEP) != (which == "hand-made") and which != "all":
            continue
        experts, cap = case["experts"], case["capacity"]
        what = f"keep_mask({case['what']})"
        mask = tensor(res["mask"], what)["value"]
        want = E.keep_mask(experts, cap)
        assert mask.dtype == torch.bool and mask.shape == want.shape, (
            f"{what} should be a bool tensor of shape {tuple(want.shape)}; got {mask.dtype} of "
            f"shape {tuple(mask.shape)}")
        assert torch.equal(mask, want), (
            f"{what} with experts {experts.tolist()}: got {mask.int().tolist()}, expected "
            f"{want.int().tolist()} (all first choices in token order, then all second "
            f"choices, ...; inputs from seed {seed})")


@graded
def test_expert_capacity_exact_values_and_value_errors(student):
    _judge_capacity(student)
    _judge_keep(student, "all")  # the cell's other function: given only when it is right too


@graded
def test_keep_mask_hand_made_cases(student):
    _judge_keep(student, "hand-made")


@graded
def test_keep_mask_random_cases_against_the_fill_order(student):
    _judge_keep(student, "random")


# ---------------------------------------------------------------------------- load balancing

def _judge_balance(student, gradients=False):
    seed, cases, results = _shared_call(student, "balance", lambda g, s: E.balance_cases(g),
                                        probe_balance)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    for case, res in zip(cases, results):
        what = f"load_balancing_loss({case['what']})"
        leaf = case["logits"].clone().requires_grad_()
        want = E.balance_loss(leaf, case["experts"], case["num_experts"])
        _close(res["loss"], want.detach(), f"{what} (a scalar tensor: E * sum_i f_i * P_i, f "
               "from all k choices)", seed)
        if gradients:
            want.backward()
            assert res["backward_ran"], f"{what}: the loss does not require grad (logits do)"
            _grad(res["grad"], leaf.grad, f"{what}: the gradient of the logits", seed)


@graded
def test_load_balancing_loss_matches_the_formula(student):
    _judge_balance(student)


@graded
def test_load_balancing_loss_gradient(student):
    _judge_balance(student, gradients=True)  # given only with right values


# ---------------------------------------------------------------------------- MoELayer

def _judge_moe(student, part):
    helpers = E.helper_cells(SPEC.function("MoELayer").helpers)
    seed, cases, results = _shared_call(student, "moe", E.moe_cases, probe_moe, helpers)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    for case, res in zip(cases, results):
        what = f"MoELayer ({case['what']})"
        truth = E.dense(case["state"], case["x"], case["upstream"], case["k"],
                        case["capacity_factor"], case["c"])
        _close(res["y"], truth["y"], f"{what}: y", seed)
        _close(res["aux"], truth["aux"], f"{what}: aux (a 0-dimensional tensor)", seed)
        if part == "outputs":
            continue
        assert res["backward_ran"], f"{what}: neither y nor aux requires grad"
        grads = res["grads"]
        assert isinstance(grads, dict) and set(grads) == set(case["state"]), (
            f"{what}: its parameters are not those of the given __init__")
        loss = f"(y * g).sum() + {case['c']:.3f} * aux"
        if part == "router":
            _grad(res["x_grad"], truth["grads"]["x"], f"{what}: the gradient of x for {loss}",
                  seed)
        for name, desc in grads.items():
            j = int(name.split(".")[1]) if name.startswith("experts.") else None
            if (j is None) == (part == "router"):
                _grad(desc, truth["grads"][name], f"{what}: the gradient of {name} for {loss}",
                      seed, may_be_none=j is not None and int(truth["kept"][j]) == 0)


@graded
def test_MoELayer_outputs_with_and_without_drops(student):
    _judge_moe(student, "outputs")


@graded
def test_MoELayer_gradients_of_x_and_the_router(student):
    _judge_moe(student, "router")  # given only with right outputs


@graded
def test_MoELayer_gradients_of_the_experts(student):
    _judge_moe(student, "experts")  # given only with right outputs


# ---------------------------------------------------------------------------- ExpertParallelMoE

def _run_of(student, name, *extra):
    """``(seed, replies)``: the 4 ranks' replies of ``name``'s one run, shared by its checks."""
    helpers = E.helper_cells(SPEC.function(name).helpers)
    return shared_rank_replies(student, name, R.WORLD, probe_ranks,
                               lambda seed: (name, seed, helpers, *extra))


def _each(replies, keys):
    """``(group index, n, r, where, key, case)`` for every group, rank in it and case key."""
    for i, (label, members) in enumerate(R.GROUPS):
        for r, g in enumerate(members):
            where = f"on {label}, group rank {r} (global rank {g})"
            for key in keys:
                if key == "bad" and len(members) not in R.BAD_EXPERTS:
                    continue
                case = replies[g].get((i, key))
                assert isinstance(case, dict), "the ranks' reply was tampered with"
                yield i, len(members), r, where, key, case


def _named(desc, what) -> dict:
    """An expert's ``[[name, gradient or tensor], ...]`` as a dict, its names checked."""
    named = {item["items"][0]["value"]: item["items"][1] for item in sequence(desc, what, 4)}
    assert set(named) == set(PARAMS), \
        f"{what}'s parameters are named {sorted(named)}; expected {list(PARAMS)} (an expert)"
    return named


def _ep_what(where, c):
    cf, skewed = R.EP_CASES[c]
    return (f"ExpertParallelMoE {where}, capacity_factor={cf}"
            + (", skewed routing (a rank receives no row)" if skewed else ""))


def _judge_ep(student, gradients=False):
    """Every rank's forward (and gradients) against the dense layer on its tokens."""
    seed, replies = _run_of(student, "ExpertParallelMoE")
    for i, n, r, where, c, case in _each(replies, range(len(R.EP_CASES))):
        what = _ep_what(where, c)
        truth = E.ep_dense(seed, n, c, r)
        _close(case["y"], truth["y"], f"{what}: y (vs the dense layer on this rank's tokens)",
               seed)
        _close(case["aux"], truth["aux"], f"{what}: aux (vs the dense layer on this rank's "
               "tokens)", seed)
        if not gradients:
            continue
        assert case["backward_ran"], f"{what}: neither y nor aux requires grad"
        _grad(case["x_grad"], truth["grads"]["x"], f"{what}: the gradient of x", seed)
        router = sequence(case["router_grad"], f"{what}: the router's gradients", 1)
        _grad(router[0], truth["grads"]["router.weight"], f"{what}: the gradient of "
              "router.weight (vs the dense layer on this rank's tokens)", seed)
        m = R.E // n
        experts = sequence(case["expert_grads"], f"{what}: the local experts", m)
        everyone = [E.ep_dense(seed, n, c, s) for s in range(n)]
        for local, desc in enumerate(experts):
            j, named = r * m + local, _named(desc, f"{what}: local expert {local}")
            for p in PARAMS:
                want = sum(t["grads"][f"experts.{j}.{p}"] for t in everyone)
                _grad(named[p], want, f"{what}: the gradient of local expert {local} (global "
                      f"{j}) {p} (the sum over the group's ranks of the dense layer's)", seed,
                      may_be_none=sum(int(t["kept"][j]) for t in everyone) == 0)
    return seed, replies


@graded
def test_ExpertParallelMoE_from_moe_attributes_and_value_error(student):
    seed, replies = _judge_ep(student)  # given only with a right forward
    for i, n, r, where, c, case in _each(replies, range(len(R.EP_CASES))):
        what, a = f"ExpertParallelMoE.from_moe {where}", case["attributes"]
        state, m = R.ep_state(seed, n, c), R.E // n
        assert a["module"], f"{what} should return an nn.Module"
        assert not a["missing"], f"{what}: the result has no attribute(s) {a['missing']}"
        router = sequence(a["router"], f"{what}: router's parameters", 1)
        _close(router[0]["items"][1], state["router.weight"], f"{what}: router.weight (a copy "
               "of moe.router's)", seed, rtol=0, atol=0)
        experts = sequence(a["experts"], f"{what}: experts (this rank's E/n)", m)
        for local, desc in enumerate(experts):
            named = _named(desc, f"{what}: local expert {local}")
            for p in PARAMS:
                _close(named[p], state[f"experts.{r * m + local}.{p}"], f"{what}: local "
                       f"expert {local}, {p} (a copy of moe.experts[{r * m + local}])", seed,
                       rtol=0, atol=0)
        assert not a["router_shared"] and not a["experts_shared"], (
            f"{what}: router and experts should be copies, not moe's own modules")
        assert case["moe_untouched"], f"{what}: moe's parameters or gradients changed"
        plain = [d.get("value") for d in sequence(a["plain"], what, 3)]
        assert plain == [R.E, R.K, R.EP_CASES[c][0]], (
            f"{what}: num_experts, k, capacity_factor are {plain}; expected "
            f"{[R.E, R.K, R.EP_CASES[c][0]]}")
        assert a["group"], f"{what}: its group attribute is not the group it was given"
    for i, n, r, where, _, case in _each(replies, ["bad"]):
        assert case["error"].startswith("ValueError"), (
            f"ExpertParallelMoE.from_moe {where} with {R.BAD_EXPERTS[n]} experts on {n} ranks "
            f"should raise ValueError; got {case['error']}")


@graded
def test_ExpertParallelMoE_forward_equals_the_dense_layer(student):
    _judge_ep(student)


@graded
def test_ExpertParallelMoE_gradients(student):
    _judge_ep(student, gradients=True)


@graded
def test_ExpertParallelMoE_all_to_alls_only(student):
    seed, replies = _judge_ep(student, gradients=True)  # counted for right results only
    for i, n, r, where, c, case in _each(replies, range(len(R.EP_CASES))):
        what = _ep_what(where, c)
        forward, backward = case["forward"], case["backward"]
        assert isinstance(forward, list) and isinstance(backward, list), \
            "the ranks' reply was tampered with"
        ops = [op for op, _, _ in forward] + [op for op, _, _ in backward]
        assert set(ops) <= {"ALLTOALL"}, (
            f"{what}: forward and backward issued {ops}; only all-to-alls are allowed (no "
            "all-gather, all-reduce, broadcast or point-to-point)")
        if n == 1:
            assert len(forward) <= 3 and len(backward) <= 2, (
                f"{what}: {len(forward)} all-to-alls in forward, {len(backward)} in backward")
            continue
        kept, got = int(E.ep_dense(seed, n, c, r)["kept"].sum()), E.received(seed, n, c, r)
        sizes, rows = [elements for _, elements, _ in forward], [kept * R.D, got * R.D]
        assert len(sizes) == 3 and sizes[0] <= R.E and sizes[1:] == rows, (
            f"{what}: the forward's all-to-alls had inputs of {sizes} elements; expected 3: "
            f"counts (at most {R.E} elements), dispatch ({kept} kept rows x {R.D} = {rows[0]}"
            f" elements), combine ({got} received rows x {R.D} = {rows[1]} elements) (uneven "
            "splits, no padding, no dropped row)")
        back = sorted(elements for _, elements, _ in backward)
        assert back == sorted(rows), (
            f"{what}: the backward's all-to-alls had inputs of {back} elements; expected the "
            f"two token all-to-alls again ({sorted(rows)} elements)")


# ---------------------------------------------------------------------------- train_ep

def _judge_training(student, part):
    source = E.setup_source()
    seed, replies = _run_of(student, "train_ep", source)
    for i, (label, members) in enumerate(R.GROUPS):
        n = len(members)
        losses, state = student.shared(f"one process {n}", lambda: E.one_process_training(
            seed, source, n))
        for r, g in enumerate(members):
            case = replies[g].get(i)
            assert isinstance(case, dict), "the ranks' reply was tampered with"
            what = f"train_ep {label}, group rank {r} (global rank {g})"
            if part == "losses":
                values = [d.get("value") for d in sequence(case["losses"], f"{what}: losses",
                                                           R.T_STEPS)]
                assert all(type(v) is float for v in values), \
                    f"{what}: the losses should be a list of {R.T_STEPS} Python floats"
                for step, (v, w) in enumerate(zip(values, losses)):
                    assert math.isfinite(v) and abs(v - w) <= 4096 * EPS * max(1.0, abs(w)), (
                        f"{what}: the loss before update {step} is {v!r}; one process "
                        f"training on the same per-chunk losses had {w!r} (seed {seed})")
                continue
            m = R.MODEL["num_experts"] // n
            names = [k for k in state if not k.startswith("moe.experts.") or
                     r * m <= int(k.split(".")[2]) < (r + 1) * m]
            got = case["state"]
            assert isinstance(got, dict) and "kind" not in got, \
                f"{what}: state should be a dict of name -> tensor"
            assert set(got) == set(names), (
                f"{what}: state has the names {sorted(got)}; expected {sorted(names)} (the "
                "local experts under their global names)")
            for name in names:
                _close(got[name], state[name], f"{what}: {name} after {R.T_STEPS} steps (vs "
                       "one process on the same per-chunk losses)", seed)


@graded
def test_train_ep_losses_match_one_process_training(student):
    _judge_training(student, "losses")


@graded
def test_train_ep_state_matches_one_process_training(student):
    _judge_training(student, "state")
