"""Assignment 8's judges of the cost model's replies (no probes, no key: checks.py calls them
with the expected values): the exact bytes of ``per_rank_memory``; ``step_time``'s seconds
within float64 rounding, a failure naming every key that differs and the term where the
difference starts (a wrong bandwidth shows in its own term, not only in the bubble, the first key
of the dict); the dict and error replies of all three. A hidden check's failure shows its inputs
and the submission's values, never the expected ones (its fixed cases are the instructor's)."""
from __future__ import annotations

import math

from . import expected as E

#: step_time's tolerance, relative to the exact value (fractions of the float inputs). Why:
#: every term is a product and quotient of exact integers and the float inputs, at most ~10
#: roundings of 2**-53 each in any order, and the terms are positive (a sum without
#: cancellation), so correct float code lands within ~2e-15 of the exact value; 1e-12 leaves a
#: factor of ~500 for that, and no mistake in a formula's counts or factors comes that close. A
#: key that is exactly 0 (no bubble with pp = 1, no tp traffic with tp = 1) is 0 in floats too;
#: 1e-15 of the total is allowed there, to be safe.
TIME_RTOL = 1e-12

#: Said instead of the expected values in a hidden check's failure (its fixed cases are the
#: instructor's: a message shows the inputs and the submission's values, never the answer).
NOT_SHOWN = "the expected values of hidden cases are not shown"


def show_inputs(model, par, hw=None) -> str:
    """The inputs of a case, as a failure names them."""
    return f"model_cfg={model}, par_cfg={par}" + (f", hw_cfg={hw}" if hw else "")


def result_of(reply, what, inputs) -> dict:
    """The result's description, or a failure that says what it raised (inputs last)."""
    assert isinstance(reply, dict), "the reply was tampered with"
    if "error" in reply:
        raise AssertionError(f"{what} raised {reply['error']} (for {inputs})")
    return reply["result"]


def dict_of(desc, what, keys, inputs) -> dict:
    """The items of a reply that must be a dict with exactly ``keys`` (str)."""
    assert desc.get("t") == "dict", \
        f"{what} should return a dict; got {desc.get('t')} (for {inputs})"
    got = desc["v"]
    assert list(desc.get("keys", [])) == ["str"] * len(got) and set(got) == set(keys), (
        f"{what} returned a dict with the keys {sorted(got)}; expected exactly {list(keys)}")
    return got


# ---------------------------------------------------------------------------- per_rank_memory

def judge_memory(results, cases, wants, where, hidden=False):
    """Each of ``results`` against ``wants``, exactly (``where``: which cases, for messages;
    ``hidden``: the expected values are not shown)."""
    assert len(results) == len(cases) == len(wants), "the reply was tampered with"
    for (model, par), reply, want in zip(cases, results, wants):
        inputs = show_inputs(model, par)
        got = dict_of(result_of(reply, "per_rank_memory", inputs), "per_rank_memory",
                      E.MEMORY_KEYS, inputs)
        for key in E.MEMORY_KEYS:
            items = got[key]
            assert items.get("t") in ("list", "tuple") and len(items["v"]) == par["pp"], (
                f"per_rank_memory(...)['{key}'] should be a list of pp = {par['pp']} ints (one "
                f"per stage), for {inputs}")
            values = [v.get("v") if v.get("t") == "int" else v.get("t") for v in items["v"]]
            expected = f"; {NOT_SHOWN}" if hidden else f"; expected {want[key]}"
            assert values == want[key], (
                f"per_rank_memory(...)['{key}'] is {values}{expected} (bytes per rank of each "
                f"stage, exact ints) for {inputs} ({where})")


# ---------------------------------------------------------------------------- step_time

