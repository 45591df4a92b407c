"""A flight recorder for the course: every collective a rank issues, in order, with its state.

When a job hangs, each rank is stuck in some collective, or in none; the question is which call
the ranks stopped agreeing on. ``with record_trace() as trace: ...`` fills ``trace`` (a plain
list) with one dict per collective or point-to-point call issued on the watched groups::

    {"seq": 0, "group": "1", "members": [0, 1], "op": "ALLREDUCE", "shapes": [[3]],
     "dtype": "float32", "peer": None, "state": "completed"}

``seq`` counts each group's calls from 0 as this rank issued them; ``group`` is the group's
name, torch's ``group_name`` (the default group's is "0"; ``new_group``, ``new_subgroups`` and
``init_device_mesh`` name each group they make the same on every member, and two groups never
share a name, even two of the same ranks, so that ``(group, seq)`` names one call); ``members``
the group's global ranks, sorted; ``op`` is :mod:`course.collectives`' name; ``shapes`` the
shapes of the call's input tensors (for a RECV, which has no input, the shape of the tensor it
fills); ``dtype``
the first of those tensors' dtype ("" for a BARRIER); ``peer`` the other side's global rank of
a SEND/RECV; ``state`` "started" when issued, "completed" once its work has finished without an
error. A rank stuck in (or timed out of) a call keeps that entry "started" with nothing after it
on that group; a rank that never issued a call has no entry with that seq.

Group names, measured on gloo with torch 2.11.0, 2.14.1 and 2.15.0: the default group "0", then
"1", "2", ... in the order ``new_group`` is called (every rank calls it for every group, member
or not: the count agrees); a group made with ``use_local_synchronization=True`` or by
``split_group`` gets a hash of its ranks salted with that count on 2.14+ (2.11's salt is the
number of groups this rank belongs to, which can differ between members after a group some
ranks are not in: torch fixed it since).

Why our own: torch's flight recorder (``torch._C._distributed_c10d._dump_fr_trace``) does keep
entries for gloo on 2.14.1, but their ``state`` stays "scheduled" for ever (no watchdog updates
gloo's entries) and point-to-point calls are not in it; lesson 17 shows both. These records come
from ``ProcessGroup.register_pre_hook`` (via :func:`course.collectives.watch_group`, torch
2.11-2.15) and, for the state, ``register_post_hook``'s work object (torch 2.14+). On 2.11-2.13,
which have no post hook, an entry is marked completed when this rank issues any later call or
leaves the ``with`` block without an error (a blocking call has returned by then; an ``isend``
or ``async_op=True`` call may be marked early). So let a collective's error leave the ``with``
block, and catch it outside: then the call that failed stays "started" on every release.

``save_trace``/``load_traces`` write and read one JSON file per rank; ``plot_traces`` draws the
ranks as rows and each group's calls as columns, so that the first divergence can be seen.
"""
from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

#: The states an entry can have.
STARTED, COMPLETED = "started", "completed"
#: The keys of an entry, in order.
KEYS = ("seq", "group", "members", "op", "shapes", "dtype", "peer", "state")

_hook_ids = itertools.count(1_700_000)
#: Recorders in force in this process: their ``refresh`` is called before a trace is saved.
_active: list = []


def group_name(group) -> str:
    """A group's name (None: the default group): torch's ``group_name``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    group = group if group is not None else dist.group.WORLD
    name = getattr(group, "group_name", None)
    return str(name) if name else c10d._get_process_group_name(group)


def group_members(group) -> list[int]:
    """A group's global ranks, sorted (None: the default group)."""
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _dtype(tensors) -> str:
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else ""


class _Recorder:
    """The records of one ``record_trace`` block; ``works`` pairs a started entry with the
    work object torch returned for it (2.14+), checked for completion when asked."""

    def __init__(self, trace):
        self.trace = trace
        self.works: list = []  # [(entry, work)] not yet seen completed
        self.unposted: dict = {}  # group name -> entries whose work the post hook has not given

    def seen(self, group, name, counter):
        import torch.distributed as dist
        from course.collectives import has_pre_hooks

        members = group_members(group)

        def note(op, inputs, outputs, peer):
            tensors = inputs or outputs
            if not has_pre_hooks():  # no post hook: the calls before this one returned
                for entry in self.trace:
                    entry["state"] = COMPLETED
            entry = {"seq": next(counter), "group": name, "members": list(members), "op": op,
                     "shapes": [list(t.shape) for t in tensors], "dtype": _dtype(tensors),
                     "peer": (dist.get_global_rank(group, peer)
                              if op in ("SEND", "RECV") and peer is not None and peer >= 0
                              else None),
                     "state": STARTED}
            self.refresh()
            self.trace.append(entry)
            self.unposted.setdefault(name, []).append(entry)
        return note

    def posted(self, name):
        """The post hook: the work of the oldest entry of group ``name`` still without one."""
        def hook(args):
            pending = self.unposted.get(name)
            if not pending:
                return
            entry, work = pending.pop(0), getattr(args, "work", None)
            if work is None:
                return
            try:  # collectives: told the moment they finish, with or without an error
                future = work.get_future()
            except RuntimeError:  # gloo's send and recv have no future: asked in refresh()
                self.works.append((entry, work))
                return
            future.add_done_callback(lambda fut, e=entry: _finished(e, fut))
        return hook

    def refresh(self) -> None:
        """Mark the point-to-point entries whose work has finished without an error (their work's
        ``exception()``: torch 2.14 calls it deprecated and says so once per process)."""
        still = []
        for entry, work in self.works:
            if not work.is_completed():
                still.append((entry, work))
                continue
            try:
                failed = work.exception() is not None
            except AttributeError:  # a release without it: completed is all we know
                failed = False
            except RuntimeError:
                failed = True
            if not failed:
                entry["state"] = COMPLETED
        self.works = still


