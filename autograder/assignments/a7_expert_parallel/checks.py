"""Checks for Assignment 7: mixture of experts and expert parallelism.

Graded: ``route``, ``expert_capacity`` with ``keep_mask`` (one cell), ``load_balancing_loss``,
``MoELayer`` (in the sandbox's process), ``ExpertParallelMoE`` and ``train_ep``: each of the last
two runs once on 4 processes, each rank on every group of :data:`.ranks.GROUPS` it is in
(n = 4, 2, 1), one run judged by all of the function's checks (:func:`.judging._run_of`; the
judges of the last three functions are in :mod:`.judging`). Communication is counted by the
ranks' harness. Each check judges only what it is named for (no check is given only when
another passes), and bad-input cases (the ValueErrors) run in calls of their own after the
value cases, so that a bad case that changes module state cannot cost the values. Points:
spec.py.

Public checks (they run in the student edition too) judge with fixed cases whose values are
data (``public_cases.json``), invariants, finite differences of the student's own function, and
the per-token truth that the probes compute with the same functions the graded code calls, the
student's own (:func:`.ranks.per_token_layer`, float64). Hidden checks (``hidden=True`` in spec.py) compare
fresh random cases with the instructor's answer key (:func:`.expected.key`); without the key
they are reserved, never run.
"""
from __future__ import annotations

import torch

from autograder.checking.expect import assert_close, float32_tolerance, sequence, tensor

from . import expected as E
from .judging import (EPS, _close, _grad, _judge_ep, _judge_moe, _judge_training, _key,
                      _moe_key, _moe_per_token, _tol64, judge_all_to_alls, judge_from_moe,
                      shared_call)
from .probes import FD_STEP, probe_balance, probe_capacity, probe_errors, probe_keep, probe_route
from .spec import SPEC

graded = SPEC.graded
F64 = torch.float64


def _as_tensor(values, dtype):
    return torch.tensor(values, dtype=dtype)


# ---------------------------------------------------------------------------- route

def _route_inputs(g, seed):
    """The public fixed cases first, then fresh random ones."""
    fixed = [{"logits": _as_tensor(c["logits"], F64), "k": c["k"], "what": c["what"],
              "want": c} for c in E.public_cases()["route"]]
    for case in fixed:
        case["upstream"] = torch.ones(case["logits"].size(0), case["k"], dtype=F64)
    return fixed + E.route_cases(g)


def _route_reply(student):
    seed, cases, results = shared_call(student, "route", _route_inputs, probe_route)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    return seed, cases, results


def _route_result(case, res):
    what = f"route({case['what']})"
    w_desc, e_desc = sequence(res["result"], f"{what}'s result (weights, experts)", 2)
    experts = tensor(e_desc, f"{what}: experts")["value"]
    weights = tensor(w_desc, f"{what}: weights")["value"]
    T, k = case["logits"].size(0), case["k"]
    assert experts.shape == (T, k) and experts.dtype == torch.int64, (
        f"{what}: experts should be int64 of shape {(T, k)}; got {experts.dtype} of shape "
        f"{tuple(experts.shape)}")
    assert weights.shape == (T, k) and weights.dtype == case["logits"].dtype, (
        f"{what}: weights should be {case['logits'].dtype} of shape {(T, k)}; got "
        f"{weights.dtype} of shape {tuple(weights.shape)}")
    return what, weights, experts


def _top_k_violation(probs: torch.Tensor, experts: torch.Tensor) -> str | None:
    """Where ``experts`` are not the text's top-k of ``probs``: in descending probability,
    equal probabilities in increasing index, no expert left out that should come before."""
    for t, row in enumerate(experts.tolist()):
        p = probs[t].tolist()
        if len(set(row)) != len(row) or not all(0 <= e < len(p) for e in row):
            return f"token {t}: experts {row} are not {len(row)} distinct expert indices"
        rank = sorted(range(len(p)), key=lambda e: (-p[e], e))  # the order the text defines
        if row != rank[:len(row)]:
            return (f"token {t}: probabilities {[round(v, 6) for v in p]}, experts {row}; "
                    f"expected {rank[:len(row)]} (descending probability, ties to the lower "
                    "index)")
    return None


