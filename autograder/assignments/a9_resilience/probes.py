"""Assignment 9's probes: they run in the sandbox beside the student's code and only collect.

``diagnose`` is called on traces the grader sends (recorded in the grader's own processes, or
fixed ones). The checkpoint probes save and load in a scratch folder of the sandbox; the saves
that get killed run in a child forked from the sandbox's worker (:mod:`.children`), which the
probe kills with SIGKILL at a chosen moment and always reaps: before or after the k-th call to
a file-system function (:data:`HOOKED`), after a delay drawn from the run's seed, or mid-write
by a file-size limit (SIGXFSZ). Loading always happens here, in the worker, after the child is
gone. Nothing here judges.
"""
from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import signal
import tempfile
import time

import torch

from autograder.checking.probes import error_of, plain, student_function

from . import expected as E
from .children import error_text as _error
from .children import install_hooks, kill_child, run_child
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


# ---------------------------------------------------------------------------- checkpoints

def snapshot(state) -> dict:
    """What load_latest left in ``state``: tensors as copies, the rest as plain data."""
    if not isinstance(state, dict):
        return {"t": type(state).__name__}
    return {str(k): ({"tensor": v.detach().clone()} if isinstance(v, torch.Tensor)
                     else {"value": plain(v)}) for k, v in state.items()}


def _load(load, directory, numel):
    state = E.blank_state(numel)
    try:
        step = load(directory, state)
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        return {"error": _error(exc)}
    return {"step": plain(step), "state": snapshot(state)}


def _functions(ns):
    return (student_function(ns, SPEC.function("save_checkpoint")),
            student_function(ns, SPEC.function("load_latest")))


def probe_round_trip(ns, seed):
    """load_latest on a folder that does not exist and on an empty one; then three saves and
    one load; then a load into a second blank state."""
    save, load = _functions(ns)
    root = tempfile.mkdtemp(prefix="a9-ckpt-")
    try:
        missing = _load(load, os.path.join(root, "nothing-here"), 1000)
        os.mkdir(os.path.join(root, "empty"))
        empty = _load(load, os.path.join(root, "empty"), 1000)
        d = os.path.join(root, "run")
        for step in (1, 2, 3):
            save(d, E.checkpoint_state(step, seed), step)
        return {"missing": missing, "empty": empty, "latest": _load(load, d, 1000)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _trial(save, load, seed, d, numel, prepare):
    """Step 1 saved in a child; in a second child, ``prepare(say)`` then step 2's save (which
    may be killed); then, here, a load, a save of step 3 and another load."""
    first, how, _ = run_child(lambda say: save(d, E.checkpoint_state(1, seed, numel), 1))
    if how != "exit code 0":
        why = next((x[6:] for x in first if x.startswith("error ")), how)
        return {"setup": f"save_checkpoint of step 1 (no kill) failed: {why}"}

    def body(say):
        prepare(say)
        say("go")
        save(d, E.checkpoint_state(2, seed, numel), 2)
        say("saved")
    lines, how, stamps = run_child(body, on_go=getattr(prepare, "on_go", None))
    if "go" not in lines:
        return {"setup": f"the grader could not prepare the kill: the child {how}"}
    out = {"ended": how, "saved": "saved" in lines,
           "seconds": stamps["saved"] - stamps["go"] if "saved" in stamps else None,
           "error": next((x[6:] for x in lines if x.startswith("error ")), None),
           "events": [x[6:] for x in lines if x.startswith("event ")],
           "loaded": _load(load, d, numel)}
    try:
        save(d, E.checkpoint_state(3, seed, numel), 3)
        out["then"] = _load(load, d, numel)
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        out["then"] = {"error": "save_checkpoint of the next step raised " + _error(exc)}
    return out


def probe_commit_kills(ns, seed, most=12):
    """A kill before and after each of the first ``most`` file-system calls of a save."""
    save, load = _functions(ns)
    root = tempfile.mkdtemp(prefix="a9-kill-")
    try:
        def counting(say):
            install_hooks(None, lambda name: say("event " + name))
        trials = [_trial(save, load, seed, os.path.join(root, "count"), 1000, counting)]
        events = trials[0].get("events", [])
        for k in range(min(len(events), most)):
            for when in ("before", "after"):
                def plan(say, k=k, when=when):
                    install_hooks((k, when), lambda name: say("event " + name))
                trial = _trial(save, load, seed, os.path.join(root, f"{k}-{when}"), 1000, plan)
                trials.append(dict(trial, kill=f"{when} call {k + 1} ({events[k]})"))
        return trials
    finally:
        shutil.rmtree(root, ignore_errors=True)


def probe_random_kills(ns, seed, numel, kills=6):
    """Step 2's save of a state of ``numel`` floats killed after a delay drawn from the seed
    over 1.5 x a measured save; and once cut off mid-write by a file-size limit."""
    save, load = _functions(ns)
    root = tempfile.mkdtemp(prefix="a9-random-")
    rng = random.Random(seed)
    try:
        trial = _trial(save, load, seed, os.path.join(root, "measure"), numel, lambda say: None)
        trials = [dict(trial, kill="not killed: the save timed")]
        seconds = trial.get("seconds") or 0.01  # one save of step 2, unkilled
        for i in range(1, kills + 1):
            delay = rng.uniform(0, 1.5 * seconds)

            def prepare(say):
                pass
            prepare.on_go = lambda pid, delay=delay: (time.sleep(delay), kill_child(pid))
            trial = _trial(save, load, seed, os.path.join(root, str(i)), numel, prepare)
            trials.append(dict(trial, kill=f"SIGKILL {1000 * delay:.1f} ms into the save"))

        def limited(say):
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]  # the sandbox's own limit
            soft = 2 * numel if hard == resource.RLIM_INFINITY else min(2 * numel, hard)
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        trial = _trial(save, load, seed, os.path.join(root, "fsize"), numel, limited)
        trials.append(dict(trial, kill=f"SIGXFSZ: a file-size limit of {2 * numel} bytes "
                                       "(half of the largest tensor) cuts a write off"))
        return trials
    finally:
        shutil.rmtree(root, ignore_errors=True)




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
    import importlib
    import threading

    saved, held = [], set()
    for module_name, attr in GATED:
        module = importlib.import_module(module_name)
        original = getattr(module, attr)

        def gated(*args, __original=original, **kwargs):
            me = threading.current_thread()
            if me is not threading.main_thread() and me.ident not in held:
                held.add(me.ident)
                released.wait(2.0)
            return __original(*args, **kwargs)
        saved.append((module, attr, original))
        setattr(module, attr, gated)

    def undo():
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
    return undo


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
        return {"loaded": _load(load, d, numel)}
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
                "loaded": _load(load, os.path.join(_TIMED["root"], "run"), numel)}
    finally:
        _end_timed()


for _probe in (probe_async_begin, probe_async_start, probe_async_wait):
    _probe.timed = True
