"""Assignment 7's judging shared by its checks: tolerances, the per-token truth the probes bring
back, and the judges of ``MoELayer``, ``ExpertParallelMoE`` and ``train_ep`` against either the
per-token truth (public checks) or the answer key (hidden checks). Runs in the grader only."""
from __future__ import annotations

import math

import torch

from autograder.checking.expect import (assert_close, fresh_generator, sequence,
                                        shared_rank_replies, tensor)

from . import expected as E
from . import ranks as R
from .probes import probe_moe, probe_ranks

EPS = torch.finfo(torch.float64).eps
PARAMS = R.PARAMS


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


def shared_call(student, key, make, probe, *extra):
    """``(seed, inputs, reply)`` of one probe call shared by a function's checks."""
    def run():
        g, seed = fresh_generator()
        inputs = make(g, seed)
        return seed, inputs, student.call(probe, inputs, *extra)
    return student.shared(key, run)


def _key():
    key = E.key()
    assert key is not None, "the answer key is missing (a hidden check ran without it)"
    return key


def _per_token(desc, what: str) -> dict:
    """The per-token truth a probe computed with the functions the graded code calls (the
    student's own)."""
    assert isinstance(desc, dict), "the reply was tampered with"
    if "error" in desc:
        raise AssertionError(
            f"{what}: the per-token computation that this check compares with could not run "
            f"with the route, expert_capacity, keep_mask and load_balancing_loss it uses (your "
            f"own: their own checks say what is wrong with them): {desc['error']}")
    grads = desc.get("grads")
    assert isinstance(grads, dict), "the reply was tampered with"
    return {"y": tensor(desc["y"], what)["value"], "aux": tensor(desc["aux"], what)["value"],
            "grads": {n: tensor(d, what)["value"] for n, d in grads.items()},
            "kept": tensor(desc["kept"], what)["value"]}


# ---------------------------------------------------------------------------- MoELayer

def _judge_moe(student, part, truth_of):
    """``part``: "outputs" (y and aux), "gradients" (those only: judged on their own, whatever
    the outputs) or "both"."""
    seed, cases, results = shared_call(student, "moe", E.moe_cases, probe_moe)
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    for case, res in zip(cases, results):
        what = f"MoELayer ({case['what']})"
        truth, against = truth_of(case, res, what)
        if part != "gradients":
            _close(res["y"], truth["y"], f"{what}: y ({against})", seed)
            _close(res["aux"], truth["aux"], f"{what}: aux (a 0-dimensional tensor; {against})",
                   seed)
        if part == "outputs":
            continue
        assert res["backward_ran"], f"{what}: neither y nor aux requires grad"
        grads = res["grads"]
        assert isinstance(grads, dict) and set(grads) == set(case["state"]), (
            f"{what}: its parameters are not those of the given __init__")
        loss = f"(y * g).sum() + {case['c']:.3f} * aux"
        _grad(res["x_grad"], truth["grads"]["x"], f"{what}: the gradient of x for {loss}", seed)
        for name, desc in grads.items():
            j = int(name.split(".")[1]) if name.startswith("experts.") else None
            _grad(desc, truth["grads"][name], f"{what}: the gradient of {name} for {loss} "
                  f"({against})", seed, may_be_none=j is not None and int(truth["kept"][j]) == 0)


def _moe_per_token(case, res, what):
    return _per_token(res["truth"], what), "vs a per-token loop with the same route and keep_mask"


def _moe_key(case, res, what):
    return _key().dense(case["state"], case["x"], case["upstream"], case["k"],
                        case["capacity_factor"], case["c"]), "vs the answer key's layer"


# ---------------------------------------------------------------------------- ExpertParallelMoE

def _run_of(student, name, *extra):
    """``(seed, replies)``: the 4 ranks' replies of ``name``'s one run, shared by its checks
    (``name`` "ExpertParallelMoE bad": the run of ``from_moe``'s bad cases)."""
    return shared_rank_replies(student, name, R.WORLD, probe_ranks,
                               lambda seed: (name, seed, *extra))


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


def _ep_truths(source, seed, replies, i, n, c) -> list[dict]:
    """The dense layer on each group rank's tokens: the per-token truth the ranks computed
    (``source`` "per-token") or the answer key's."""
    if source == "key":
        return [_key().ep_dense(seed, n, c, s) for s in range(n)]
    members = R.GROUPS[i][1]
    return [_per_token(replies[g][(i, c)].get("truth"), f"ExpertParallelMoE on group rank {s}")
            for s, g in enumerate(members)]