@graded
def test_route_fixed_cases_invariants_and_value_error(student):
    seed, cases, results = _route_reply(student)
    for case, res in zip(cases, results):
        what, weights, experts = _route_result(case, res)
        logits = case["logits"]
        want = case.get("want")
        if want is not None:  # a public fixed case: its values are data
            assert experts.tolist() == want["experts"], (
                f"{what}: experts {experts.tolist()}; expected {want['experts']} (descending "
                "probability, ties to the lower index)")
            w = _as_tensor(want["weights"], F64)
            assert_close(weights, w, f"{what}: weights (probabilities renormalised over the k)",
                         **_tol64(w))
            continue
        violation = _top_k_violation(torch.softmax(logits.double(), dim=-1), experts)
        assert violation is None, f"{what}: {violation} (inputs from seed {seed})"
        eps = torch.finfo(logits.dtype).eps
        total = weights.double().sum(-1)
        assert bool((weights >= 0).all()) and \
            bool(((total - 1).abs() <= 16 * case["k"] * eps).all()), (
                f"{what}: each row of weights should be >= 0 and sum to 1 (renormalised over "
                f"the k); row sums {total.tolist()} (inputs from seed {seed})")
        assert bool((weights[:, 1:] <= weights[:, :-1] * (1 + 16 * eps)).all()), (
            f"{what}: weights should come in the experts' order, descending (inputs from seed "
            f"{seed})")
    logits = cases[0]["logits"]  # after the value cases, in a call of its own
    ks = (0, logits.size(-1) + 1)
    errors = student.call(probe_errors, "route", [(logits.clone(), k) for k in ks])
    assert isinstance(errors, list) and len(errors) == len(ks), "the reply was tampered with"
    for k, error in zip(ks, errors):
        assert str(error).startswith("ValueError"), (
            f"route with k={k} for {logits.size(-1)} experts should raise ValueError; got "
            f"{error}")


@graded
def test_route_random_cases_and_gradient_against_the_key(student):
    key = _key()
    seed, cases, results = _route_reply(student)
    for case, res in zip(cases, results):
        what, weights, experts = _route_result(case, res)
        logits, k = case["logits"], case["k"]
        want_w, want_e = key.route(logits.double(), k)
        assert torch.equal(experts, want_e), (
            f"{what}: experts {experts.tolist()}; expected {want_e.tolist()} (descending "
            f"probability, ties to the lower index; inputs from seed {seed})")
        tol = _tol64(want_w) if logits.dtype == F64 else dict(
            rtol=0, atol=float32_tolerance(want_w, key.route(logits, k)[0]))
        assert_close(weights, want_w.to(logits.dtype), f"{what}: weights (probabilities "
                     "renormalised over the k)", seed=seed, **tol)
        assert res["backward_ran"], f"{what}: the weights do not require grad (logits do)"
        leaf, mine = (logits.to(t).clone().requires_grad_() for t in (F64, logits.dtype))
        for t in (leaf, mine):
            (key.route(t, k)[0] * case["upstream"].to(t.dtype)).sum().backward()
        tol = _tol64(leaf.grad) if logits.dtype == F64 else dict(
            rtol=0, atol=float32_tolerance(leaf.grad, mine.grad))
        assert_close(tensor(res["grad"], f"{what}: the gradient of the logits")["value"],
                     leaf.grad.to(logits.dtype), f"{what}: the gradient of the logits",
                     seed=seed, **tol)


# ---------------------------------------------------------------------------- capacity

def _capacity_inputs(g, seed):
    """The public fixed cases, then (with the key) the hidden and random ones."""
    public = [tuple(c["args"]) for c in E.public_cases()["expert_capacity"]]
    key = E.key()
    return public + (key.capacity_cases(g) if key is not None else [])


def _judge_capacity(student, hidden: bool):
    seed, cases, values = shared_call(student, "capacity", _capacity_inputs, probe_capacity)
    assert isinstance(values, list) and len(values) == len(cases), "the reply was tampered with"
    public = {tuple(c["args"]): c["value"] for c in E.public_cases()["expert_capacity"]}
    for case, got in zip(cases, values):
        if (case in public) == hidden:
            continue
        want = public[case] if not hidden else _key().capacity(*case)
        assert got["type"] == "int" and got["value"] == want, (
            f"expert_capacity{case} returned {got['value']!r} ({got['type']}); expected the "
            f"int {want} (exact: capacity_factor as the decimal it prints as)"
            + (f"; inputs from seed {seed}" if hidden else ""))
    if hidden:
        return
    try:  # every value case of the cell (keep_mask's too, not judged here) before a bad case
        _keep_reply(student)
    except AssertionError:
        pass
    errors_in = [tuple(c) for c in E.public_cases()["expert_capacity_errors"]]
    errors = student.call(probe_errors, "expert_capacity", errors_in)
    assert isinstance(errors, list) and len(errors) == len(errors_in), \
        "the reply was tampered with"
    for case, error in zip(errors_in, errors):
        assert str(error).startswith("ValueError"), \
            f"expert_capacity{case} should raise ValueError; got {error}"


