"""Counting the collectives a piece of code issues, from the grader's side (runs in ranks).

Two layers: python wrappers around torch.distributed's collective functions (also where the
code's globals hold them under their own names), and a watch on the default process group,
which sees every collective issued on it however it was reached (functional collectives
included); watches on given groups (:func:`traffic_on_groups`) or on every group of a rank
(:func:`calls_on_every_group`, which notes point-to-point sends and receives too). A watch is
:func:`course.collectives.watch_group`: torch's pre-hook where the release has one (2.14+), with
its op names made the same on every release, and the same records made by wrapping elsewhere.

A third layer sits below Python: torch's flight recorder, which notes in C++ every collective
that reaches a backend, on any group, however it was called (a pre-hook sits on the
``ProcessGroup``, so a call on the group's backend itself escapes it), and no point-to-point
call on gloo. :func:`collectives_counted` reads it with ``every_group=True``
(:func:`flight_recorder_mark`, :func:`flight_recorder_collectives`), through the functions this
module found when it was imported: A2's ranks import it in their fork server, before any
student code exists in them.
"""
from __future__ import annotations

import contextlib
import functools
import pickle

import torch.distributed as dist

from course.collectives import watch_group

#: Collectives a ring may not call (python-level names, where this torch has them).
COLLECTIVES = ["all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
               "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object",
               "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
               "gather", "gather_object", "gather_into_tensor", "gather_single", "scatter",
               "scatter_object_list", "broadcast_object_list", "barrier", "monitored_barrier",
               "_broadcast_coalesced"]
#: What the process group's pre-hook counts (its other names are point-to-point or bookkeeping).
HOOKED_COLLECTIVES = {"BROADCAST", "ALLREDUCE", "REDUCE", "ALLGATHER", "REDUCE_SCATTER",
                      "ALLTOALL", "BARRIER", "SCATTER", "GATHER"}


