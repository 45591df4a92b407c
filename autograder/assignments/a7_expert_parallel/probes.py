"""Assignment 7's probes: they run in the sandbox beside the student's code. ``route``,
``expert_capacity``/``keep_mask``, ``load_balancing_loss`` and ``MoELayer`` are called here, in
the sandbox's own process; ``ExpertParallelMoE`` and ``train_ep`` start on 4 fresh processes
(:func:`autograder.checking.ranks.run_ranks`; what each runs is in :mod:`.ranks`). They return
what came back (no judging here). A function that calls others runs with the student's own
versions of those (as in the student's self-check). ``MoELayer``, ``ExpertParallelMoE`` and
``train_ep`` also bring back the per-token truth computed with those same functions
(:func:`.ranks.per_token_layer`), and ``load_balancing_loss`` its values at nearby logits
(finite differences), for the public checks.
"""
from __future__ import annotations

import inspect
import re
import types

import torch

from autograder.checking.probes import describe, student_function
from autograder.checking.ranks import run_ranks

from . import ranks
from .spec import _PARTS, SPEC

#: The step of the finite differences of ``load_balancing_loss`` (central, float64).
FD_STEP = 1e-5

#: A rank that gloo killed (SIGABRT: it received more bytes than its output tensor holds)
#: leaves no Python error; its neighbours report a broken connection, or the harness names the
#: rank that died (killed by SIGABRT).
_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|exited with code -6|"
                   r"killed by SIGABRT")
_LOST_HINT = ("\nA rank was killed by gloo (no Python error of its own): it most likely received "
              "more rows in an all-to-all than its output tensor had room for. Each rank must "
              "learn how many rows it will receive from every other rank (exchange the counts "
              "first) and post exactly those output split sizes.")


def _graded(ns, name: str):
    """The student's class or function ``name``, with clear errors."""
    if name == "ExpertParallelMoE":
        cls = ns.get(name)
        if not isinstance(cls, type) or not callable(getattr(cls, "from_moe", None)):
            raise LookupError(f"{name} is not defined (or has no from_moe): did its cell run?")
        return cls
    if name != "train_ep":
        return student_function(ns, SPEC.function(name))
    fn = ns.get(name)  # keyword-only arguments: bound by name
    if not callable(fn):
        raise LookupError(f"{name} is not defined (or not a function): did its cell run?")
    try:
        inspect.signature(fn).bind(None, None, steps=1, lr=0.1, aux_coef=0.0, group=None)
    except TypeError:
        raise TypeError(f"train_ep should take (model_fn, data, *, steps, lr, aux_coef, "
                        f"group=None); yours takes {inspect.signature(fn)}") from None
    except ValueError:
        pass
    return fn


def _parts(ns) -> tuple:
    """``(route, expert_capacity, keep_mask, load_balancing_loss)`` as ``ns`` has them now."""
    return tuple(ns.get(n) for n in _PARTS)


def _globals_of(obj) -> dict | None:
    """The globals that the code of ``obj`` (a function, or a class's methods) looks names up
    in, or None."""
    if isinstance(obj, types.FunctionType):
        return obj.__globals__
    for value in (vars(obj).values() if isinstance(obj, type) else ()):
        value = getattr(value, "__func__", value)
        if isinstance(value, types.FunctionType):
            return value.__globals__
    return None


def _parts_in_ranks(ns, fn) -> tuple:
    """The parts as ``fn`` finds them on the ranks that :func:`run_ranks` starts: those get the
    namespace as loaded (:mod:`autograder.sandbox.as_loaded`), so a part that an earlier check's
    bad input rebound (a handler that replaces ``keep_mask``) is the loaded one there, whatever
    ``ns`` holds now; the per-token truth must use what the graded code uses."""
    from autograder.sandbox import as_loaded

    copy, live = as_loaded.loads(as_loaded.dumps((fn, _parts(ns))))
    seen = _globals_of(copy) or {}
    return tuple(seen.get(n, part) for n, part in zip(_PARTS, live))