def _finished(entry, fut) -> None:
    try:
        fut.value()
    except Exception:  # failed or timed out: the call never completed
        return
    entry["state"] = COMPLETED


@contextlib.contextmanager
def record_trace(groups=None):
    """Record every call on the default group and on each group in ``groups`` while inside;
    yields the list of records (see the module's docstring), which stays readable after."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from course.collectives import has_pre_hooks, watch_group

    default = c10d._get_default_group()
    watched = [default]
    for group in groups or ():
        group = default if group is None else group
        if group is not dist.GroupMember.NON_GROUP_MEMBER and all(g is not group for g in watched):
            watched.append(group)
    trace: list = []
    recorder = _Recorder(trace)
    hooks = []
    with contextlib.ExitStack() as stack:
        for group in watched:
            name = group_name(group)
            stack.enter_context(watch_group(group, recorder.seen(group, name, itertools.count())))
            if has_pre_hooks() and hasattr(group, "register_post_hook"):
                hook_id = next(_hook_ids)
                group.register_post_hook(hook_id, recorder.posted(name))
                hooks.append((group, hook_id))
        _active.append(recorder)
        failed = False
        try:
            yield trace
        except BaseException:
            failed = True
            raise
        finally:
            for group, hook_id in hooks:
                group.unregister_post_hook(hook_id)
            _active.remove(recorder)
            recorder.refresh()
            if not has_pre_hooks() and not failed:
                for entry in trace:
                    entry["state"] = COMPLETED


def save_trace(path, trace, rank: int) -> Path:
    """Write ``{"rank": rank, "entries": trace}`` as JSON to ``path`` (a file, or a folder that
    then gets ``rank{rank}.json``); returns the file written."""
    for recorder in _active:
        recorder.refresh()
    path = Path(path)
    if path.is_dir():
        path = path / f"rank{rank}.json"
    path.write_text(json.dumps({"rank": int(rank), "entries": list(trace)}, indent=1))
    return path


def load_traces(directory) -> list[list[dict]]:
    """Every ``rank*.json`` in ``directory`` as a list indexed by rank (a missing rank: [])."""
    found = {}
    for file in Path(directory).glob("rank*.json"):
        data = json.loads(file.read_text())
        found[int(data["rank"])] = data["entries"]
    return [found.get(r, []) for r in range(max(found) + 1 if found else 0)]


#: Colours of the cells: by state, and a member of the group with no entry there.
COLOURS = {COMPLETED: "#cfe8cf", STARTED: "#f6c26b", None: "#eeeeee"}


def _groups(all_ranks_entries) -> list[tuple[str, list[int]]]:
    """``(name, members)`` of every group in the traces: the largest first, then by members,
    then by name."""
    groups = {e["group"]: list(e["members"]) for trace in all_ranks_entries for e in trace}
    return sorted(groups.items(), key=lambda gm: (-len(gm[1]), gm[1], gm[0]))


def plot_traces(traces, mark=None, ax=None):
    """Draw ``traces`` (index = rank): ranks as rows; each group's calls as columns by seq (the
    largest group first), labelled by op, coloured by state (grey: a member that never issued
    it); ``mark=(group name, seq)`` outlines that column in red. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    groups = _groups(traces)
    members = dict(groups)
    width = {g: 1 + max(e["seq"] for t in traces for e in t if e["group"] == g) for g in members}
    start, x = {}, 0
    for g, _ in groups:
        start[g], x = x, x + width[g] + 0.5
    n = len(traces)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.1 * x + 1), 0.6 * n + 1.2))
    by_cell = {(r, e["group"], e["seq"]): e for r, t in enumerate(traces) for e in t}
    for g, ranks in groups:
        for seq in range(width[g]):
            for r in ranks:
                if r >= n:
                    continue
                entry = by_cell.get((r, g, seq))
                cx, cy = start[g] + seq, r
                ax.add_patch(Rectangle((cx, cy - 0.4), 0.92, 0.8, edgecolor="grey",
                                       facecolor=COLOURS[entry and entry["state"]]))
                if entry is not None:
                    text = entry["op"].replace("_", "\n")
                    if entry["peer"] is not None:
                        text += f"\n->{entry['peer']}" if entry["op"] == "SEND" else f"\n<-{entry['peer']}"
                    elif entry["shapes"]:
                        text += "\n" + "x".join(map(str, entry["shapes"][0]))
                    ax.text(cx + 0.46, cy, text, ha="center", va="center", fontsize=6)
            ax.text(start[g] + seq + 0.46, -0.5, f"#{seq}", ha="center", fontsize=6, color="grey")
        ax.text(start[g] + width[g] / 2, -0.8, f"group {g}: ranks {','.join(map(str, ranks))}",
                ha="center", fontsize=7)
    if mark is not None and mark[0] in start:
        lo, hi = min(members[mark[0]]), min(max(members[mark[0]]), n - 1)
        ax.add_patch(Rectangle((start[mark[0]] + mark[1] - 0.05, lo - 0.5), 1.02, hi - lo + 1,
                               fill=False, edgecolor="red", linewidth=2))
    ax.set_xlim(-0.2, max(x, 1))
    ax.set_ylim(n - 0.4, -1.05)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    return ax
