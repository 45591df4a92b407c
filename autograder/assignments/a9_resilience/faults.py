"""The planted faults whose traces ``diagnose`` is graded on, recorded from real gloo runs in the
grader's own process tree (never beside student code; nothing is cached on disk).

One launch of 3 processes runs every scenario in turn, each on its own new process group with a
1 s timeout, recorded with :func:`course.flight.record_trace`. Every call is issued
asynchronously (``async_op=True``) and waited for at the end: what each rank *issued*, the
trace's order, then depends only on the planted fault, not on how busy the machine is, and a
call that never completes costs one shared timeout, not one per scenario. Whether an entry is
"started" or "completed" may vary from run to run; the diagnosis does not depend on it.
"""
from __future__ import annotations

import copy
import datetime
import threading

#: (name, what the student reads, expected diagnosis): the expected value follows from the
#: planted fault itself (which call which rank did not make, or made otherwise).
SCENARIOS = [
    ("skip", "rank 1 skips the last collective (a broadcast)",
     {"group": "0,1,2", "seq": 2, "kind": "missing", "ranks": [1]}),
    ("swap", "rank 2 issues a broadcast and an all-reduce in the other order",
     {"group": "0,1,2", "seq": 1, "kind": "order", "ranks": [2]}),
    ("shape", "rank 1 all-reduces a tensor of 3 elements where the others have 4",
     {"group": "0,1,2", "seq": 1, "kind": "shape", "ranks": [1]}),
    ("subgroup", "rank 2 never joins an all-reduce on the subgroup of ranks 1 and 2 (where "
     "rank 1 waits, so the others wait for it at their next call)",
     {"group": "1,2", "seq": 0, "kind": "missing", "ranks": [2]}),
    ("compute", "rank 0 is stuck in compute before the second all-reduce",
     {"group": "0,1,2", "seq": 1, "kind": "missing", "ranks": [0]}),
    ("clean", "a clean run (collectives, a subgroup, a send and its receive on a group of two)", None),
]
WORLD = 3
GROUP_TIMEOUT = 1.0


def _scenario(name, rank, group, sub, pair, works):
    import torch
    import torch.distributed as dist

    x, y = torch.ones(4), torch.ones(2)

    def call(fn, *args, g=group):
        works.append(fn(*args, group=g, async_op=True))

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
            call(dist.all_reduce, y, g=sub)
        else:
            call(dist.all_reduce, x)
    elif name == "compute":
        if rank != 0:
            call(dist.all_reduce, x)
    elif name == "clean":
        if rank in (1, 2):
            call(dist.all_reduce, y, g=sub)
        call(dist.broadcast, y, 1)
        if rank == 0:
            works.append(dist.isend(torch.ones(3), 2, group=pair))
        if rank == 2:
            works.append(dist.irecv(torch.empty(3), 0, group=pair))
        call(dist.all_reduce, x)


def _rank(rank, world_size):
    import torch.distributed as dist

    from course.flight import record_trace

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    groups = {name: dist.new_group(list(range(world_size)), timeout=timeout)
              for name, _, _ in SCENARIOS}
    subs = {name: dist.new_group([1, 2], timeout=timeout) for name, _, _ in SCENARIOS}
    pair = dist.new_group([0, 2], timeout=timeout)  # the clean run's send and receive
    traces, works = {}, []
    for name, _, _ in SCENARIOS:
        sub = subs[name] if rank in (1, 2) else None
        watched = [groups[name]] + ([sub] if sub is not None else [])
        if name == "clean" and rank in (0, 2):
            watched.append(pair)
        with record_trace(groups=watched) as trace:
            _scenario(name, rank, groups[name], sub, pair, works)
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