def probe_ranks(ns, name, seed, *args):
    """The 4 ranks' replies of ``name``'s run (on gloo: the checks' tensors are CPU float64);
    for ``train_ep``, rank 0's reply also holds the per-token one-process training. ``name``
    "ExpertParallelMoE bad": only ``from_moe`` on experts that the group cannot split (its own
    fresh processes, after the value run: a bad case cannot disturb the values)."""
    bad = name == "ExpertParallelMoE bad"
    name = "ExpertParallelMoE" if bad else name
    fn = _graded(ns, name)
    moe_class = student_function(ns, SPEC.function("MoELayer"))
    if bad:
        body, extra = ranks.rank_ep_bad, ()
    elif name == "ExpertParallelMoE":
        body, extra = ranks.rank_ep, (_parts_in_ranks(ns, fn),)
    else:
        body, extra = ranks.rank_train, args
    try:
        replies = run_ranks(body, ranks.WORLD, fn, moe_class, seed, *extra, backend="gloo",
                            timeout=75.0)
    except RuntimeError as exc:
        if _LOST.search(str(exc)):
            raise RuntimeError(str(exc) + _LOST_HINT) from None
        raise
    if name == "train_ep" and isinstance(replies, list) and replies and \
            isinstance(replies[0], dict):
        replies[0]["per-token"] = ranks.per_token_training(_parts_in_ranks(ns, fn), seed,
                                                           *args)
    return replies


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def probe_route(ns, cases):
    """``route`` on each case and the gradient of (weights * upstream).sum() w.r.t. the
    logits."""
    fn = student_function(ns, SPEC.function("route"))
    out = []
    for case in cases:
        logits = _leaf(case["logits"])
        result = fn(logits, case["k"])
        weights = result[0] if isinstance(result, (tuple, list)) and len(result) == 2 else None
        ran = isinstance(weights, torch.Tensor) and weights.requires_grad and \
            weights.shape == case["upstream"].shape
        if ran:
            (weights * case["upstream"]).sum().backward()
        out.append({"result": describe(result), "grad": describe(logits.grad),
                    "backward_ran": ran})
    return out


def probe_errors(ns, name, cases):
    """What ``name(*case)`` raises for each bad case: a call of its own, made after the value
    cases (a bad case that changes module state cannot cost the values)."""
    fn = student_function(ns, SPEC.function(name))
    return [ranks.error_of(lambda case=case: fn(*case)) for case in cases]


def probe_capacity(ns, cases):
    """``expert_capacity`` on each case (the value and its type)."""
    fn = student_function(ns, SPEC.function("expert_capacity"))
    values = []
    for case in cases:
        value = fn(*case)
        values.append({"value": value if type(value) in (int, float, bool) else None,
                       "type": type(value).__name__})
    return values


def probe_keep(ns, cases):
    """``keep_mask`` on each case."""
    fn = student_function(ns, SPEC.function("keep_mask"))
    return [{"mask": describe(fn(case["experts"].clone(), case["capacity"]))} for case in cases]


def probe_balance(ns, cases):
    """``load_balancing_loss`` on each case, the gradient of the loss w.r.t. the logits, and
    (cases with ``"fd"``) the loss at ``logits +- FD_STEP`` in each entry: ``[[plus, minus],
    ...]`` in row-major order."""
    fn = student_function(ns, SPEC.function("load_balancing_loss"))
    out = []
    for case in cases:
        logits = _leaf(case["logits"])
        loss = fn(logits, case["experts"].clone(), case["num_experts"])
        ran = isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad
        if ran:
            loss.sum().backward()
        nearby = []
        if case.get("fd"):
            with torch.no_grad():
                for i in range(case["logits"].numel()):
                    pair = []
                    for sign in (1.0, -1.0):
                        moved = case["logits"].clone()
                        moved.view(-1)[i] += sign * FD_STEP
                        pair.append(describe(fn(moved, case["experts"].clone(),
                                                case["num_experts"])))
                    nearby.append(pair)
        out.append({"loss": describe(loss), "grad": describe(logits.grad), "backward_ran": ran,
                    "nearby": nearby})
    return out


def probe_moe(ns, cases):
    """``MoELayer`` (its given ``__init__``) holding each case's weights: ``forward(x)``,
    backward of (y * upstream).sum() + c * aux; outputs, gradients of x, the router and every
    expert; and the per-token truth with the same functions the layer calls."""
    cls = student_function(ns, SPEC.function("MoELayer"))
    out = []
    for case in cases:
        moe = ranks.load_moe(cls, case["state"], case["k"], case["capacity_factor"])
        x = _leaf(case["x"])
        result = moe(x)
        y, aux = result if isinstance(result, (tuple, list)) and len(result) == 2 \
            else (result, None)
        ran = all(isinstance(t, torch.Tensor) for t in (y, aux)) and \
            y.shape == x.shape and aux.numel() == 1 and (y.requires_grad or aux.requires_grad)
        if ran:
            ((y * case["upstream"]).sum() + case["c"] * aux.sum()).backward()
        out.append({"y": describe(y), "aux": describe(aux), "backward_ran": ran,
                    "x_grad": describe(x.grad),
                    "grads": {name: describe(p.grad) for name, p in moe.named_parameters()},
                    "truth": ranks.per_token_truth(_parts(ns), case["state"], case["x"],
                                                   case["upstream"], case["k"],
                                                   case["capacity_factor"], case["c"])})
    return out
