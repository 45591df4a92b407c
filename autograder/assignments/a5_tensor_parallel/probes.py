"""Assignment 5's probes: they run in the sandbox beside the student's code, start the graded
function (a class or a function) on 4 fresh processes and on a world of one here
(:func:`autograder.checking.ranks.run_ranks`; what each process runs is in :mod:`.ranks`), and
return what came back (no judging here). Classes and functions that build on the others run
with the student's own versions of those (as in the student's self-check).
"""
from __future__ import annotations

import inspect

from autograder.checking.probes import student_function
from autograder.checking.ranks import run_ranks

from . import ranks
from .spec import SPEC

_BODIES = {"ColumnParallelLinear": ranks.rank_column, "RowParallelLinear": ranks.rank_row,
           "ParallelMLP": ranks.rank_mlp, "vocab_parallel_cross_entropy": ranks.rank_cross_entropy,
           "cross_check": ranks.rank_cross_check}
#: The classmethod each class is built with (the grader calls nothing else on the class).
_BUILDERS = {"ColumnParallelLinear": ("from_linear", ("linear", "group")),
             "RowParallelLinear": ("from_linear", ("linear", "group")),
             "ParallelMLP": ("from_mlp", ("mlp", "group"))}


def student_object(ns, name: str):
    """The student's function, or class with its builder classmethod, with clear errors."""
    if name == "train_2d":  # keyword-only arguments: bound by name
        fn = ns.get(name)
        if not callable(fn):
            raise LookupError(f"{name} is not defined (or not a function): did its cell run?")
        try:
            inspect.signature(fn).bind(None, None, dp=1, tp=1, steps=1, lr=0.1)
        except TypeError:
            raise TypeError(f"train_2d should take (model_fn, data, *, dp, tp, steps, lr); "
                            f"yours takes {inspect.signature(fn)}") from None
        except ValueError:
            pass
        return fn
    if name not in _BUILDERS:
        return student_function(ns, SPEC.function(name))
    cls = ns.get(name)
    if cls is None:
        raise LookupError(f"{name} is not defined: did its cell run without errors?")
    if not isinstance(cls, type):
        raise TypeError(f"{name} should be a class, not {type(cls).__name__}")
    if name != "ParallelMLP":
        student_function(ns, SPEC.function(name))  # the constructor's parameters
    method, params = _BUILDERS[name]
    student_function({f"{name}.{method}": getattr(cls, method, None)}, f"{name}.{method}", params)
    return cls


def _run(ns, name, world_size, body, *args):
    """``body`` on ``world_size`` ranks, on gloo, GPUs or not: the checks' tensors and meshes
    are CPU float64 (``init_device_mesh("cpu", ...)``), which NCCL cannot carry."""
    return run_ranks(body, world_size, student_object(ns, name), *args, backend="gloo")


def probe_ranks(ns, name, world_size, seed):
    """The ranks' replies of ``name``'s run on ``world_size`` processes (1 = here)."""
    return _run(ns, name, world_size, _BODIES[name], seed)


def probe_train_2d(ns, world_size, seed, meshes):
    return _run(ns, "train_2d", world_size, ranks.rank_train_2d, seed, meshes)
