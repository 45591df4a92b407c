"""Assignment 9's probes: they run in the sandbox beside the student's code and only collect.

``diagnose`` is called on traces the grader sends (recorded in the grader's own processes, or
fixed ones). The probes of ``save_checkpoint`` and ``load_latest`` are in :mod:`.saving`;
``async_save``'s hold its background writer at a file call while they change the state, or
while a second save runs. Nothing here judges.
"""
from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import tempfile

import torch

from autograder.checking.probes import error_of, plain, student_function

from . import expected as E
from .children import wrap_calls
from .children import error_text as _error
from .saving import load_into_blank
from .spec import SPEC


# ---------------------------------------------------------------------------- diagnose

def probe_diagnose(ns, cases):
    """``diagnose`` on a deep copy of each case: its result, or what it raised."""
    fn = student_function(ns, SPEC.function("diagnose"))
    out = []
    for traces in cases:
        try:
            out.append({"result": plain(fn(copy.deepcopy(traces)))})
        except Exception as exc:  # noqa: BLE001 - reported to the grader
            out.append({"error": _error(exc)})
    return out


def probe_diagnose_errors(ns, bad):
    fn = student_function(ns, SPEC.function("diagnose"))
    return [error_of(lambda t=t: fn(copy.deepcopy(t))) for t in bad]


# ---------------------------------------------------------------------------- train_resumable

def _train_resumable(ns):
    fn = ns.get("train_resumable")  # keyword-only arguments: bound by name
    if not callable(fn):
        raise LookupError("train_resumable is not defined (or not a function): did its cell run?")
    import inspect

    try:
        inspect.signature(fn).bind(None, None, steps=1, batch_size=1, lr=0.1, checkpoint_every=1,
                                   directory="", seed=0, log=None)
    except TypeError:
        raise TypeError("train_resumable should take (model_fn, dataset, *, steps, batch_size, "
                        "lr, checkpoint_every, directory, seed, log); yours takes "
                        f"{inspect.signature(fn)}") from None
    except ValueError:
        pass
    return fn


def _read_logs(folder) -> dict:
    logs: dict = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jsonl"):
            continue
        run, rank = (int(part[len(prefix):]) for part, prefix in
                     zip(name[:-6].split("-"), ("run", "rank")))
        with open(os.path.join(folder, name)) as f:
            logs.setdefault(run, {})[rank] = [json.loads(line) for line in f if line.strip()]
    return logs


def probe_resumable(ns, seed, jobs):
    """Each job (a list of ``(world_size, kill)`` runs, ``kill`` = ``(rank, step)`` or None)
    in a fresh checkpoint folder: every run until one ends without a planned kill. Returns per
    job the runs' errors, the logs and the last run's final parameters (rank 0's). A run whose
    ranks are still running at the timeout (a restart that deadlocks, say) ends the probe: the
    runs and jobs after it are not started, and say why (a hang costs one timeout). The runs
    use the student's own save_checkpoint and load_latest (as in the student's self-check)."""
    from autograder.checking.ranks import RanksTimedOut, run_ranks

    from . import ranks

    fn = _train_resumable(ns)
    out, hung = [], None
    for job in jobs:
        if hung is not None:
            out.append({"runs": [], "logs": {}, "state": None, "not_run": hung})
            continue
        root = tempfile.mkdtemp(prefix="a9-job-")
        folder, directory = os.path.join(root, "logs"), os.path.join(root, "checkpoints")
        os.mkdir(folder)
        runs, state = [], None
        try:
            for run, (world, kill) in enumerate(job):
                try:
                    result = run_ranks(ranks.rank_resumable, world, fn, seed, folder,
                                       directory, run, kill, backend="gloo", timeout=60.0,
                                       collective_timeout=10.0)
                    runs.append({"world": world, "kill": kill, "error": None})
                    state = result[0]
                except (TypeError, AttributeError, pickle.PicklingError) as exc:
                    if "pickl" not in str(exc):
                        raise
                    runs.append({"world": world, "kill": kill, "timed_out": False, "error": (
                        "train_resumable could not be sent to the rank processes: it travels "
                        "by value (cloudpickle, as course.launch sends a function), with the "
                        "notebook's globals it reaches, and one of them cannot: "
                        f"{type(exc).__name__}: {str(exc)[:300]} (make threads, open files "
                        "and sockets inside the functions that use them)")})
                    break
                except RuntimeError as exc:
                    timed_out = isinstance(exc, RanksTimedOut)
                    runs.append({"world": world, "kill": kill, "error": str(exc)[-1500:],
                                 "timed_out": timed_out})
                    if timed_out:
                        hung = (f"not run: run {run + 1} of an earlier job (on {world} "
                                "ranks) hung, and this one would have waited as long")
                    if kill is None or timed_out:
                        break
            out.append({"runs": runs, "logs": _read_logs(folder), "state": state})
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------- async_save

