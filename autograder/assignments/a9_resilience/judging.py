"""Assignment 9's judgements of checkpoints (Parts 2 and 4), in the grader's process: what the
probes of :mod:`.saving` and :mod:`.probes` report, validated (it comes from the sandbox) and
compared with the released text's contract. Used by :mod:`.checks`.
"""
from __future__ import annotations

import torch

from autograder.checking.probes import plain

from . import expected as E
from .saving import KILL_CALLS, MOST_FILES, made

TAMPERED = "the reply was tampered with"


def value(desc):
    """The plain value of a probe's description (types kept apart: 1.0 is not 1)."""
    assert isinstance(desc, dict), TAMPERED
    t, v = desc.get("t"), desc.get("v")
    if t == "dict":
        return {k: value(x) for k, x in v.items()}
    if t in ("list", "tuple"):
        return [value(x) for x in v] if t == "list" else ("tuple", [value(x) for x in v])
    if t in ("int", "str", "bool", "None"):
        return v
    return f"<{t}>" if t != "float" else ("float", v)


def _unchanged(state, numel) -> bool:
    """``state`` (a snapshot) is still the blank state load_latest was given."""
    blank = E.blank_state(numel)
    if not isinstance(state, dict) or set(state) != set(blank):
        return False
    for k, v in blank.items():
        got = state[k]
        if not isinstance(got, dict):
            return False
        if isinstance(v, torch.Tensor):
            t = got.get("tensor")
            if not (isinstance(t, torch.Tensor) and t.dtype == v.dtype and t.shape == v.shape
                    and torch.equal(t, v)):
                return False
        elif "value" not in got or value(got["value"]) != value(plain(v)):
            return False
    return True


def judge_load(reply, seed, steps, what, numel=1000, hint="a half-written or mixed checkpoint?",
               or_none=False):
    """The load returned one of ``steps`` and left exactly that step's values in the state
    (``or_none``: or returned None and left the state as it was)."""
    assert isinstance(reply, dict), TAMPERED
    if "error" in reply:
        raise AssertionError(f"load_latest raised {reply['error']} {what}")
    step = reply["step"]
    assert isinstance(step, dict), TAMPERED
    if or_none and step.get("t") == "None":
        assert _unchanged(reply["state"], numel), (
            f"load_latest returned None {what}, but changed the state it was given (with no "
            "intact checkpoint it must leave it as it was)")
        return
    if not steps:
        expected = "None (there is no checkpoint)"
    elif len(steps) == 1 and not or_none:
        expected = f"{steps[0]}"
    else:
        expected = (f"one of the steps {steps}" + (" or None" if or_none else "")
                    + " (the latest complete and intact checkpoint)")
    assert step.get("t") == "int" and step.get("v") in steps, (
        f"load_latest returned {value(step)} {what}; expected {expected}")
    want, state = E.checkpoint_state(step["v"], seed, numel), reply["state"]
    assert isinstance(state, dict) and set(state) == set(want), (
        f"after load_latest {what} the state has the keys {sorted(state)}; expected "
        f"{sorted(want)}")
    for k, v in want.items():
        got = state[k]
        if isinstance(v, torch.Tensor):
            t = got.get("tensor") if isinstance(got, dict) else None
            ok = (isinstance(t, torch.Tensor) and t.dtype == v.dtype and t.shape == v.shape
                  and torch.equal(t, v))
        else:
            ok = isinstance(got, dict) and "value" in got and value(got["value"]) == value(plain(v))
        assert ok, (f"after load_latest {what}, state['{k}'] is not what step {step['v']} saved "
                    f"(exactly: tensors bitwise with their dtype, Python values equal; {hint})")


def judge_trials(trials, seed, numel):
    """After each kill: step 1 or 2 (2 if the save had returned), and a save of step 3 works."""
    assert isinstance(trials, list) and trials, TAMPERED
    for trial in trials:
        assert isinstance(trial, dict), TAMPERED
        kill = trial.get("kill", "not killed")
        assert "setup" not in trial, trial.get("setup")
        if trial["ended"] == "hung":
            raise AssertionError(f"save_checkpoint did not return within the probe's limit "
                                 f"({kill})")
        if kill.startswith("not killed"):
            assert trial["saved"], (f"save_checkpoint of step 2 (no kill) failed: "
                                    f"{trial['error'] or trial['ended']}")
            steps, after = [2], f"after step 2's save returned ({kill})"
        elif trial["saved"]:
            steps, after = [2], f"after step 2's save returned before its kill ({kill})"
        else:
            steps = [1, 2]
            after = f"after step 2's save was stopped ({kill}; the child {trial['ended']})"
        judge_load(trial["loaded"], seed, steps, after + ", both saved with keep=1", numel)
        then = trial["then"]
        assert "error" not in then or "load_latest" in then["error"], \
            f"{then.get('error')} ({after})"
        judge_load(then, seed, [3], f"{after} and step 3 was saved", numel)


def _step_loaded(trial):
    """The step load_latest returned after a save that was killed (None if it was not)."""
    if trial.get("saved") is not False:
        return None
    loaded = trial.get("loaded")
    step = loaded.get("step") if isinstance(loaded, dict) else None
    return step.get("v") if isinstance(step, dict) and step.get("t") == "int" else None


