"""Assignment 9's Part 2 probes (``save_checkpoint``, ``load_latest``): they run in the sandbox
beside the student's code and only collect.

They save and load in a scratch folder of the sandbox. The saves that get killed run in a child
forked from the sandbox's worker (:mod:`.children`), which the probe kills with SIGKILL at a
chosen moment and always reaps: before or after the k-th call to a file-system function
(:data:`.children.HOOKED`), after a delay drawn from the run's seed, or mid-write by a
file-size limit (SIGXFSZ). An unkilled save also reports its flushes (which file, what size),
and the folder's files are listed before and after it. The last probe saves five steps with
``keep=2`` and damages what the newest saves wrote. Loading always happens here, in the worker,
after the child is gone. Nothing here judges.
"""
from __future__ import annotations

import hashlib
import os
import random
import resource
import shutil
import signal
import stat
import tempfile
import time

import torch

from autograder.checking.probes import plain, student_function

from . import expected as E
from .children import error_text as _error
from .children import install_hooks, kill_child, run_child
from .spec import SPEC

#: The kill checks save with keep=1: removing step 1 before step 2 is committed loses them.
KEEP_KILLED = 1
#: The first calls of a save killed before and after (the released text says how many).
KILL_CALLS = 20
#: At most this many files are listed in a checkpoint folder (more: the listing says so).
MOST_FILES = 10_000


def snapshot(state) -> dict:
    """What load_latest left in ``state``: tensors as copies, the rest as plain data."""
    if not isinstance(state, dict):
        return {"t": type(state).__name__}
    return {str(k): ({"tensor": v.detach().clone()} if isinstance(v, torch.Tensor)
                     else {"value": plain(v)}) for k, v in state.items()}


def load_into_blank(load, directory, numel):
    """``load_latest`` into a blank state: the step it returned and the state it left, or what
    it raised."""
    state = E.blank_state(numel)
    try:
        step = load(directory, state)
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        return {"error": _error(exc)}
    return {"step": plain(step), "state": snapshot(state)}


def _functions(ns):
    return (student_function(ns, SPEC.function("save_checkpoint")),
            student_function(ns, SPEC.function("load_latest")))


def files(directory) -> dict:
    """``{path relative to directory: [st_dev, st_ino, size, sha256]}`` of every regular file
    under ``directory`` (links not followed); ``{"": ...}`` marks a listing cut at
    :data:`MOST_FILES`."""
    out: dict = {}
    for top, dirs, names in os.walk(directory):
        for name in names:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 20), b""):
                        digest.update(block)
            except OSError:
                continue
            out[os.path.relpath(path, directory)] = [st.st_dev, st.st_ino, st.st_size,
                                                     digest.hexdigest()]
            if len(out) >= MOST_FILES:
                out[""] = [0, 0, 0, "too many files"]
                return out
    return out


def made(before: dict, after: dict) -> list:
    """The files of ``after`` that a save created or changed: another inode or other bytes
    than in ``before``."""
    return sorted(p for p, f in after.items() if p and (
        p not in before or before[p][:2] != f[:2] or before[p][3] != f[3]))


def _trial(save, load, seed, d, numel, prepare, observe=False):
    """Step 1 saved in a child; in a second child, ``prepare(say)`` then step 2's save (which
    may be killed); then, here, a load, a save of step 3 and another load (every save with
    ``keep=1``). With ``observe``: the folder's files before and after step 2's save, and the
    flushes the child reported (lines ``synced dev ino size``)."""
    first, how, _ = run_child(
        lambda say: save(d, E.checkpoint_state(1, seed, numel), 1, KEEP_KILLED))
    if how != "exit code 0":
        why = next((x[6:] for x in first if x.startswith("error ")), how)
        return {"setup": f"save_checkpoint of step 1 (no kill) failed: {why}"}

    def body(say):
        prepare(say)
        say("go")
        save(d, E.checkpoint_state(2, seed, numel), 2, KEEP_KILLED)
        say("saved")
    before = files(d) if observe else None
    lines, how, stamps = run_child(body, on_go=getattr(prepare, "on_go", None))
    if "go" not in lines:
        return {"setup": f"the grader could not prepare the kill: the child {how}"}
    out = {"ended": how, "saved": "saved" in lines,
           "seconds": stamps["saved"] - stamps["go"] if "saved" in stamps else None,
           "error": next((x[6:] for x in lines if x.startswith("error ")), None),
           "events": [x[6:] for x in lines if x.startswith("event ")][:1000]}
    if observe:
        synced = []
        for line in lines:
            if line.startswith("synced ") and len(synced) < 1000:
                try:
                    synced.append([int(x) for x in line.split()[1:4]])
                except ValueError:
                    pass
        out.update(before=before, after=files(d), synced=synced)
    out["loaded"] = load_into_blank(load, d, numel)
    try:
        save(d, E.checkpoint_state(3, seed, numel), 3, KEEP_KILLED)
        out["then"] = load_into_blank(load, d, numel)
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        out["then"] = {"error": "save_checkpoint of the next step raised " + _error(exc)}
    return out


