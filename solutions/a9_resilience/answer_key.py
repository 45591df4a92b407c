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
KEYS = ("seq", "group", "members", "op", "shapes", "dtype", "peer", "state")


# ---------------------------------------------------------------------------- diagnose

def _members(e, rank, n, members):
    """The record's members, checked (and the same as the group's other records')."""
    group, got = e["group"], e["members"]
    if not isinstance(group, str) or not group:
        raise ValueError(f"rank {rank}: group should be a non-empty string; got {group!r}")
    if (not isinstance(got, list) or not got or not all(type(r) is int for r in got)
            or got != sorted(set(got)) or got[0] < 0 or got[-1] >= n):
        raise ValueError(f"rank {rank}: members of group {group!r} should be sorted, distinct "
                         f"ranks in 0..{n - 1}; got {got!r}")
    if rank not in got:
        raise ValueError(f"rank {rank} has an entry on group {group!r}, of which it is no member")
    if members.setdefault(group, got) != got:
        raise ValueError(f"group {group!r} has members {members[group]} and {got}")
    return got


def _table(traces):
    """``{group: {rank: [entry by seq]}}`` and ``{group: members}``; ValueError for anything
    malformed."""
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
            group, ranks = e["group"], _members(e, rank, n, members)
            if e["op"] in P2P:
                if type(e["peer"]) is not int or e["peer"] == rank or e["peer"] not in ranks:
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


def _reference(members, calls, seq):
    """The most common call at ``seq`` among the members that made one (a tie: the lowest
    rank's); None when none did."""
    here = [(r, _signature(calls[r][seq])) for r in members if seq < len(calls.get(r, []))]
    counts = Counter(sig for _, sig in here)
    return next((sig for _, sig in here if counts[sig] == max(counts.values())), None)


def _collective(group, members, calls, seq):
    here = {r: calls.get(r, [])[seq] for r in members if seq < len(calls.get(r, []))}
    if not here or here[min(here)]["op"] in P2P:
        return None
    absent = [r for r in members if r not in here]
    if absent:
        return {"group": group, "seq": seq, "kind": "missing", "ranks": absent}
    ref = _reference(members, calls, seq)
    wrong = [r for r in members if _signature(here[r]) != ref]
    if not wrong:
        return None
    after = _reference(members, calls, seq + 1)
    if after is not None and all(
            seq + 1 < len(calls[r]) and _signature(here[r]) == after
            and _signature(calls[r][seq + 1]) == ref for r in wrong):
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


def group_divergences(traces):
    """``({group: its first divergence}, {group: members})``: every group's divergences, as the
    text defines them, the first of each kept (smallest seq, then ranks, then kind)."""
    table, members = _table(traces)
    firsts = {}
    for group, calls in table.items():
        found = _point_to_point(group, members[group], calls)
        for seq in range(max(len(c) for c in calls.values())):
            d = _collective(group, members[group], calls, seq)
            if d:
                found.append(d)
        if found:
            firsts[group] = min(found, key=lambda d: (d["seq"], d["ranks"],
                                                      E.KINDS.index(d["kind"])))
    return firsts, members


def diagnose(traces):
    firsts, members = group_divergences(traces)
    last = {rank: (t[-1]["group"], t[-1]["seq"]) for rank, t in enumerate(traces) if t}

    def waits_on_another(d):
        if d["kind"] != "missing":
            return False
        for rank in d["ranks"]:
            group, seq = last.get(rank, (None, -1))
            if group != d["group"] and group in firsts and seq >= firsts[group]["seq"]:
                return True
        return False

    roots = [d for d in firsts.values() if not waits_on_another(d)]
    return min(roots or firsts.values(), default=None,
               key=lambda d: (d["seq"], members[d["group"]], d["group"], d["ranks"]))


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

def _random_program(g: random.Random):
    """A random clean program: 3-6 ranks; the default group "0", a tensor-parallel-like
    partition into pairs (and a triple), another subgroup, sometimes a second group of a pair's
    ranks, a group of two for point-to-point calls (a group carries collectives or point-to-point
    calls, not both); names as torch gives them (numbers, or hashes for groups made with
    use_local_synchronization). Returns ``(n, calls)``: ``calls[rank]`` lists the calls the rank
    issues, in order, each ``(group, members, op, shapes, dtype, peer)``."""
    n = g.randint(3, 6)
    names = iter(g.sample([str(k) for k in range(1, 30)], 6) if g.random() < 0.7 else
                 ["%040x" % g.getrandbits(160) for _ in range(6)])
    ranks = g.sample(range(n), n)
    pairs = n // 2 - n % 2  # an odd number of ranks: the last three make a triple
    blocks = [ranks[2 * k:2 * k + 2] for k in range(pairs)] + ([ranks[2 * pairs:]] if n % 2 else [])
    groups = [("0", list(range(n)))] + [(next(names), sorted(b)) for b in blocks]
    side = (next(names), sorted(g.sample(range(n), g.randint(2, n - 1))))
    twin = (next(names), groups[1][1]) if g.random() < 0.5 else None
    pair = (next(names), sorted(g.sample(range(n), 2)))
    calls = [[] for _ in range(n)]

    def collective(group, op, shapes, dtype):
        for r in group[1]:
            calls[r].append((group[0], group[1], op, shapes, dtype, None))

    for _ in range(g.randint(1, 3)):  # steps
        for _ in range(g.randint(1, 2)):  # the "tensor-parallel" calls of each block
            shapes, dtype = [[g.randint(1, 6)]], g.choice(["float32", "bfloat16"])
            for block in groups[1:]:
                collective(block, g.choice(["ALLREDUCE", "ALLGATHER"]), shapes, dtype)
        extra = g.random()
        if extra < 0.3:
            collective(side, g.choice(["ALLREDUCE", "BROADCAST"]), [[2, g.randint(1, 4)]],
                       "float32")
        elif extra < 0.5 and twin is not None:
            collective(twin, "ALLREDUCE", [[3]], "float64")
        elif extra < 0.75:
            a, b = g.sample(pair[1], 2)
            shapes, dtype = [[g.randint(1, 5)]], g.choice(["float32", "float64"])
            calls[a].append((pair[0], pair[1], "SEND", shapes, dtype, b))
            calls[b].append((pair[0], pair[1], "RECV", shapes, dtype, a))
        collective(groups[0], g.choice(["ALLREDUCE", "REDUCE_SCATTER"]), [[8]], "float32")
    return n, calls


