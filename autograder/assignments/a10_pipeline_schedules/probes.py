"""Assignment 10's probes: they run in the sandbox beside the student's code and only collect.

The generators are called with torch's schedule classes refused (the text forbids them); their
lists come back as plain lists of strings. The split backward is called on the grader's stages,
with what it leaves alive counted here: the tensors alive after ``backward_input`` returned that
were not alive before (by distinct storage), and whether anything autograd saved during the call
outlives it. ``run_schedule`` runs on ranks (:mod:`.ranks`). Nothing here judges.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import torch

from autograder.checking.probes import describe, error_of, student_function

from . import ranks
from .spec import SPEC

#: the most actions a generator's lists may hold in all (p <= 6, v <= 4, m <= 30 need < 3000)
MAX_ACTIONS = 20_000


@contextlib.contextmanager
def torch_schedules_refused():
    """While inside, torch's pipeline schedule classes (their every method) and the schedules
    module's functions raise: the graded generators may not call them."""
    from torch.distributed.pipelining import schedules as ts

    def refuse(*args, **kwargs):
        raise RuntimeError("torch.distributed.pipelining's schedules may not be used by the graded "
                           "generators (the text says so): write the lists yourself")

    undo = []
    for name, obj in list(vars(ts).items()):
        if isinstance(obj, type) and issubclass(obj, ts._PipelineSchedule):
            for attr, value in list(vars(obj).items()):
                if callable(value) or isinstance(value, (staticmethod, classmethod)):
                    undo.append((obj, attr, value))
                    setattr(obj, attr, refuse)
        elif callable(obj) and getattr(obj, "__module__", None) == ts.__name__ \
                and not isinstance(obj, type):
            undo.append((ts, name, obj))
            setattr(ts, name, refuse)
    try:
        yield
    finally:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)


def _lists(result):
    """A generator's result as a list of lists of str, or ``{"bad": what it is}``."""
    if not isinstance(result, (list, tuple)):
        return {"bad": f"a {type(result).__name__}, not a list of per-rank lists"}
    out, total = [], 0
    for rank, entries in enumerate(result):
        if not isinstance(entries, (list, tuple)):
            return {"bad": f"entry {rank} (rank {rank}'s list) is a {type(entries).__name__}, not a list"}
        total += len(entries)
        if total > MAX_ACTIONS:
            return {"bad": f"more than {MAX_ACTIONS} actions"}
        for i, action in enumerate(entries):
            if type(action) is not str:
                return {"bad": f"rank {rank}'s entry {i} is {str(action)[:40]!r} "
                               f"({type(action).__name__}), not a str like '0F0'"}
        out.append([str(a) for a in entries])
    return out


def probe_generate(ns, name, cases):
    """The generator ``name`` on each argument tuple: its lists, or what it raised."""
    fn = student_function(ns, SPEC.function(name))
    out = []
    with torch_schedules_refused():
        for args in cases:
            try:
                out.append({"lists": _lists(fn(*args))})
            except Exception as exc:  # noqa: BLE001 - reported to the grader
                out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
    return out


def probe_value_errors(ns, name, cases):
    fn = student_function(ns, SPEC.function(name))
    with torch_schedules_refused():
        return [error_of(lambda a=args: fn(*a)) for args in cases]


# ---------------------------------------------------------------------------- split backward

def _live_tensors() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def _storages(tensors) -> dict:
    """{storage pointer: bytes} of the tensors' storages."""
    out = {}
    for t in tensors:
        with contextlib.suppress(Exception):
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


class _Packed:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def probe_backward_input(ns, cases):
    """Per case ``(stage, x, grad_output)``: ``grad_input``, whether any ``.grad`` changed, the
    bytes of the new storages left alive besides ``grad_input``'s, and how many of the tensors
    autograd saved during the call are still held."""
    fn = student_function(ns, SPEC.function("backward_input"))
    out = []
    for stage, x, grad_output in cases:
        before = _live_tensors()
        known = _storages(before) | _storages([x, grad_output, *stage.parameters()])
        packed = []

        def pack(t):
            # detached: a saved output held as itself would tie its own graph into a cycle
            # through C++ that no collector frees (Tanh, ReLU save their result), and a correct
            # backward_input with retain_graph=True would seem to keep a graph alive
            holder = _Packed(t.detach())
            packed.append(weakref.ref(holder))
            return holder

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.tensor):
            result = fn(stage, x, grad_output)
        if not (isinstance(result, tuple) and len(result) == 2):
            out.append({"bad": f"backward_input returned {type(result).__name__}, not a pair "
                               "(grad_input, saved)"})
            continue
        grad_input = result[0]
        del before
        after = _storages(_live_tensors())
        mine = _storages([grad_input]) if isinstance(grad_input, torch.Tensor) else {}
        kept = sum(n for ptr, n in after.items() if ptr not in known and ptr not in mine)
        out.append({"grad_input": describe(grad_input), "kept_bytes": kept,
                    "graph_alive": sum(ref() is not None for ref in packed),
                    "grads": [p.grad is not None for p in stage.parameters()]})
        del result
    return out


def probe_backward_weight(ns, stage, xs, grad_outputs, order, start_grads):
    """``backward_input`` on every micro-batch, then ``backward_weight`` in ``order``, from the
    given ``.grad``s: the parameters' ``.grad`` after it."""
    first = student_function(ns, SPEC.function("backward_input"))
    fn = student_function(ns, SPEC.function("backward_weight"))
    for p, g in zip(stage.parameters(), start_grads):
        p.grad = None if g is None else g.clone()
    saved = []
    for x, g in zip(xs, grad_outputs):
        result = first(stage, x, g)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"backward_input returned {type(result).__name__}, not a pair")
        saved.append(result[1])
    for i in order:
        fn(stage, saved[i])
    return [describe(p.grad) for p in stage.parameters()]


# ---------------------------------------------------------------------------- run_schedule

def probe_run_cases(ns, world_size, cases):
    from autograder.checking.ranks import run_ranks

    fn = student_function(ns, SPEC.function("run_schedule"))
    return run_ranks(ranks.rank_cases, world_size, fn, copy.deepcopy(cases), in_process=False)


def probe_refusals(ns, world_size, cases):
    from autograder.checking.ranks import run_ranks

    fn = student_function(ns, SPEC.function("run_schedule"))
    return run_ranks(ranks.rank_refusals, world_size, fn, copy.deepcopy(cases), in_process=False)