#: What a background writer calls first: it is held there until the probe has changed the state.
GATED = (("torch", "save"), ("torch.serialization", "save"), ("builtins", "open"),
         ("io", "open"), ("os", "replace"), ("os", "rename"), ("os", "fsync"), ("os", "mkdir"),
         ("os", "open"))


def _gate(released):
    """Hold every thread but the main one at its first call of :data:`GATED` until
    ``released`` is set, at most 2 s (a save that waits for its own writer inside async_save
    goes on after that, slower but not stuck); returns the undo."""
    import threading

    held = set()

    def wrap(original, _name):
        def gated(*args, **kwargs):
            me = threading.current_thread()
            if me is not threading.main_thread() and me.ident not in held:
                held.add(me.ident)
                released.wait(2.0)
            return original(*args, **kwargs)
        return gated
    return wrap_calls(GATED, wrap)


def _mutate(state):
    """What training does right after a save starts: every tensor changed in place, the other
    values replaced, the list appended to."""
    with torch.no_grad():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.add_(1).mul_(3)
    state["epoch"], state["lr"], state["note"] = -1, -1.0, "changed after the save began"
    state["history"].append(-1)


def probe_async(ns, seed, numel):
    """async_save of step 2's state, which this process then changes while the writer (a
    thread of this process, held at its first file call until then) waits; then wait() and a
    load (the student's own save_checkpoint and load_latest, as in the self-check)."""
    import threading

    fn = student_function(ns, SPEC.function("async_save"))
    load = student_function(ns, SPEC.function("load_latest"))
    root = tempfile.mkdtemp(prefix="a9-async-")
    released = threading.Event()
    try:
        d = os.path.join(root, "run")
        state = E.checkpoint_state(2, seed, numel)
        undo = _gate(released)
        try:
            handle = fn(d, state, 2)
            _mutate(state)
        finally:
            released.set()
            undo()
        if not callable(getattr(handle, "wait", None)):
            return {"error": f"async_save returned {type(handle).__name__}, which has no "
                             "wait()"}
        handle.wait()
        return {"loaded": load_into_blank(load, d, numel)}
    finally:
        released.set()
        shutil.rmtree(root, ignore_errors=True)


#: Seconds the overlap probe holds the first save's writer, and waits for the second save.
HOLD = 2.0
#: What the overlap probe holds a writer right after.
OPENS = (("builtins", "open"), ("io", "open"), ("os", "open"))


def _hold_after_open(held, released, armed):
    """Hold the first thread but the main one that returns from a call of :data:`OPENS` until
    ``released`` is set, at most :data:`HOLD` s (``held`` is set meanwhile), while ``armed``
    (a list: ``armed[0]``) is true; returns the undo."""
    import threading

    lock = threading.Lock()

    def wrap(original, _name):
        def holding(*args, **kwargs):
            result = original(*args, **kwargs)
            if threading.current_thread() is not threading.main_thread():
                with lock:
                    mine, armed[0] = armed[0], False
                if mine:
                    held.set()
                    released.wait(HOLD)
            return result
        return holding
    return wrap_calls(OPENS, wrap)