def _plant(g: random.Random, calls):
    """One fault in a copy of ``calls``: a rank stops before one of its calls (stuck in
    compute), skips one, swaps two neighbouring calls of one group, or changes one call's op,
    shape or dtype."""
    calls = copy.deepcopy(calls)
    rank = g.randrange(len(calls))
    if not calls[rank]:
        return calls
    i = g.randrange(len(calls[rank]))
    group, members, op, shapes, dtype, peer = calls[rank][i]
    how = g.choice(["stuck", "stuck", "skip", "swap", "op", "shape", "dtype"])
    if how == "stuck":
        del calls[rank][i:]
    elif how == "skip":
        del calls[rank][i]
    elif how == "swap":
        later = [j for j in range(i + 1, len(calls[rank])) if calls[rank][j][0] == group]
        if later:
            j = later[0]
            calls[rank][i], calls[rank][j] = calls[rank][j], calls[rank][i]
    elif how == "op" and op not in P2P:
        calls[rank][i] = (group, members, "BROADCAST" if op != "BROADCAST" else "ALLREDUCE",
                          shapes, dtype, peer)
    elif how == "shape":
        calls[rank][i] = (group, members, op, [[d + 1 for d in s] for s in shapes], dtype, peer)
    else:
        calls[rank][i] = (group, members, op, shapes, "float16", peer)
    return calls


def _run(calls, blocking: bool):
    """The traces of running ``calls``: every rank issues its calls in order. A call completes
    when its group's members have all issued theirs at that seq, alike (a send: when its
    receive is posted, alike); a blocking rank issues nothing after a call that never
    completes. Asynchronous ranks issue everything."""
    n = len(calls)
    traces, done, counts = [[] for _ in range(n)], [0] * n, [{} for _ in range(n)]

    def issue(r):
        group, members, op, shapes, dtype, peer = calls[r][len(traces[r])]
        seq = counts[r].get(group, 0)
        counts[r][group] = seq + 1
        traces[r].append({"seq": seq, "group": group, "members": list(members), "op": op,
                          "shapes": shapes, "dtype": dtype, "peer": peer, "state": "started"})

    def complete(r, e):
        if e["op"] in P2P:
            mine = [x for x in traces[r] if x["op"] == e["op"] and x["peer"] == e["peer"]]
            other = "RECV" if e["op"] == "SEND" else "SEND"
            theirs = [x for x in traces[e["peer"]] if x["op"] == other and x["peer"] == r]
            k = next(k for k, x in enumerate(mine) if x is e)
            return k < len(theirs) and (theirs[k]["shapes"], theirs[k]["dtype"]) == (
                e["shapes"], e["dtype"])
        at = [next((x for x in traces[m] if x["group"] == e["group"] and x["seq"] == e["seq"]),
                   None) for m in e["members"]]
        return all(x is not None and _signature(x) == _signature(e) for x in at)

    moved = True
    while moved:
        moved = False
        for r in range(n):
            while len(traces[r]) < len(calls[r]) and (not blocking or done[r] == len(traces[r])):
                issue(r)
                moved = True
        for r in range(n):
            while done[r] < len(traces[r]) and complete(r, traces[r][done[r]]):
                traces[r][done[r]]["state"] = "completed"
                done[r] += 1
                moved = True
    return traces


def hidden_traces(g: random.Random) -> list:
    """26 random cases, each run with blocking calls (a hang spreads across groups) or
    asynchronous ones: 2 clean, 8 with one planted fault each, 16 with two (which of them is
    the first divergence is then a question)."""
    def case(faults):
        n, calls = _random_program(g)
        for _ in range(faults):
            calls = _plant(g, calls)
        return _run(calls, blocking=g.random() < 0.7)

    return [case(0) for _ in range(2)] + [case(1) for _ in range(8)] + [case(2) for _ in range(16)]


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