def _judge_ep(student, part="outputs", source="per-token"):
    """Every rank's forward ("outputs"), gradients ("gradients", judged on their own) or both
    ("both") against the dense layer on its tokens."""
    seed, replies = _run_of(student, "ExpertParallelMoE")
    against = ("a per-token loop with the same route and keep_mask" if source == "per-token"
               else "the answer key's dense layer")
    for i, n, r, where, c, case in _each(replies, range(len(R.EP_CASES))):
        what = _ep_what(where, c)
        everyone = _ep_truths(source, seed, replies, i, n, c)
        truth = everyone[r]
        if part != "gradients":
            _close(case["y"], truth["y"], f"{what}: y (vs {against} on this rank's tokens)",
                   seed)
            _close(case["aux"], truth["aux"], f"{what}: aux (vs {against} on this rank's "
                   "tokens)", seed)
        if part == "outputs":
            continue
        assert case["backward_ran"], f"{what}: neither y nor aux requires grad"
        _grad(case["x_grad"], truth["grads"]["x"], f"{what}: the gradient of x (vs {against})",
              seed)
        router = sequence(case["router_grad"], f"{what}: the router's gradients", 1)
        _grad(router[0], truth["grads"]["router.weight"], f"{what}: the gradient of "
              f"router.weight (vs {against} on this rank's tokens)", seed)
        m = R.E // n
        experts = sequence(case["expert_grads"], f"{what}: the local experts", m)
        for local, desc in enumerate(experts):
            j, named = r * m + local, _named(desc, f"{what}: local expert {local}")
            for p in PARAMS:
                want = sum(t["grads"][f"experts.{j}.{p}"] for t in everyone)
                _grad(named[p], want, f"{what}: the gradient of local expert {local} (global "
                      f"{j}) {p} (the sum over the group's ranks of {against}'s)", seed,
                      may_be_none=sum(int(t["kept"][j]) for t in everyone) == 0)
    return seed, replies


def judge_from_moe(student):
    """from_moe's attributes on the values' run; its ValueError on a run of its own, after."""
    seed, replies = _run_of(student, "ExpertParallelMoE")  # the values' run first
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
    _, bad = _run_of(student, "ExpertParallelMoE bad")  # fresh processes, after the values
    for i, n, r, where, _, case in _each(bad, ["bad"]):
        assert case["error"].startswith("ValueError"), (
            f"ExpertParallelMoE.from_moe {where} with {R.BAD_EXPERTS[n]} experts on {n} ranks "
            f"should raise ValueError; got {case['error']}")


def judge_all_to_alls(student):
    """The collectives of forward and backward and the elements of their inputs."""
    seed, replies = _run_of(student, "ExpertParallelMoE")  # judged on its own
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
        everyone, m = _ep_truths("per-token", seed, replies, i, n, c), R.E // n
        kept = int(everyone[r]["kept"].sum())
        got = sum(int(t["kept"][r * m:(r + 1) * m].sum()) for t in everyone)
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

def _one_process(student, seed, source, replies, n, truth) -> tuple[list, dict]:
    """One process training the dense model on the same per-chunk losses: with the per-token
    layer and the student's own parts that train_ep calls (rank 0 of the sandbox computed it),
    or with the answer key's layer."""
    if truth == "key":
        return student.shared(f"one process {n}",
                              lambda: _key().one_process_training(seed, source, n))
    done = replies[0].get("per-token")
    assert isinstance(done, dict), "the ranks' reply was tampered with"
    if "error" in done:
        raise AssertionError(
            "train_ep: the one-process training that this check compares with could not run "
            "with the route, expert_capacity, keep_mask and load_balancing_loss it uses (your "
            f"own in your copy; the reference's when your instructor grades): {done['error']}")
    mine = done.get(n)
    assert isinstance(mine, dict), "the ranks' reply was tampered with"
    return mine["losses"], {k: tensor(d, k)["value"] for k, d in mine["state"].items()}


def _judge_training(student, part, truth="per-token"):
    source = E.setup_source()
    seed, replies = _run_of(student, "train_ep", source)
    against = ("one process training the dense model (a per-token loop) on the same per-chunk "
               "losses" if truth == "per-token" else
               "the answer key's one-process training on the same per-chunk losses")
    for i, (label, members) in enumerate(R.GROUPS):
        n = len(members)
        losses, state = _one_process(student, seed, source, replies, n, truth)
        for r, g in enumerate(members):
            case = replies[g].get(i)
            assert isinstance(case, dict), "the ranks' reply was tampered with"
            what = f"train_ep {label}, group rank {r} (global rank {g})"
            if part in ("losses", "both"):
                values = [d.get("value") for d in sequence(case["losses"], f"{what}: losses",
                                                           R.T_STEPS)]
                assert all(type(v) is float for v in values), \
                    f"{what}: the losses should be a list of {R.T_STEPS} Python floats"
                for step, (v, w) in enumerate(zip(values, losses)):
                    assert math.isfinite(v) and abs(v - w) <= 4096 * EPS * max(1.0, abs(w)), (
                        f"{what}: the loss before update {step} is {v!r}; {against} had "
                        f"{w!r} (seed {seed})")
            if part not in ("state", "both"):
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
                       f"{against})", seed)