def _keep_inputs(g, seed):
    fixed = [{"experts": torch.tensor(c["experts"], dtype=torch.int64),
              "capacity": c["capacity"], "what": c["what"], "want": c["keep"]}
             for c in E.public_cases()["keep_mask"]]
    return fixed + E.keep_cases(g)


def _fill_order_violation(mask: torch.Tensor, experts: torch.Tensor, cap: int) -> str | None:
    """Where ``mask`` breaks the text's rule, in its fill order (all first choices in token
    order, then all second choices, ...): each expert keeps exactly its first ``min(count,
    cap)`` assignments, a prefix."""
    T, k = experts.shape
    flags: dict[int, list] = {}
    for j in range(k):
        for t in range(T):
            flags.setdefault(int(experts[t, j]), []).append(((t, j), bool(mask[t, j])))
    for e, seq in sorted(flags.items()):
        kept = sum(f for _, f in seq)
        if kept != min(len(seq), max(cap, 0)):
            return (f"expert {e} has {len(seq)} assignments and keeps {kept}; with capacity "
                    f"{cap} it should keep {min(len(seq), max(cap, 0))}")
        late = next(((t, j) for i, ((t, j), f) in enumerate(seq) if f and i >= kept), None)
        if late is not None:
            return (f"expert {e} keeps (token {late[0]}, choice {late[1]}) although an "
                    "assignment before it in the fill order was dropped")
    return None


def _keep_reply(student):
    seed, cases, results = shared_call(student, "keep", _keep_inputs, probe_keep)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    return seed, cases, results


def _judge_keep(student, which):
    """``which``: "public" (the fixed cases' values, the fill order on random routings) or
    "hidden" (random routings against the answer key)."""
    seed, cases, results = _keep_reply(student)
    for case, res in zip(cases, results):
        fixed = "want" in case
        if which == "hidden" and fixed:
            continue
        experts, cap = case["experts"], case["capacity"]
        what = f"keep_mask({case['what']})"
        mask = tensor(res["mask"], what)["value"]
        assert mask.dtype == torch.bool and mask.shape == experts.shape, (
            f"{what} should be a bool tensor of shape {tuple(experts.shape)}; got {mask.dtype} "
            f"of shape {tuple(mask.shape)}")
        if which == "hidden":
            want = _key().keep_mask(experts, cap)
        elif fixed:
            want = torch.tensor(case["want"], dtype=torch.bool)
        else:
            violation = _fill_order_violation(mask, experts, cap)
            assert violation is None, (
                f"{what} with experts {experts.tolist()}: {violation} (all first choices in "
                f"token order, then all second choices, ...; inputs from seed {seed})")
            continue
        assert torch.equal(mask, want), (
            f"{what} with experts {experts.tolist()}: got {mask.int().tolist()}, expected "
            f"{want.int().tolist()} (all first choices in token order, then all second "
            "choices, ..." + (f"; inputs from seed {seed})" if not fixed else ")"))


@graded
def test_expert_capacity_fixed_cases_and_value_errors(student):
    _judge_capacity(student, hidden=False)


@graded
def test_keep_mask_fixed_cases_and_the_fill_order(student):
    _judge_keep(student, "public")


@graded
def test_expert_capacity_and_keep_mask_random_cases_against_the_key(student):
    _judge_capacity(student, hidden=True)
    _judge_keep(student, "hidden")


# ---------------------------------------------------------------------------- load balancing

def _balance_inputs(g, seed):
    fixed = [{"logits": _as_tensor(c["logits"], F64),
              "experts": torch.tensor(c["experts"], dtype=torch.int64),
              "num_experts": c["num_experts"], "what": c["what"], "want": c["loss"], "fd": True}
             for c in E.public_cases()["load_balancing_loss"]]
    return fixed + [dict(case, fd=True) for case in E.balance_cases(g)]