#: step_time's terms, those that the others add up first; what each is made of, and what the
#: bubble and the total include: a failure names the keys that differ, and where it starts (a
#: wrong bandwidth shows in its own term, not as a wrong bubble, the first key of the dict).
TIME_ORDER = ("compute", "tp", "dp", "pp", "bubble", "total")
TIME_TERMS = {
    "compute": "m * c: the stages' FLOPs, the slowest of them, or flops",
    "tp": "m * t_tp: the number of all-reduces, their bytes, or bw_tp",
    "dp": "the stages' parameters P_i, k, or bw_dp",
    "pp": "the number of sends, their bytes, or bw_pp",
    "bubble": "(pp - 1) * (c + t_tp) itself",
    "total": "the sum of the five terms itself",
}
TIME_INCLUDES = {"bubble": {"compute", "tp"}, "total": {"compute", "tp", "dp", "pp", "bubble"}}


def time_close(v, w, total) -> bool:
    """``v`` within TIME_RTOL of ``w`` (see there; ``total``: the expected total)."""
    return math.isfinite(v) and abs(v - w) <= TIME_RTOL * (abs(w) + 1e-3 * total)


def bandwidth_hint(key, v, w, hw) -> str:
    """Where ``key``'s value is the expected one times inter_bw / intra_bw (or its inverse):
    which bandwidth its groups took (public cases only: it gives the expected value away)."""
    if key not in ("tp", "dp", "pp") or not w or not math.isfinite(v):
        return ""
    intra, inter = hw["intra_bw"], hw["inter_bw"]
    took = next((bw for bw, ratio in (("intra_bw", inter / intra), ("inter_bw", intra / inter))
                 if intra != inter and math.isclose(v / w, ratio, rel_tol=1e-9)), None)
    if took is None:
        return ""
    ratio, rule = ("inter_bw / intra_bw", "inter_bw") if took == "intra_bw" else \
        ("intra_bw / inter_bw", "intra_bw")
    return (f"\n['{key}'] is the expected value times {ratio}: it took {took} where the rule "
            f"gives {rule} (bw_{key} is intra_bw only if every {key} group has all of its ranks "
            "on one node, rank r on node r // node_size)")


def time_failure(got, want, wrong, inputs, where, hw, hidden) -> str:
    """The message of a step_time result whose keys ``wrong`` differ: each with its value (and
    the expected one, on public cases), then the keys where the difference starts."""
    lines = [f"  ['{k}'] is {got[k]!r}" + ("" if hidden else f"; expected {float(want[k])!r}")
             for k in wrong]
    starts = [k for k in wrong if not TIME_INCLUDES.get(k, set()) & set(wrong)]
    follow = [f"['{k}']" for k in wrong if k not in starts]
    named = ", ".join(f"['{k}']" for k in wrong)
    message = (f"step_time(...) differs from the cost model in {named}, starting at "
               f"{', '.join(f'[{k!r}]' for k in starts)} (seconds), for {inputs} ({where}"
               + (f"; {NOT_SHOWN}" if hidden else "") + "):\n" + "\n".join(lines)
               + "\nWhere it starts: " + "; ".join(f"['{k}'] ({TIME_TERMS[k]})" for k in starts))
    if follow:
        verb = "includes" if len(follow) == 1 else "include"
        message += f"; {' and '.join(follow)} {verb} {'it' if len(starts) == 1 else 'them'}"
    if not hidden:
        message += "".join(bandwidth_hint(k, got[k], float(want[k]), hw) for k in starts)
    return message


def judge_time(results, cases, wants, where, hidden=False):
    """Each of ``results`` against ``wants`` (floats or exact Fractions), within TIME_RTOL;
    a failure names every key that differs (``hidden``: without the expected values)."""
    assert len(results) == len(cases) == len(wants), "the reply was tampered with"
    for (model, par, hw), reply, want in zip(cases, results, wants):
        inputs = show_inputs(model, par, hw)
        got = dict_of(result_of(reply, "step_time", inputs), "step_time", E.TIME_KEYS, inputs)
        for key in E.TIME_KEYS:
            assert got[key].get("t") in ("float", "int"), (
                f"step_time(...)['{key}'] should be a float (seconds); got {got[key].get('t')}"
                f" (for {inputs})")
        values = {k: got[k].get("v") for k in E.TIME_KEYS}
        total = float(want["total"])
        wrong = [k for k in TIME_ORDER if not time_close(values[k], float(want[k]), total)]
        assert not wrong, time_failure(values, want, wrong, inputs, where, hw, hidden)
