"""The planted faults whose traces ``diagnose`` is graded on, recorded from real gloo runs in the
grader's own process tree (never beside student code; nothing is cached on disk).

One launch of 4 processes runs every scenario in turn, each on its own new process groups with
a 1 s timeout, recorded with :func:`course.flight.record_trace`. Every call is issued
asynchronously (``async_op=True``) and waited for at the end: what each rank *issued*, the
trace's order, then depends only on the planted fault, not on how busy the machine is, and a
call that never completes costs one shared timeout, not one per scenario. Where the program
stands for blocking calls, a rank whose call cannot complete (a peer never joins) issues
nothing after it, as a blocked rank would not (the subgroup's rank 1, the pairs' rank 2).
Whether an entry is "started" or "completed" may vary from run to run; the diagnosis does not
depend on it.
"""
from __future__ import annotations

import copy
import datetime
import threading

#: (name, what the student reads, expected diagnosis): the expected value follows from the
#: planted fault itself (which call which rank did not make, or made otherwise); its group is
#: given by its members (``"members"``), named as the run named that group (:func:`expected`).
SCENARIOS = [
    ("skip", "rank 1 skips the last collective (a broadcast)",
     {"members": [0, 1, 2, 3], "seq": 2, "kind": "missing", "ranks": [1]}),
    ("swap", "rank 2 issues a broadcast and an all-reduce in the other order",
     {"members": [0, 1, 2, 3], "seq": 1, "kind": "order", "ranks": [2]}),
    ("shape", "rank 1 all-reduces a tensor of 3 elements where the others have 4",
     {"members": [0, 1, 2, 3], "seq": 1, "kind": "shape", "ranks": [1]}),
    ("subgroup", "rank 2 never joins an all-reduce on the subgroup of ranks 1 and 2 (where "
     "rank 1 waits, so the others wait for it at their next call)",
     {"members": [1, 2], "seq": 0, "kind": "missing", "ranks": [2]}),
    ("compute", "rank 0 is stuck in compute before the second all-reduce",
     {"members": [0, 1, 2, 3], "seq": 1, "kind": "missing", "ranks": [0]}),
    ("clean", "a clean run (collectives, a subgroup, a send and its receive on a group of two)", None),
    ("twins", "a clean run on two groups of the same ranks 0 and 1 (as the default group and a "
     "side group are on two ranks), used in different orders by the two ranks", None),
    ("pairs", "lesson 17's hang: pairs [0, 1] and [2, 3], a broadcast on everyone, then each "
     "step two all-reduces on the pair and one on everyone; rank 3 is stuck in compute at step 1 "
     "(rank 2 waits for it in their pair's all-reduce)",
     {"members": [2, 3], "seq": 2, "kind": "missing", "ranks": [3]}),
]
WORLD = 4
GROUP_TIMEOUT = 1.0


def expected(want, traces):
    """The diagnosis ``want`` (a SCENARIOS value) with its group's name in ``traces``."""
    if want is None:
        return None
    names = {e["group"] for t in traces for e in t if e["members"] == want["members"]}
    if len(names) != 1:
        raise RuntimeError(f"the grader's recording has groups {sorted(names)} of ranks "
                           f"{want['members']}; expected one")
    return {"group": names.pop(), "seq": want["seq"], "kind": want["kind"], "ranks": want["ranks"]}


def _groups(name, rank, timeout):
    """The scenario's groups (every rank makes every group, in one order): ``world``, and the
    other groups this rank is a member of."""
    import torch.distributed as dist

    def make(ranks):
        group = dist.new_group(ranks, timeout=timeout)
        return group if rank in ranks else None

    groups = {"world": make(list(range(WORLD)))}
    if name in ("subgroup", "clean"):
        groups["sub"] = make([1, 2])
    if name == "clean":
        groups["pair"] = make([0, 2])  # the send and its receive
    if name == "twins":
        groups["a"], groups["b"] = make([0, 1]), make([0, 1])
    if name == "pairs":
        first, second = make([0, 1]), make([2, 3])
        groups["pair"] = first if rank < 2 else second
    return {k: g for k, g in groups.items() if g is not None}