def _wait(handle, which, errors):
    """``handle.wait()``; what it raised goes into ``errors[which]``."""
    try:
        handle.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        errors[which] = _error(exc)


def probe_async_overlap(ns, seed, numel):
    """Two saves pending at once: async_save of step 2, whose writer is held right after its
    first open returns; async_save of step 3, awaited (at most :data:`HOLD` s) before the
    first writer goes on; then both wait()s and a load."""
    import threading

    fn = student_function(ns, SPEC.function("async_save"))
    load = student_function(ns, SPEC.function("load_latest"))
    root = tempfile.mkdtemp(prefix="a9-overlap-")
    held, released, errors, armed = threading.Event(), threading.Event(), {}, [True]
    try:
        d = os.path.join(root, "run")
        undo = _hold_after_open(held, released, armed)
        try:
            first = fn(d, E.checkpoint_state(2, seed, numel), 2)
            was_held = held.wait(HOLD)
            armed[0] = False  # no more holds: one was, or no file was opened within HOLD s
            second = fn(d, E.checkpoint_state(3, seed, numel), 3)
            for handle in (first, second):
                if not callable(getattr(handle, "wait", None)):
                    return {"error": f"async_save returned {type(handle).__name__}, which has "
                                     "no wait()"}
            waiter = threading.Thread(target=_wait, args=(second, "second", errors),
                                      daemon=True)
            waiter.start()
            waiter.join(HOLD)
        finally:
            released.set()
            undo()
        _wait(first, "first", errors)
        waiter.join()
        return {"held": was_held, "errors": errors, "loaded": load_into_blank(load, d, numel)}
    finally:
        released.set()
        shutil.rmtree(root, ignore_errors=True)


# The speed check's saves, timed by the grader from its own process: per step, begin (its
# state ready), start (async_save: what blocks) and wait (the save written), then end. Each
# timed probe is marked ``timed``: no clean-up after it, which would delay the next call.

#: The timed saves of this sandbox: folder, state, function, handle, async_save calls made.
_TIMED: dict = {}


def _end_timed():
    if "root" in _TIMED:
        shutil.rmtree(_TIMED["root"], ignore_errors=True)
    _TIMED.clear()


def probe_async_begin(ns, seed, step, numel):
    """Before a timed save: step ``step``'s state (``numel`` float32s) ready here; step 1
    starts anew, in a fresh folder."""
    if step == 1:
        _end_timed()
        _TIMED.update(root=tempfile.mkdtemp(prefix="a9-async-time-"), saves=0)
    _TIMED.update(state=None, handle=None)  # the last step's state goes first
    _TIMED.update(fn=student_function(ns, SPEC.function("async_save")), step=step,
                  state=E.checkpoint_state(step, seed, numel))


def probe_async_start(ns):
    """What the grader times as blocking: ``async_save`` of the state; None, or why its result
    cannot be waited for."""
    handle = _TIMED["fn"](os.path.join(_TIMED["root"], "run"), _TIMED["state"], _TIMED["step"])
    _TIMED["saves"] += 1
    if not callable(getattr(handle, "wait", None)):
        return f"async_save returned {type(handle).__name__}, which has no wait()"
    _TIMED["handle"] = handle
    return None


def probe_async_wait(ns):
    """The rest of the save: ``wait()`` on what async_save returned."""
    _TIMED["handle"].wait()
    _TIMED["handle"] = None


def probe_async_end(ns, numel=None):
    """After the timed saves: how many async_save calls were made, and what the student's
    load_latest reads back from their folder (which is removed); with ``numel`` None, only the
    removal."""
    try:
        if numel is None:
            return None
        if "root" not in _TIMED:
            return {"saves": 0, "loaded": {"error": "nothing was saved"}}
        load = student_function(ns, SPEC.function("load_latest"))
        return {"saves": _TIMED["saves"],
                "loaded": load_into_blank(load, os.path.join(_TIMED["root"], "run"), numel)}
    finally:
        _end_timed()


for _probe in (probe_async_begin, probe_async_start, probe_async_wait):
    _probe.timed = True
