"""Assignment 9's answer key: the instructor's only (``solutions/`` never ships; see
:mod:`autograder.keys`).

The reference ``diagnose``, ``save_checkpoint``, ``load_latest`` and ``async_save``, written
from the released text; the generator of the hidden random traces (a clean run of random calls
on random groups, then one planted fault) whose expected values need the reference. The public fixed cases and
their expected values are :func:`public_cases`, stored as data in
``autograder/assignments/a9_resilience/public_cases.json`` (regenerate it with ``python
solutions/a9_resilience/answer_key.py``; a test keeps the two equal).

Imported only in the grader's own process (checks.py), never in the sandbox.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import random
import threading
import uuid
from collections import Counter
from pathlib import Path

import torch

from autograder.assignments.a9_resilience import expected as E

OPS = E.OPS
P2P = ("SEND", "RECV")
KEYS = ("seq", "group", "op", "shapes", "dtype", "peer", "state")


# ---------------------------------------------------------------------------- diagnose

def _members(label, rank, n):
    try:
        members = [int(x) for x in label.split(",")]
    except (AttributeError, ValueError):
        raise ValueError(f"group {label!r} is not comma-joined ranks") from None
    if members != sorted(set(members)) or not members or members[0] < 0 or members[-1] >= n:
        raise ValueError(f"group {label!r}: ranks must be sorted, distinct, in 0..{n - 1}")
    if rank not in members:
        raise ValueError(f"rank {rank} has an entry on group {label!r}, of which it is no member")
    return members


def _table(traces):
    """``{group: {rank: [entry by seq]}}``; ValueError for anything malformed."""
    if not isinstance(traces, (list, tuple)):
        raise ValueError("traces should be a list with one list of entries per rank")
    n, table, members = len(traces), {}, {}
    for rank, trace in enumerate(traces):
        if not isinstance(trace, (list, tuple)):
            raise ValueError(f"traces[{rank}] should be a list of entries")
        for e in trace:
            if not isinstance(e, dict) or set(e) != set(KEYS):
                raise ValueError(f"rank {rank}: an entry should be a dict with keys {KEYS}: {e!r}")
            if e["op"] not in OPS:
                raise ValueError(f"rank {rank}: unknown op {e['op']!r}")
            if e["state"] not in ("started", "completed"):
                raise ValueError(f"rank {rank}: unknown state {e['state']!r}")
            if not isinstance(e["shapes"], list) or not all(
                    isinstance(s, list) and all(type(d) is int for d in s) for s in e["shapes"]):
                raise ValueError(f"rank {rank}: shapes should be a list of lists of ints")
            if not isinstance(e["dtype"], str):
                raise ValueError(f"rank {rank}: dtype should be a string")
            group = e["group"]
            members[group] = _members(group, rank, n)
            if e["op"] in P2P:
                if type(e["peer"]) is not int or e["peer"] == rank or e["peer"] not in members[group]:
                    raise ValueError(f"rank {rank}: a {e['op']} needs a peer in group {group!r} "
                                     f"other than itself; got {e['peer']!r}")
            elif e["peer"] is not None:
                raise ValueError(f"rank {rank}: a {e['op']} has no peer; got {e['peer']!r}")
            calls = table.setdefault(group, {}).setdefault(rank, [])
            if type(e["seq"]) is not int or e["seq"] != len(calls):
                raise ValueError(f"rank {rank}: on group {group!r} seq {e['seq']!r} follows "
                                 f"{len(calls)} call(s); seqs go 0, 1, 2, ... in order")
            calls.append(e)
    return table, members


def _signature(e):
    return (e["op"], tuple(map(tuple, e["shapes"])), e["dtype"])


def _collective(group, members, calls, seq):
    here = {r: calls.get(r, [])[seq] for r in members if seq < len(calls.get(r, []))}
    if not here or here[min(here)]["op"] in P2P:
        return None
    absent = [r for r in members if r not in here]
    if absent:
        return {"group": group, "seq": seq, "kind": "missing", "ranks": absent}
    counts = Counter(_signature(e) for e in here.values())
    top = max(counts.values())
    ref = next(_signature(here[r]) for r in members if counts[_signature(here[r])] == top)
    wrong = [r for r in members if _signature(here[r]) != ref]
    if not wrong:
        return None
    majority = [r for r in members if r not in wrong]

    def at(r, s):
        c = calls.get(r, [])
        return _signature(c[s]) if s < len(c) else None

    nxt = {at(r, seq + 1) for r in majority}
    if (len(nxt) == 1 and None not in nxt and
            all(at(r, seq) == next(iter(nxt)) and at(r, seq + 1) == ref for r in wrong)):
        kind = "order"
    elif any(here[r]["op"] != ref[0] for r in wrong):
        kind = "op"
    elif any(_signature(here[r])[1] != ref[1] for r in wrong):
        kind = "shape"
    else:
        kind = "dtype"
    return {"group": group, "seq": seq, "kind": kind, "ranks": wrong}


def _point_to_point(group, members, calls):
    found = []
    for a in members:
        for b in members:
            if a == b:
                continue
            sends = [e for e in calls.get(a, []) if e["op"] == "SEND" and e["peer"] == b]
            recvs = [e for e in calls.get(b, []) if e["op"] == "RECV" and e["peer"] == a]
            for k in range(max(len(sends), len(recvs))):
                s = sends[k] if k < len(sends) else None
                r = recvs[k] if k < len(recvs) else None
                if s is None or r is None:
                    found.append({"group": group, "seq": (s or r)["seq"], "kind": "missing",
                                  "ranks": [a if s is None else b]})
                elif s["shapes"] != r["shapes"] or s["dtype"] != r["dtype"]:
                    found.append({"group": group, "seq": min(s["seq"], r["seq"]),
                                  "kind": "shape" if s["shapes"] != r["shapes"] else "dtype",
                                  "ranks": sorted([a, b])})
    return found


def diagnose(traces):
    table, members = _table(traces)
    found = []
    for group, calls in table.items():
        found += _point_to_point(group, members[group], calls)
        for seq in range(max(len(c) for c in calls.values())):
            d = _collective(group, members[group], calls, seq)
            if d:
                found.append(d)
    return min(found, key=lambda d: (d["seq"], d["group"], d["ranks"]), default=None)


# ---------------------------------------------------------------------------- checkpoints

def save_checkpoint(directory, state, step, keep=2):
    """One file a checkpoint, named by its step and the sha256 of its bytes; written under a
    name no other save uses, flushed, committed by os.replace; then the older ones removed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"step": step, "state": state}, buffer)
    data = buffer.getvalue()
    tmp = directory / f".tmp-{step}-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / f"step-{step:012d}-{hashlib.sha256(data).hexdigest()}.pt")
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)


