"""Counting the collectives a piece of code issues, from the grader's side (runs in ranks).

Two layers: python wrappers around torch.distributed's collective functions (also where the
code's globals hold them under their own names), and a watch on the default process group,
which sees every collective issued on it however it was reached (functional collectives
included); watches on given groups (:func:`traffic_on_groups`) or on every group of a rank
(:func:`calls_on_every_group`, which notes point-to-point sends and receives too). A watch is
:func:`course.collectives.watch_group`: torch's pre-hook where the release has one (2.14+), with
its op names made the same on every release, and the same records made by wrapping elsewhere.
"""
from __future__ import annotations

import contextlib
import functools

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
def collectives_counted(fn):
    """While inside, every collective call is counted in the yielded dict (what -> calls).

    Two layers: python wrappers around torch.distributed's collective functions (also where
    ``fn``'s globals hold them under their own names), and a pre-hook on the default process
    group, which sees every collective issued on it however it was reached (functional
    collectives included); point-to-point sends and receives are not counted."""
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

    def seen(op, inputs, outputs, peer):
        if op in HOOKED_COLLECTIVES:
            counts[f"process group {op}"] = counts.get(f"process group {op}", 0) + 1

    watching = watch_group(c10d._get_default_group(), seen)
    try:
        with watching:
            yield counts
    finally:
        for space, name, old in reversed(patched):
            if isinstance(space, dict):
                space[name] = old
            else:
                setattr(space, name, old)


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
    import torch.distributed.distributed_c10d as c10d

    log = [] if log is None else log
    hooked: list = []
    stack = contextlib.ExitStack()

    def watch(group):
        if group is None or any(g is group for g in hooked):
            return
        ranks = tuple(dist.get_process_group_ranks(group)) if by_group else ()

        def seen(op, inputs, outputs, root):
            elements = (sum(t.numel() for t in inputs), sum(t.numel() for t in outputs))
            if not by_group:
                log.append((op, *elements))
                return
            peer = ranks[root] if op in ("SEND", "RECV") and 0 <= root < len(ranks) else None
            log.append((ranks, op, peer, *elements))
        stack.enter_context(watch_group(group, seen))
        hooked.append(group)

    with stack:
        for group in list(c10d._world.pg_map):
            watch(group)
        with _groups_created_inside(watch):
            yield log