def probe_round_trip(ns, seed):
    """load_latest on a folder that does not exist and on an empty one; then three saves (the
    default keep) and one load."""
    save, load = _functions(ns)
    root = tempfile.mkdtemp(prefix="a9-ckpt-")
    try:
        missing = load_into_blank(load, os.path.join(root, "nothing-here"), 1000)
        os.mkdir(os.path.join(root, "empty"))
        empty = load_into_blank(load, os.path.join(root, "empty"), 1000)
        d = os.path.join(root, "run")
        for step in (1, 2, 3):
            save(d, E.checkpoint_state(step, seed), step)
        return {"missing": missing, "empty": empty, "latest": load_into_blank(load, d, 1000)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def probe_commit_kills(ns, seed, most=KILL_CALLS):
    """An unkilled save of step 2 that reports its calls and its flushes; then a kill before
    and after each of its first ``most`` file-system calls."""
    save, load = _functions(ns)
    root = tempfile.mkdtemp(prefix="a9-kill-")
    try:
        def counting(say):
            install_hooks(None, lambda name: say("event " + name),
                          lambda dev, ino, size: say(f"synced {dev} {ino} {size}"))
        trials = [_trial(save, load, seed, os.path.join(root, "count"), 1000, counting,
                         observe=True)]
        events = trials[0].get("events", [])
        for k in range(min(len(events), most)):
            for when in ("before", "after"):
                def plan(say, k=k, when=when):
                    install_hooks((k, when), lambda name: say("event " + name))
                trial = _trial(save, load, seed, os.path.join(root, f"{k}-{when}"), 1000, plan)
                trials.append(dict(trial, kill=f"{when} call {k + 1} ({events[k]})", call=k,
                                   when=when))
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


def _damage(directory, relative) -> bool:
    """The byte at ``size // 2`` of the file replaced by its complement; False for an empty
    file or one that is gone."""
    path = os.path.join(directory, relative)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if not size:
                return False
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    except OSError:
        return False
    return True


def probe_keep(ns, seed, numel):
    """Steps 1 to 5 saved with keep=2 (the folder's files before and after each save); a load;
    each file step 5's save made damaged alone and a load (then put back); all of them damaged
    and a load; then those of step 4 too and a load."""
    save, load = _functions(ns)
    root = tempfile.mkdtemp(prefix="a9-keep-")
    try:
        d = os.path.join(root, "run")
        by_step, sizes, now = {}, {}, {}
        for step in range(1, 6):
            before = now
            save(d, E.checkpoint_state(step, seed, numel), step, 2)
            now = files(d)
            by_step[step] = made(before, now)
            sizes[step] = sum(f[2] for p, f in now.items() if p)
        out = {"sizes": {"1": sizes[1], "5": sizes[5]}, "files": sorted(p for p in now if p),
               "latest": load_into_blank(load, d, numel)}
        out["alone"] = []
        for p in by_step[5]:  # each file alone, then put back (the flip undoes itself)
            if _damage(d, p):
                out["alone"].append({"files": [p], "loaded": load_into_blank(load, d, numel)})
                _damage(d, p)
        fifth = [p for p in by_step[5] if _damage(d, p)]
        out["damaged"] = [{"files": fifth, "loaded": load_into_blank(load, d, numel)}]
        fourth = [p for p in by_step[4] if p not in by_step[5] and _damage(d, p)]
        out["damaged"].append({"files": fourth, "loaded": load_into_blank(load, d, numel)})
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