def load_latest(directory, state):
    directory = Path(directory)
    for path in sorted(directory.glob("step-*.pt"), reverse=True) if directory.is_dir() else []:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        if hashlib.sha256(data).hexdigest() == path.stem.rsplit("-", 1)[-1]:
            saved = torch.load(io.BytesIO(data), weights_only=False)
            state.update(saved["state"])
            return saved["step"]
    return None


def async_save(directory, state, step):
    """A copy staged here; the save in a thread of its own (several may run at once: their
    temporary names differ, and each removes only checkpoints older than its last ``keep``)."""
    staged = {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
              for k, v in state.items()}
    errors = []

    def write():
        try:
            save_checkpoint(directory, staged, step)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            errors.append(exc)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()

    class Pending:
        def wait(self):
            thread.join()
            if errors:
                raise errors[0]
    return Pending()


# ---------------------------------------------------------------------------- hidden cases

def _random_clean(g: random.Random):
    """Random traces of a clean run: 3-5 ranks, collectives on the world and on subgroups,
    point-to-point on its own group."""
    n = g.randint(3, 5)
    traces = [[] for _ in range(n)]
    world = ",".join(map(str, range(n)))
    sub = ",".join(map(str, sorted(g.sample(range(n), 2))))
    pair = sub
    while pair == sub:  # a group carries collectives or point-to-point calls, not both
        pair = ",".join(map(str, sorted(g.sample(range(n), 2))))
    counters = {}

    def add(rank, group, op, shapes, dtype, peer=None):
        seq = counters.get((rank, group), 0)
        counters[(rank, group)] = seq + 1
        traces[rank].append({"seq": seq, "group": group, "op": op, "shapes": shapes,
                             "dtype": dtype, "peer": peer, "state": "completed"})

    for _ in range(g.randint(4, 8)):
        what = g.random()
        shapes = [[g.randint(1, 6), g.randint(1, 4)]]
        dtype = g.choice(["float32", "float64", "bfloat16"])
        op = g.choice([o for o in OPS if o not in P2P and o != "BARRIER"])
        if what < 0.55:
            for r in range(n):
                add(r, world, op, shapes, dtype)
        elif what < 0.8:
            for r in map(int, sub.split(",")):
                add(r, sub, op, shapes, dtype)
        else:
            a, b = map(int, pair.split(","))
            if g.random() < 0.5:
                a, b = b, a
            add(a, pair, "SEND", shapes, dtype, b)
            add(b, pair, "RECV", shapes, dtype, a)
    return traces


