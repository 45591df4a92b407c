"""Assignment 6's probes: they run in the sandbox beside the student's code. ``merge_attention``
is called here, in the sandbox's own process (it needs no ranks); the other functions start on
4 fresh processes (:func:`autograder.checking.ranks.run_ranks`; what each runs is in
:mod:`.ranks`). They return what came back (no judging here). A function that calls others
runs with the student's own versions of those (as in the student's self-check).
"""
from __future__ import annotations

import inspect

import torch

from autograder.checking.probes import describe, student_function
from autograder.checking.ranks import run_ranks

from . import ranks
from .spec import SPEC

_BODIES = {"ring_attention": ranks.rank_ring, "ulysses_attention": ranks.rank_ulysses,
           "zigzag_shard": ranks.rank_zigzag, "train_cp": ranks.rank_train}


def student_object(ns, name: str):
    """The student's function (a pair for zig-zag), with clear errors."""
    if name == "zigzag_shard":
        return (student_function(ns, SPEC.function("zigzag_shard")),
                student_function(ns, SPEC.function("zigzag_unshard")))
    if name != "train_cp":
        return student_function(ns, SPEC.function(name))
    fn = ns.get(name)  # keyword-only arguments: bound by name
    if not callable(fn):
        raise LookupError(f"{name} is not defined (or not a function): did its cell run?")
    try:
        inspect.signature(fn).bind(None, None, mode="ring", steps=1, lr=0.1, group=None)
    except TypeError:
        raise TypeError(f"train_cp should take (model_fn, tokens, *, mode, steps, lr, "
                        f"group=None); yours takes {inspect.signature(fn)}") from None
    except ValueError:
        pass
    return fn


def probe_ranks(ns, name, seed, *args):
    """The 4 ranks' replies of ``name``'s run (on gloo: the checks' tensors are CPU float64)."""
    return run_ranks(_BODIES[name], ranks.WORLD, student_object(ns, name), seed, *args,
                     backend="gloo")


def probe_merge(ns, cases):
    """``merge_attention`` on each case's four tensors (given as they are: strided views where
    the grader made them so): what it returned, and whether it left its inputs as they were."""
    fn = student_function(ns, SPEC.function("merge_attention"))
    out = []
    for case in cases:
        args = [_strided(t) if case.get("strided") else t.clone() for t in case["inputs"]]
        before = [a.clone() for a in args]
        result = fn(*args)
        out.append({"result": describe(result), "unchanged": ranks.unchanged(before, args)})
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view with ``t``'s values: every other element of a twice-as-long last
    dimension."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]