def _scenario(name, rank, groups, works):
    import torch
    import torch.distributed as dist

    x, y = torch.ones(4), torch.ones(2)

    def call(fn, *args, g="world"):
        works.append(fn(*args, group=groups[g], async_op=True))

    if name == "pairs":
        call(dist.broadcast, torch.zeros(3), 0)
        for step in range(2):
            if rank == 3 and step == 1:
                break  # "stuck in compute": it issues nothing more
            call(dist.all_reduce, x, g="pair")
            if rank == 2 and step == 1:
                break  # blocked there, waiting for rank 3: it never reaches the next calls
            call(dist.all_reduce, x, g="pair")
            call(dist.all_reduce, torch.ones(8))
        return
    if name == "twins":
        if rank in (0, 1):
            order = ("a", "b") if rank == 0 else ("b", "a")
            for g in order:
                call(dist.all_reduce, x if g == "a" else y, g=g)
            call(dist.broadcast, x, 0, g="a")
        call(dist.all_reduce, y)
        return
    call(dist.all_reduce, x)
    if name == "skip":
        call(dist.all_reduce, x)
        if rank != 1:
            call(dist.broadcast, y, 0)
    elif name == "swap":
        steps = [lambda: call(dist.all_reduce, x), lambda: call(dist.broadcast, y, 0)]
        for step in (steps[::-1] if rank == 2 else steps):
            step()
    elif name == "shape":
        call(dist.all_reduce, torch.ones(3) if rank == 1 else x)
    elif name == "subgroup":
        if rank == 1:  # blocked there: it never reaches the next call on the world group
            call(dist.all_reduce, y, g="sub")
        else:
            call(dist.all_reduce, x)
    elif name == "compute":
        if rank != 0:
            call(dist.all_reduce, x)
    elif name == "clean":
        if rank in (1, 2):
            call(dist.all_reduce, y, g="sub")
        call(dist.broadcast, y, 1)
        if rank == 0:
            works.append(dist.isend(torch.ones(3), 2, group=groups["pair"]))
        if rank == 2:
            works.append(dist.irecv(torch.empty(3), 0, group=groups["pair"]))
        call(dist.all_reduce, x)


def _rank(rank, world_size):
    from course.flight import record_trace

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    groups = {name: _groups(name, rank, timeout) for name, _, _ in SCENARIOS}
    traces, works = {}, []
    for name, _, _ in SCENARIOS:
        with record_trace(groups=list(groups[name].values())) as trace:
            _scenario(name, rank, groups[name], works)
        traces[name] = trace
    for work in works:
        try:
            work.wait()
        except RuntimeError:  # timed out: the fault
            pass
    return copy.deepcopy(traces)


_lock = threading.Lock()
_recorded: list = []


def recorded() -> dict:
    """``{scenario: traces (index = rank)}``, recorded once per grading (in this process)."""
    from course.launch import launch

    with _lock:
        if not _recorded:
            last = None
            for _ in range(2):  # the grader's own run: one retry if the machine hiccups
                try:
                    ranks = launch(_rank, WORLD, timeout=90, quiet=True,
                                   collective_timeout=30)
                    break
                except Exception as exc:  # noqa: BLE001 - reported below
                    last = exc
            else:
                raise RuntimeError(f"the grader could not record its planted faults: {last}")
            _recorded.append({name: [ranks[r][name] for r in range(WORLD)]
                              for name, _, _ in SCENARIOS})
        return _recorded[0]


def start_in_background() -> None:
    """Record while the sandbox loads the submission and the other checks run."""
    threading.Thread(target=lambda: _safe(recorded), daemon=True).start()


def _safe(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - the check that needs it calls recorded() again
        pass