def _balance_reply(student):
    seed, cases, results = shared_call(student, "balance", _balance_inputs, probe_balance)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    return seed, cases, results


def _scalar(desc, what) -> float:
    value = tensor(desc, what)["value"]
    assert value.numel() == 1 and value.dtype == F64, \
        f"{what} should be a float64 scalar tensor; got {value.dtype} of shape {tuple(value.shape)}"
    return value.item()


@graded
def test_load_balancing_loss_fixed_cases_and_finite_differences(student):
    seed, cases, results = _balance_reply(student)
    for case, res in zip(cases, results):
        what = f"load_balancing_loss({case['what']})"
        loss = tensor(res["loss"], what)["value"]
        assert loss.dim() == 0 and loss.dtype == F64, (
            f"{what} should be a 0-dimensional float64 tensor; got {loss.dtype} of shape "
            f"{tuple(loss.shape)}")
        if "want" in case:
            want = torch.tensor(case["want"], dtype=F64)
            assert_close(loss, want, f"{what} (E * sum_i f_i * P_i, f from all k choices)",
                         **_tol64(want))
        assert res["backward_ran"], f"{what}: the loss does not require grad (logits do)"
        grad = tensor(res["grad"], f"{what}: the gradient of the logits")["value"]
        nearby = res["nearby"]
        assert isinstance(nearby, list) and len(nearby) == case["logits"].numel(), \
            "the reply was tampered with"
        fd = torch.tensor([(_scalar(p, what) - _scalar(m, what)) / (2 * FD_STEP)
                           for p, m in nearby], dtype=F64).view_as(case["logits"])
        # central differences: truncation h^2/6 |f'''| (softmax's derivatives are at most a
        # few times E) and rounding eps |loss| / h, each far below this
        tol = 1000 * (FD_STEP ** 2 * case["num_experts"] + EPS * max(1.0, abs(loss.item()))
                      / FD_STEP)
        assert_close(grad, fd, f"{what}: the gradient of the logits (autograd) against central "
                     f"finite differences of your own function (step {FD_STEP})", seed=seed,
                     rtol=0, atol=tol)


@graded
def test_load_balancing_loss_random_cases_against_the_key(student):
    key = _key()
    seed, cases, results = _balance_reply(student)
    for case, res in zip(cases, results):
        what = f"load_balancing_loss({case['what']})"
        leaf = case["logits"].clone().requires_grad_()
        want = key.balance_loss(leaf, case["experts"], case["num_experts"])
        _close(res["loss"], want.detach(), f"{what} (a scalar tensor: E * sum_i f_i * P_i, f "
               "from all k choices)", seed)
        want.backward()
        assert res["backward_ran"], f"{what}: the loss does not require grad (logits do)"
        _grad(res["grad"], leaf.grad, f"{what}: the gradient of the logits", seed)


# ------------------------------------------------ MoELayer, ExpertParallelMoE, train_ep (.judging)


@graded
def test_MoELayer_outputs_against_a_per_token_loop(student):
    _judge_moe(student, "outputs", _moe_per_token)


@graded
def test_MoELayer_gradients_against_a_per_token_loop(student):
    _judge_moe(student, "gradients", _moe_per_token)  # judged on their own


@graded
def test_MoELayer_against_the_answer_key(student):
    _judge_moe(student, "both", _moe_key)


@graded
def test_ExpertParallelMoE_from_moe_attributes_and_value_error(student):
    judge_from_moe(student)


@graded
def test_ExpertParallelMoE_forward_against_a_per_token_loop(student):
    _judge_ep(student)


@graded
def test_ExpertParallelMoE_gradients_against_a_per_token_loop(student):
    _judge_ep(student, "gradients")


@graded
def test_ExpertParallelMoE_all_to_alls_only(student):
    judge_all_to_alls(student)


@graded
def test_ExpertParallelMoE_against_the_answer_key(student):
    _judge_ep(student, "both", source="key")


@graded
def test_train_ep_losses_match_one_process_training(student):
    _judge_training(student, "losses")


@graded
def test_train_ep_state_matches_one_process_training(student):
    _judge_training(student, "state")


@graded
def test_train_ep_against_the_answer_key(student):
    _judge_training(student, "both", truth="key")
