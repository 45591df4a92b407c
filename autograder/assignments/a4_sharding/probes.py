"""Assignment 4's probes: they run in the sandbox beside the student's code, call the student's
functions here or start them on N fresh processes (what each process runs is in :mod:`.ranks`
and :mod:`.ddp_ranks`), and describe what came back (no judging here).
"""
from __future__ import annotations

from autograder.checking.probes import describe, student_function

from .cases import run_cases
from .ddp_ranks import rank_bucketed_ddp_case
from .fsdp_ranks import rank_apply_fsdp_case
from .ranks import rank_sharded_linear_case, rank_sharded_optimizer_case
from .spec import SPEC


#: Functions with keyword-only arguments: not bound against the spec's (positional) parameters
#: here; a call with the wrong ones fails with the student's own TypeError.
KEYWORD_ONLY = ("model_state_bytes", "comm_bytes_per_step")


def _lookup(ns, name: str):
    """The student's ``name``, or a clear error if it is missing or not callable."""
    if name not in KEYWORD_ONLY:
        return student_function(ns, SPEC.function(name))
    fn = ns.get(name)
    if fn is None:
        raise LookupError(f"{name} is not defined: did its cell run without errors?")
    if not callable(fn):
        raise TypeError(f"{name} should be a function, not {type(fn).__name__}")
    return fn


def probe_calls(ns, name: str, cases):
    """``name(*args, **kwargs)`` for each ``(args, kwargs)`` in ``cases``: each result described,
    or the exception's type and message (an exception is an answer here: ValueError is asked for
    on invalid arguments)."""
    fn = _lookup(ns, name)
    out = []
    for args, kwargs in cases:
        try:
            value = fn(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the grader, which judges it
            out.append({"raised": type(exc).__name__, "is_value_error": isinstance(exc, ValueError),
                        "message": str(exc)[:200]})
        else:
            out.append({"returned": describe(value)})
    return out


def _run_class(ns, name, rank_fn, world_size, cases, *args):
    """``rank_fn`` for each of ``cases`` with the student's class ``name`` on ``world_size``
    ranks, case by case (:func:`~.cases.run_cases`), with the student's own versions of the
    graded functions it calls (as in the student's self-check). On gloo, GPUs or not: the
    checks' tensors are CPU float64."""
    return run_cases(rank_fn, world_size, cases, _lookup(ns, name), *args)


def probe_helper_values(ns, name, helper, cases):
    """What the graded function ``helper`` returns on each ``(args, kwargs)`` of ``cases``, as
    the class ``name`` calls it (the one its ``__init__`` sees: the student's own), described:
    what the class's checks judge it against."""
    cls = _lookup(ns, name)
    init = getattr(cls, "__init__", None)
    fn = (init.__globals__ if hasattr(init, "__globals__") else ns).get(helper)
    if fn is None:
        raise LookupError(f"{helper} is not defined: did its cell run without errors?")
    return [describe(fn(*args, **kwargs)) for args, kwargs in cases]


def probe_sharded_optimizer(ns, world_size, seed, cases, steps, per_rank):
    return _run_class(ns, "ShardedOptimizer", rank_sharded_optimizer_case, world_size, cases,
                      seed, steps, per_rank)


def probe_bucketed_ddp(ns, world_size, seed, cases, steps, per_rank, lr):
    return _run_class(ns, "BucketedDDP", rank_bucketed_ddp_case, world_size, cases, seed, steps,
                      per_rank, lr)


def probe_sharded_linear(ns, world_size, seed, cases):
    return _run_class(ns, "ShardedLinear", rank_sharded_linear_case, world_size, cases, seed)


def probe_apply_fsdp(ns, world_size, seed, cases_by_world, per_rank):
    """apply_fsdp on ``world_size`` ranks (CPU processes on gloo; 1 rank runs here) for each
    of its cases ``(model kind, mesh shape)``, case by case."""
    return run_cases(rank_apply_fsdp_case, world_size, cases_by_world[world_size],
                     _lookup(ns, "apply_fsdp"), seed, per_rank)