@contextlib.contextmanager
def collectives_counted(fn, *, every_group: bool = False):
    """While inside, every collective call is counted in the yielded dict (what -> calls).

    Two layers: python wrappers around torch.distributed's collective functions (also where
    ``fn``'s globals hold them under their own names), and a pre-hook on the default process
    group, which sees every collective issued on it however it was reached (functional
    collectives included); point-to-point sends and receives are not counted.

    With ``every_group``, the pre-hook sits on every process group of this rank instead (those
    that exist and those created inside: ``process group OP`` on the default group, ``OP on
    another process group (ranks ...)`` elsewhere), and what torch's flight recorder noted
    inside is added when the block ends (``NAME (torch's flight recorder, process group N)``):
    a collective on a group's backend, which no pre-hook sees, included."""
    import torch.distributed.distributed_c10d as c10d

    counts: dict[str, int] = {}
    originals = {name: getattr(c10d, name, None) or getattr(dist, name, None) for name in COLLECTIVES}
    originals = {k: v for k, v in originals.items() if callable(v)}

    def counting(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            counts[f"dist.{name}"] = counts.get(f"dist.{name}", 0) + 1
            return original(*args, **kwargs)
        return wrapper

    wrappers = {name: counting(name, f) for name, f in originals.items()}
    patched = []  # (namespace, name, old value)
    for space in (dist, c10d):
        for name, w in wrappers.items():
            if hasattr(space, name):
                patched.append((space, name, getattr(space, name)))
                setattr(space, name, w)
    by_identity = {id(f): wrappers[name] for name, f in originals.items()}
    g = getattr(fn, "__globals__", {})
    for name, value in list(g.items()):
        if id(value) in by_identity:
            patched.append((g, name, value))
            g[name] = by_identity[id(value)]

    def note(key):
        counts[key] = counts.get(key, 0) + 1

    default = c10d._get_default_group()

    def seen_on(group):
        if group is default:
            label = "process group {}"
        else:
            ranks = ", ".join(str(r) for r in dist.get_process_group_ranks(group))
            label = f"{{}} on another process group (ranks {ranks})"
        return lambda op, inputs, outputs, peer: note(label.format(op)) \
            if op in HOOKED_COLLECTIVES else None

    if every_group:
        watching = _watching_every_group(seen_on)
        recorded, mark = flight_recorder_collectives, flight_recorder_mark()
    else:
        watching = watch_group(default, seen_on(default))
    try:
        with watching:
            yield counts
    finally:
        for space, name, old in reversed(patched):
            if isinstance(space, dict):
                space[name] = old
            else:
                setattr(space, name, old)
        if every_group:
            for key, calls in recorded(mark).items():
                counts[key] = counts.get(key, 0) + calls


# ---------------------------------------------------------------- torch's flight recorder

def _recorders() -> tuple:
    """torch's flight recorders' dump functions (gloo's and the rest, NCCL's), where this torch
    has them."""
    import torch._C._distributed_c10d as c

    found = (getattr(c, "_dump_fr_trace", None), getattr(c, "_dump_nccl_trace", None))
    return tuple(f for f in found if callable(f))


#: As this module found them when it was imported (see the module's docstring).
_RECORDERS, _LOADS = _recorders(), pickle.loads


def _entries(dump) -> list:
    try:
        data = _LOADS(dump(includeCollectives=True, includeStackTraces=False, onlyActive=False))
        return [e for e in data.get("entries", []) if isinstance(e, dict)]
    except Exception:  # noqa: BLE001 - a recorder this build or backend cannot dump
        return []


def _last_id(entries) -> int:
    return max((int(e.get("record_id", -1)) for e in entries), default=-1)


def flight_recorder_mark() -> tuple[int, ...]:
    """Where each flight recorder stands now: the last record id it holds (-1: none)."""
    return tuple(_last_id(_entries(dump)) for dump in _RECORDERS)


def flight_recorder_collectives(mark: tuple[int, ...]) -> dict[str, int]:
    """The collectives torch's flight recorders noted since ``mark`` (:func:`flight_recorder_mark`),
    by name and group: ``{"gloo:all_reduce (torch's flight recorder, process group 1)": 2}``.
    Point-to-point calls are left out (gloo does not record them; NCCL marks them, and
    records a batch of them as one ``coalesced`` entry). A recorder that holds less than it did
    at ``mark`` was emptied meanwhile: that is noted too."""
    counts: dict[str, int] = {}
    for dump, last in zip(_RECORDERS, mark):
        entries = _entries(dump)
        if last >= 0 and _last_id(entries) < last:
            counts["torch's flight recorder emptied (its record of the calls removed)"] = 1
        for e in entries:
            name = str(e.get("profiling_name", ""))
            p2p = e.get("is_p2p") or name.endswith(":coalesced")
            if int(e.get("record_id", -1)) <= last or p2p:
                continue
            key = f"{name} (torch's flight recorder, process group {e.get('pg_id')})"
            counts[key] = counts.get(key, 0) + 1
    return counts


@contextlib.contextmanager
def traffic_on_groups(groups: dict, *, new_groups: bool = False, outputs: bool = False):
    """While inside, every collective issued on one of ``groups`` (``{key: ProcessGroup or
    None}``, None = the default group) is noted in the yielded ``{key: [(op, elements)]}``:
    its name (``ALLREDUCE``, ``ALLGATHER``, ...) and the elements of its input tensors. Counted
    by a pre-hook on each group, which sees every call on that group (plain, functional or
    DTensor collectives, in forward or in backward) and only those. With ``new_groups``, each
    group created inside (``new_group``, ``split_group``: what ``init_device_mesh`` calls) is
    watched from its creation, under the key ``tuple(its global ranks)``. With ``outputs``,
    each note is ``(op, input elements, output elements)``, because a bound on inputs alone
    misses what grows with the group (an all-gather outputs n times its input); an in-place
    collective (all_reduce, broadcast, reduce: the hook sees no output tensors) outputs its
    input."""
    import torch.distributed.device_mesh  # noqa: F401  (loaded first: its names are watched too)
    import torch.distributed.distributed_c10d as c10d

    traffic: dict = {}
    hooked: list = []  # the groups watched
    stack = contextlib.ExitStack()

    def watch(key, group):
        group = c10d._get_default_group() if group is None else group
        traffic.setdefault(key, [])
        if any(g is group for g in hooked):
            return

        def seen(op, inputs, out_tensors, peer, key=key):
            if op in HOOKED_COLLECTIVES:
                elements = sum(t.numel() for t in inputs)
                out = sum(t.numel() for t in out_tensors) if out_tensors else elements
                traffic[key].append((op, elements, out) if outputs else (op, elements))
        stack.enter_context(watch_group(group, seen))
        hooked.append(group)

    with stack:
        for key, group in groups.items():
            watch(key, group)
        created = (_groups_created_inside(
            lambda group: watch(tuple(dist.get_process_group_ranks(group)), group))
            if new_groups else contextlib.nullcontext())
        with created:
            yield traffic


@contextlib.contextmanager
def _groups_created_inside(watch):
    """While inside, ``watch(group)`` is called on every process group created by
    ``new_group``, ``split_group`` or a device mesh (which calls the names it imported, and
    ``new_group`` through ``_new_group_with_tag``): the same group may be seen twice."""
    import sys

    import torch.distributed.distributed_c10d as c10d

    def watching(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            group = original(*args, **kwargs)
            if isinstance(group, dist.ProcessGroup):
                watch(group)
            return group
        return wrapper

    patched = []
    spaces = [dist, c10d, sys.modules.get("torch.distributed.device_mesh")]
    for space in filter(None, spaces):
        for name in ("new_group", "split_group", "_new_group_with_tag"):
            if callable(getattr(space, name, None)):
                patched.append((space, name, getattr(space, name)))
    for space, name, old in patched:
        setattr(space, name, watching(old))
    try:
        yield
    finally:
        for space, name, old in reversed(patched):
            setattr(space, name, old)


@contextlib.contextmanager
def _watching_every_group(seen_for):
    """While inside, ``watch_group(group, seen_for(group))`` on every process group of this
    rank: those that exist, and those created inside (:func:`_groups_created_inside`)."""
    import torch.distributed.distributed_c10d as c10d

    hooked: list = []
    stack = contextlib.ExitStack()

    def watch(group):
        if group is None or any(g is group for g in hooked):
            return
        stack.enter_context(watch_group(group, seen_for(group)))
        hooked.append(group)

    with stack:
        for group in list(c10d._world.pg_map):
            watch(group)
        with _groups_created_inside(watch):
            yield


@contextlib.contextmanager
def calls_on_every_group(*, by_group: bool = False, log: list | None = None):
    """While inside, every call on any process group of this rank (those that exist, and those
    created inside, by ``new_group``, ``split_group`` or a device mesh) is noted in the yielded
    list as ``(op, input elements, output elements)``: point-to-point (SEND, RECV) and
    collectives alike, however they were reached (plain, functional or autograd collectives).
    A6 and A7 judge a rank's whole communication with it, whatever group the student's code
    used. With ``by_group``, each note is ``(group's ranks, op, peer, input elements, output
    elements)``: the group's ranks (a tuple, in the default group's numbering) and, for SEND
    and RECV, the other rank (None for the others, or a receive from any source): A8 judges
    which group each call went to. ``log``: the list to note into (a new one if None; A8's
    ranks pass one that also reports a call to a wrong group as it happens)."""
    log = [] if log is None else log

    def seen_for(group):
        ranks = tuple(dist.get_process_group_ranks(group)) if by_group else ()

        def seen(op, inputs, outputs, root):
            elements = (sum(t.numel() for t in inputs), sum(t.numel() for t in outputs))
            if not by_group:
                log.append((op, *elements))
                return
            peer = ranks[root] if op in ("SEND", "RECV") and 0 <= root < len(ranks) else None
            log.append((ranks, op, peer, *elements))
        return seen

    with _watching_every_group(seen_for):
        yield log