def _plant(g: random.Random, traces):
    """One fault in a copy of ``traces``: drop a call from a rank's trace (and, as a hung rank
    does, everything after it on that group), or change one call's op, shape or dtype."""
    traces = copy.deepcopy(traces)
    rank = g.randrange(len(traces))
    if not traces[rank]:
        return traces
    i = g.randrange(len(traces[rank]))
    e = traces[rank][i]
    how = g.choice(["drop", "op", "shape", "dtype"])
    if how == "drop":
        traces[rank] = [x for j, x in enumerate(traces[rank])
                        if not (x["group"] == e["group"] and x["seq"] >= e["seq"])]
    elif how == "op" and e["op"] not in P2P:
        e["op"] = next(o for o in ("ALLGATHER", "ALLREDUCE") if o != e["op"])
    elif how == "shape":
        e["shapes"] = [[d + 1 for d in s] for s in e["shapes"]]
    else:
        e["dtype"] = "float16"
    return traces


def hidden_traces(g: random.Random) -> list:
    """26 random cases: 2 clean, 8 with one planted fault each, 16 with two (which of them is
    the first divergence is then a question)."""
    cases = [_random_clean(g) for _ in range(2)]
    cases += [_plant(g, _random_clean(g)) for _ in range(8)]
    cases += [_plant(g, _plant(g, _random_clean(g))) for _ in range(16)]
    return cases


# ---------------------------------------------------------------------------- public values

def public_cases() -> dict:
    """The public fixed cases and their expected values, as stored in public_cases.json."""
    return {
        "about": ("Assignment 9's public fixed cases of diagnose: each case's traces and the "
                  "expected result (null: no divergence); generated from the instructor's "
                  "answer key. The hidden random cases are not here."),
        "diagnose": [dict(what=what, traces=traces, expected=diagnose(traces))
                     for what, traces in E.FIXED_TRACES],
    }


def public_cases_text() -> str:
    """public_cases.json's text: one case a line."""
    cases = public_cases()
    items = ",\n".join(f"  {json.dumps(case)}" for case in cases["diagnose"])
    return ("{\n" + f' "about": {json.dumps(cases["about"])},\n' + f' "diagnose": [\n{items}\n ]'
            + "\n}\n")


def write_public_cases(path: Path = E.PUBLIC_CASES_PATH) -> None:
    path.write_text(public_cases_text())


if __name__ == "__main__":
    write_public_cases()
    print(f"wrote {E.PUBLIC_CASES_PATH}")
