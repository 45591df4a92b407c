"""Assignment 8's probes: they run in the sandbox beside the student's code. The cost model
(``per_rank_memory``, ``step_time``, ``best_config``) is called here, in the sandbox's own
process; ``train_3d`` starts on 8 fresh processes (:func:`autograder.checking.ranks.run_ranks`;
what each runs is in :mod:`.ranks`). They return what came back as plain data (no judging
here). ``best_config`` runs with the student's own ``per_rank_memory`` and ``step_time`` (as in
the student's self-check).
"""
from __future__ import annotations

import copy
import datetime
import inspect
import pickle
import re

import torch.distributed as dist

from autograder.checking.probes import error_of, plain, student_function
from autograder.checking.ranks import run_ranks

from . import ranks
from .spec import SPEC

#: A rank that gloo killed (SIGABRT) leaves no Python error of its own.
_KILLED = re.compile(r"exited with code -6|Connection (reset|closed) by peer|Broken pipe")
_KILLED_HINT = ("\nA rank was killed by gloo (no Python error of its own): most likely two ranks "
                "called one collective with tensors of different sizes, or ranks that should not "
                "talk did (different stages hold different parameters: is each collective on the "
                "right group of the mesh?).")


def _calls(fn, cases) -> list:
    """``fn(*case)`` on a deep copy of each case's arguments: its result, or what it raised."""
    out = []
    for case in cases:
        try:
            out.append({"result": plain(fn(*copy.deepcopy(case)))})
        except Exception as exc:  # noqa: BLE001 - reported to the grader
            out.append({"error": (f"{type(exc).__name__}: {exc}" if str(exc)
                                  else type(exc).__name__)[:500]})
    return out


def probe_cost(ns, name, cases, bad):
    """``name`` (per_rank_memory or step_time) on each case; what each bad case raises."""
    fn = student_function(ns, SPEC.function(name))
    return _calls(fn, cases), [error_of(lambda c=c: fn(*copy.deepcopy(c))) for c in bad]


def probe_best(ns, cases):
    """``best_config`` on each case (with the student's own per_rank_memory and step_time):
    its result, or what it raised."""
    return _calls(student_function(ns, SPEC.function("best_config")), cases)


def _train_3d(ns):
    fn = ns.get("train_3d")  # keyword-only arguments: bound by name
    if not callable(fn):
        raise LookupError("train_3d is not defined (or not a function): did its cell run?")
    try:
        inspect.signature(fn).bind(None, None, dp=1, tp=1, pp=1, micro_batches=1, steps=1, lr=0.1)
    except TypeError:
        raise TypeError("train_3d should take (model_fn, data, *, dp, tp, pp, micro_batches, "
                        f"steps, lr); yours takes {inspect.signature(fn)}") from None
    except ValueError:
        pass
    return fn


def probe_train(ns, seed):
    """The 8 ranks' run of every mesh: ``{"error": why the launch failed or None, "replies":
    {run index: [each rank's reply]}}`` for each run that every one of its ranks finished."""
    fn = _train_3d(ns)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    error = None
    try:
        run_ranks(ranks.rank_train, ranks.WORLD, fn, seed, store.port, backend="gloo",
                  timeout=60.0)
    except RuntimeError as exc:
        error = str(exc) + (_KILLED_HINT if _KILLED.search(str(exc)) else "")
    replies, wrong = {}, []
    for i, run in enumerate(ranks.RUNS):
        keys = [ranks.reply_key(i, r) for r in range(len(run.ranks))]
        if store.check(keys):
            replies[i] = [pickle.loads(store.get(key)) for key in keys]
        for key in [ranks.violation_key(i, r) for r in range(len(run.ranks))]:
            if store.check([key]):
                wrong.append(store.get(key).decode())
    if error and wrong:  # why it failed, most likely: what went where it should not first
        error = f"{error}\nBefore that, {wrong[0]}"
    return {"error": error, "replies": replies}