def judge_commit(trials):
    """Among the calls killed before and after, one commits: killed just before it, step 1
    loads; just after it, step 2."""
    events = trials[0].get("events")
    assert isinstance(events, list) and all(isinstance(e, str) for e in events), TAMPERED
    assert events, ("save_checkpoint made no call to open, os.open, os.replace, os.rename, "
                    "os.fsync, ... from Python: the text asks for a save that commits through "
                    "one of them")
    loads = {}
    for trial in trials[1:]:
        assert trial.get("when") in ("before", "after") and type(trial.get("call")) is int, \
            TAMPERED
        loads[(trial["call"], trial["when"])] = _step_loaded(trial)
    for k in range(min(len(events), KILL_CALLS)):
        if loads.get((k, "before")) == 1 and loads.get((k, "after")) == 2:
            return k
    calls = ", ".join(f"{k + 1}. {e}" for k, e in enumerate(events[:KILL_CALLS]))
    raise AssertionError(
        f"no call among the first {KILL_CALLS} that step 2's save makes to the listed "
        "functions is its commit (killed just before it, load_latest gives step 1; just after "
        f"it, step 2): the save must commit through one of them. Its calls: {calls}"
        + (f" ... ({len(events)} in all)" if len(events) > KILL_CALLS else ""))


def _listing(desc, where):
    assert isinstance(desc, dict) and all(
        isinstance(p, str) and isinstance(f, list) and len(f) == 4
        and all(type(x) is int for x in f[:3]) and isinstance(f[3], str)
        for p, f in desc.items()), TAMPERED
    assert "" not in desc, f"the checkpoint folder holds more than {MOST_FILES} files {where}"
    return desc


def judge_flushes(trial):
    """Every non-empty file an unkilled save created or changed, still there when it returned,
    was flushed (os.fsync, os.fdatasync) with its final size."""
    before = _listing(trial.get("before"), "before step 2's save")
    after = _listing(trial.get("after"), "after step 2's save")
    synced = trial.get("synced")
    assert isinstance(synced, list), TAMPERED
    flushed: dict = {}
    for entry in synced:
        assert isinstance(entry, list) and len(entry) == 3 and all(
            type(x) is int for x in entry), TAMPERED
        flushed.setdefault((entry[0], entry[1]), set()).add(entry[2])
    for path in made(before, after):
        dev, ino, size, _ = after[path]
        if not size:
            continue
        sizes = flushed.get((dev, ino))
        assert sizes, (
            f"save_checkpoint of step 2 returned without flushing {path!r} ({size} bytes, a file "
            "it created or changed) with os.fsync or os.fdatasync (the grader observes "
            "os.fsync(fd) and os.fdatasync(fd) looked up on os at the call)")
        assert size in sizes, (
            f"save_checkpoint of step 2 flushed {path!r} when it held {max(sizes)} bytes; it "
            f"holds {size} when the save returns: written after its last flush (a Python file "
            "object's buffer not flushed before os.fsync?)")


def judge_keep(reply, seed, numel):
    """Steps 1 to 5 with keep=2: step 5 loads; the files hold less than 3 checkpoints; with
    each of step 5's files damaged alone, then all of them, 4 or 5 exactly; with step 4's
    damaged too, None or exact values."""
    assert isinstance(reply, dict), TAMPERED
    judge_load(reply["latest"], seed, [5], "after saving steps 1 to 5 with keep=2", numel)
    sizes, names = reply["sizes"], reply["files"]
    assert isinstance(sizes, dict) and all(type(sizes.get(k)) is int for k in ("1", "5")), \
        TAMPERED
    assert isinstance(names, list) and all(isinstance(n, str) for n in names), TAMPERED
    one, five = sizes["1"], sizes["5"]
    assert one > 0, "save_checkpoint of step 1 left no byte in a file under the folder"
    assert five < 3 * one, (
        f"after saving steps 1 to 5 with keep=2, the regular files under the folder hold {five} "
        f"bytes, {five / one:.2f} times the {one} they held after step 1's save: expected less "
        f"than 3 times (the 2 latest checkpoints). Files: {names[:12]}")
    damaged = reply["damaged"]
    assert isinstance(damaged, list) and len(damaged) == 2 and all(
        isinstance(d, dict) and isinstance(d.get("files"), list)
        and all(isinstance(n, str) for n in d["files"]) for d in damaged), TAMPERED
    alone = reply["alone"]
    assert isinstance(alone, list) and len(alone) <= MOST_FILES and all(
        isinstance(d, dict) and isinstance(d.get("files"), list) and len(d["files"]) == 1
        and isinstance(d["files"][0], str) for d in alone), TAMPERED
    hint = "a damaged file loaded: does load_latest check what it reads?"
    for one_file in alone:
        judge_load(one_file["loaded"], seed, [4, 5], "after the byte in the middle of "
                   f"{one_file['files'][0]!r} alone (a file step 5's save created or changed) "
                   "was flipped", numel, hint)
    fifth, fourth = damaged
    judge_load(fifth["loaded"], seed, [4, 5], "after the byte in the middle of each file step "
               f"5's save created or changed was flipped ({fifth['files'][:6]})", numel, hint)
    judge_load(fourth["loaded"], seed, [4, 5], "after the files of step 5's save and then those "
               f"of step 4's ({fourth['files'][:6]}) were damaged", numel, hint, or_none=True)


def judge_overlap(reply, seed, numel):
    """Two saves pending at once: neither wait() raised, and step 3 loads exactly."""
    assert isinstance(reply, dict), TAMPERED
    if "error" in reply:
        raise AssertionError(reply["error"])
    errors = reply["errors"]
    assert isinstance(errors, dict), TAMPERED
    where = ("with two saves pending at once (async_save of step 2, its writer held right after "
             "its first open returned, then async_save of step 3, then the first writer "
             "released)")
    for which, step in (("first", 2), ("second", 3)):
        assert which not in errors, (f"wait() of the {which} async_save (step {step}) raised "
                                     f"{errors[which]} {where}")
    judge_load(reply["loaded"], seed, [3], f"{where} and both wait()s", numel)
