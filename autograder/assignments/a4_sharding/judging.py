"""How Assignment 4's checks judge plain answers (ints, pairs, lists of indices, ValueErrors)
that probes bring back from calls in the sandbox: on the public fixed cases (data:
``public_cases.json``) and on the hidden checks' random cases (from the answer key, where it
is); and the multi-process runs the classes' checks share; runs in the grader."""
from __future__ import annotations

import json
import random
from pathlib import Path

from autograder.checking.expect import fresh_generator
from autograder.checking.timeouts import call_timeout
from autograder.keys import answer_key

from .probes import probe_calls
from .spec import SPEC


def seeded_rng() -> tuple[random.Random, int]:
    """A Python generator from the run's seed (cases change every run; --seed repeats them)."""
    _, seed = fresh_generator()
    return random.Random(seed), seed


def plain(desc, what: str):
    """A described int, or list/tuple of them (nested), back as plain Python; anything else
    fails with what it was."""
    assert isinstance(desc, dict), f"{what}: the probe's reply was tampered with"
    if desc.get("kind") in ("list", "tuple"):
        return [plain(d, what) for d in desc["items"]]
    value = desc.get("value")
    if desc.get("kind") == "plain" and type(value) is int:
        return value
    got = desc.get("type") or type(value).__name__ if desc.get("kind") != "tensor" else "a tensor"
    raise AssertionError(f"{what} should be made of ints, got {got}")


def call_cases(student, name: str, cases) -> list:
    replies = student.call(probe_calls, name, cases)
    assert isinstance(replies, list) and len(replies) == len(cases), \
        f"{name}: the probe's reply was tampered with"
    return replies


def show(name: str, args, kwargs) -> str:
    shown = [repr(a) if not isinstance(a, list) or len(a) < 12 else f"[{len(a)} sizes]"
             for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(shown)})"


def returned_values(student, name: str, cases) -> list[tuple[str, dict, object]]:
    """(the call as text, its described result, the result as plain ints) of each case, in
    order; the first case that raises fails the check with its message."""
    out = []
    for (args, kwargs), reply in zip(cases, call_cases(student, name, cases)):
        call = show(name, args, kwargs)
        assert "returned" in reply, f"{call} raised {reply.get('raised')}: {reply.get('message')}"
        out.append((call, reply["returned"], plain(reply["returned"], f"{call}'s result")))
    return out


def judge_values(student, name: str, cases, want: list, seed: int | None, *,
                 pair: bool = False, why: list[str] | None = None):
    """Each case's result equals ``want``'s; ``why``: what each expected value is, in words."""
    for k, ((call, returned, got), w) in enumerate(zip(returned_values(student, name, cases),
                                                        want)):
        if pair:
            assert returned.get("kind") in ("tuple", "list") and len(got) == 2, \
                f"{call} should return a pair (start, end), got {got!r}"
            got = tuple(got)
        because = f": {why[k]}" if why else ""
        from_seed = f" (cases from seed {seed})" if seed is not None else ""
        assert got == w, f"{call} returned {got!r}, expected {w!r}{because}{from_seed}"


def judge_value_errors(student, name: str, cases):
    for (args, kwargs), reply in zip(cases, call_cases(student, name, cases)):
        call = show(name, args, kwargs)
        if "returned" in reply:
            raise AssertionError(f"{call} returned instead of raising ValueError")
        assert reply.get("is_value_error") is True, \
            f"{call} raised {reply.get('raised')}, expected ValueError"


#: The public checks' fixed cases and their expected values, as data (written from the answer
#: key, ``solutions/a4_sharding/answer_key.py``; a test keeps the two equal).
PUBLIC_CASES = Path(__file__).with_name("public_cases.json")


def public_cases(name: str) -> tuple[list, list]:
    """(cases ``(args, kwargs)``, expected values) of ``name``'s public fixed cases."""
    rows = json.loads(PUBLIC_CASES.read_text())[name]
    return [(tuple(r["args"]), dict(r["kwargs"])) for r in rows], [r["expected"] for r in rows]


def judge_hidden_cases(student, name: str, *, pair: bool = False) -> None:
    """``name`` on fresh random cases from the run's seed against the answer key (a hidden
    check: the harness SKIPs it where the key is absent)."""
    key = answer_key(SPEC.assignment)
    assert key is not None, "a hidden check ran without the answer key"
    rng, seed = seeded_rng()
    cases, want = key.hidden_cases(name, rng)
    judge_values(student, name, cases, want, seed, pair=pair)


def runs_per_world_size(student, key: str, owner: str, probe, *args,
                        worlds=(1, 2, 3)) -> tuple[int, dict]:
    """(seed, {world size: the probe's reply}) of one run per world size of ``probe``, shared
    by a class's checks (and the byte counts' comparisons with them); the probes run case by case (:mod:`.cases`), so that a case that
    raises fails only the checks that use it; a failure of the run itself (a hang) is
    remembered and fails each of them alike. Each call may take what check ``owner`` allows
    (calibrated or the spec's), whichever check starts the run."""
    def run():
        _, seed = fresh_generator()
        limit = call_timeout(SPEC.check(owner), student.calibration)
        return seed, {w: student.call(probe, w, seed, *args, timeout=limit)
                      for w in worlds}
    return student.shared(key, run)
