"""Pipeline schedules as data (lesson 18): per-rank action lists, checked, timed, counted, drawn.

A schedule is ``{rank: [action, ...]}`` (or a list of the ranks' lists) in the format of
``torch.distributed.pipelining``'s ``pipeline_order``: each action is a torch ``_Action`` or its
text, stage, kind, micro-batch: ``"2F0"`` (stage 2's forward of micro-batch 0), ``"2B0"`` (its
whole backward), ``"2I0"`` and ``"2W0"`` (the backward split in two: the gradient of the stage's
input, then the gradients of its weights; the zero-bubble paper calls them B and W),
``"2SEND_F0"``, ``"3RECV_F0"``, ``"3SEND_B0"``, ``"2RECV_B0"`` (the messages, in lists lowered
"with comms"; a transfer is named by the stage on the acting rank), ``"2WAIT_SEND_F0"``,
``"3WAIT_SEND_B0"`` (torch 2.15 on: wait there until that send is done, that is until the peer
has posted its receive; earlier releases wait for all sends at the end of the step), and
DualPipeV's pairs ``"(4F4;3B0)OVERLAP_F_B"``, a forward and a backward issued together. A rank's
list may also be one string of actions separated by spaces. ``None`` or ``""`` is an idle slot;
``UNSHARD``, ``RESHARD`` (FSDP), ``REDUCE_GRAD`` and ``WAIT_REDUCE_GRAD`` (the gradients'
reduction over data-parallel replicas, started and, from 2.15 on, waited for) are ignored: no
stage waits for them. A wait is neither compute nor a message: it takes no time and is not
drawn or counted, but :func:`check` checks where it is and :func:`simulate` waits at it.

- :func:`torch_order`: a built-in schedule's lists, made by torch's own class (no processes);
  :func:`torch_lower`: the lists with what torch's runtime adds before it runs them.
- :func:`check`: every stage on one rank; every micro-batch's F once and B once (or I and W once)
  per stage; each action after what it needs; every send with its receive (and its wait); no
  deadlock. Raises ``ValueError`` saying what is wrong, else returns :func:`simulate`'s timeline.
- :func:`simulate`: when each action runs if every rank works through its list in order and an
  action waits for its inputs; costs in units of one forward of one stage (:data:`COST`).
- :func:`bubble`, :func:`peak_in_flight`, :func:`messages`, :func:`draw`: idle time over compute
  time, the activations a rank holds at its peak, the messages of one step; ranks x time.

The toolkit looks at schedules; it makes none (torch's classes do, or you do).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
#: message kind -> the compute kind whose result it carries
SENDS = {"SEND_F": "F", "SEND_B": "B"}
RECVS = {"RECV_F": "F", "RECV_B": "B"}
#: wait kind -> the send it waits for (torch 2.15 on)
WAITS = {"WAIT_SEND_F": "SEND_F", "WAIT_SEND_B": "SEND_B"}
IGNORED = ("REDUCE_GRAD", "WAIT_REDUCE_GRAD", "UNSHARD", "RESHARD")
#: Cost of each action of a stage, in forwards: a whole backward costs two (input and weight
#: gradients, one each, as for a matrix product). A rank holding v stages runs each in 1 / v.
COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "gold", "W": "tab:green"}

_ACTION = re.compile(r"(\d+)(" + "|".join([*WAITS, *IGNORED, *SENDS, *RECVS, *COMPUTE]) + r")(\d*)")
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")


class Op(NamedTuple):
    """One action: stage index, kind (F, B, I, W, SEND_F, WAIT_SEND_F, ...), micro-batch."""
    stage: int
    kind: str
    mb: int

    def __str__(self):
        return f"{self.stage}{self.kind}{self.mb}"


def parse_action(action) -> tuple[Op, ...]:
    """One entry of a list as Ops: none for an idle slot or an ignored action, two for a pair."""
    text = "" if action is None else str(action).strip()
    if not text:
        return ()
    pair = _PAIR.fullmatch(text)
    if pair:
        ops = tuple(op for part in pair.group(1).split(";") for op in parse_action(part))
        if sorted(op.kind for op in ops) not in (["B", "F"], ["F", "I"]):
            raise ValueError(f"{text!r}: an OVERLAP_F_B pair is one forward and one backward")
        return ops
    match = _ACTION.fullmatch(text)
    if not match:
        raise ValueError(f"not an action: {text!r} (expected e.g. '2F0', '3W1', '1SEND_F0')")
    stage, kind, mb = match.groups()
    if kind in IGNORED:
        return ()
    if not mb:
        raise ValueError(f"{text!r} names no micro-batch")
    return (Op(int(stage), kind, int(mb)),)


class _Parsed(dict):
    """What :func:`parse` returns (so that it is not parsed twice)."""


def parse(schedule) -> dict[int, list[tuple[Op, ...]]]:
    """``{rank: [ops of one entry, ...]}`` with idle and ignored entries dropped."""
    if isinstance(schedule, _Parsed):
        return schedule
    if not isinstance(schedule, dict):
        schedule = dict(enumerate(schedule))
    if sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"the ranks must be 0..p-1; got {sorted(schedule)}")
    parsed = _Parsed()
    for rank in sorted(schedule):
        entries = schedule[rank]
        if isinstance(entries, str):
            entries = entries.split()
        parsed[rank] = [ops for ops in map(parse_action, entries) if ops]
    return parsed


def _ops(parsed):
    """(rank, position, op) for every op, in list order; a pair's two ops at (entry, 0) and (entry, 1)."""
    return [(rank, (i, j), op) for rank, entries in parsed.items()
            for i, ops in enumerate(entries) for j, op in enumerate(ops)]


def stage_ranks(schedule) -> dict[int, int]:
    """``{stage: rank}`` read from the lists; ValueError if a stage is on two ranks or missing."""
    parsed = parse(schedule)
    where: dict[int, int] = {}
    for rank, _, op in _ops(parsed):
        if where.setdefault(op.stage, rank) != rank:
            raise ValueError(f"stage {op.stage} is on rank {where[op.stage]} and on rank {rank}")
    if sorted(where) != list(range(len(where))):
        raise ValueError(f"the stages must be 0..S-1; the lists name {sorted(where)}")
    return where


def _stand_ins(p: int, n_stages: int, n: int) -> list:
    """What torch's schedule classes read of their stages when they plan (no process group)."""
    from types import SimpleNamespace

    return [SimpleNamespace(group_rank=0, group_size=p, num_stages=n_stages, submod=None, stage_index=0)
            for _ in range(n)]


def torch_order(schedule, p: int, m: int, v: int = 1, with_comms: bool = False) -> dict:
    """The lists torch's built-in ``schedule`` (a class, or its name for torch's
    ``get_schedule_class``, e.g. ``"ZBVZeroBubble"``) runs for p ranks, m micro-batches and v
    stages per rank, as torch's ``_Action`` objects: the class computes them in its constructor
    (``pipeline_order``), here from stand-in stages, so no process group or model is needed.
    ``with_comms``: lowered by :func:`torch_lower`, as torch's runtime runs them."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = torch_schedules.get_schedule_class(schedule) if isinstance(schedule, str) else schedule
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if v != 1:
            raise ValueError(f"{cls.__name__} runs one stage per rank")
        built = cls(_stand_ins(p, p, 1)[0], m)
    else:
        built = cls(_stand_ins(p, p * v, v), m)
    order = {rank: list(built.pipeline_order[rank]) for rank in range(p)}
    return torch_lower(order, m) if with_comms else order


def torch_lower(schedule, m: int) -> dict:
    """Compute-only lists lowered as ``_PipelineScheduleRuntime`` does before it runs them: torch
    validates them (``_validate_schedule``, AssertionError), adds the sends and receives
    (``_add_send_recv``, AssertionError if it cannot place them), its UNSHARD, RESHARD and
    REDUCE_GRAD, and from 2.15 on a WAIT_SEND_F or WAIT_SEND_B per send (a forward's after the
    sending stage's backward of that micro-batch, a backward's at the end) and a WAIT_REDUCE_GRAD
    per REDUCE_GRAD. Returns ``{rank: [_Action, ...]}`` (of the input, only compute is read)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    parsed = parse(schedule)
    p, n_stages = len(parsed), len(stage_ranks(parsed))
    original = schedule if isinstance(schedule, dict) else dict(enumerate(schedule))
    actions = {}
    for rank in range(p):
        entries = original[rank].split() if isinstance(original[rank], str) else original[rank]
        actions[rank] = [torch_schedules._Action.from_str(str(e)) for e in entries if parse_action(e)
                         and all(op.kind in COMPUTE for op in parse_action(e))]
    runtime = torch_schedules._PipelineScheduleRuntime(_stand_ins(p, n_stages, n_stages // p), m)
    runtime._prepare_schedule_with_comms(actions)
    return {rank: list(runtime.pipeline_order_with_comms[rank]) for rank in range(p)}


def check(schedule, n_micro: int | None = None, cost: dict | None = None, latency: float = 0.0) -> dict:
    """Raise ValueError naming the first problem; else return :func:`simulate`'s timeline.

    Checked: each stage on one rank; for every stage and micro-batch 0..m-1 (m = ``n_micro``, or
    one more than the largest micro-batch named) one F, and one B or one I and one W; on its
    rank, B or I after that micro-batch's F and W after its I; where the lists name messages
    (lowered with comms), each transfer between ranks has one send after the action that computes
    it and one receive before the action that uses it, and no other message is named; where the
    lists name waits (torch 2.15 on), each send has one wait after it on its rank and no wait is
    without its send; and, simulated, every rank reaches the end of its list (no deadlock)."""
    parsed = parse(schedule)
    where = stage_ranks(parsed)
    ops = _ops(parsed)
    compute = [(rank, i, op) for rank, i, op in ops if op.kind in COMPUTE]
    if not compute:
        raise ValueError("the lists name no F, B, I or W")
    m = n_micro if n_micro is not None else 1 + max(op.mb for _, _, op in compute)
    count = Counter(op for _, _, op in compute)
    for op, n in count.items():
        if n > 1:
            raise ValueError(f"{op} appears {n} times")
        if not 0 <= op.mb < m:
            raise ValueError(f"{op}: micro-batch {op.mb} is not in 0..{m - 1}")
    for stage in range(len(where)):
        for mb in range(m):
            f, b, i, w = (count[Op(stage, kind, mb)] for kind in COMPUTE)
            if f != 1 or (b, i, w) not in ((1, 0, 0), (0, 1, 1)):
                raise ValueError(f"stage {stage}, micro-batch {mb}: {f} F, {b} B, {i} I, {w} W; "
                                 "needs one F and one B, or one F, one I and one W")
    position = {op: (rank, i) for rank, i, op in ops}
    for op, (rank, i) in position.items():
        need = {"B": "F", "I": "F", "W": "I"}.get(op.kind)
        if need and position[Op(op.stage, need, op.mb)][1] >= i:
            raise ValueError(f"rank {rank}: {op} comes before {Op(op.stage, need, op.mb)}, which it needs")
    if any(op.kind in SENDS or op.kind in RECVS for _, _, op in ops):
        _check_messages(parsed, where, position, len(where))
    if any(op.kind in WAITS for _, _, op in ops):
        _check_waits(ops, position)
    return simulate(parsed, cost, latency)


def _transfers(where, n_stages, compute_ops):
    """Every message one step needs: (send, receive, producing op, consuming op kinds)."""
    for op in compute_ops:
        if op.kind == "F" and op.stage + 1 < n_stages and where[op.stage + 1] != where[op.stage]:
            yield Op(op.stage, "SEND_F", op.mb), Op(op.stage + 1, "RECV_F", op.mb), op, ("F",)
        if op.kind in ("B", "I") and op.stage > 0 and where[op.stage - 1] != where[op.stage]:
            yield Op(op.stage, "SEND_B", op.mb), Op(op.stage - 1, "RECV_B", op.mb), op, ("B", "I")


def _check_messages(parsed, where, position, n_stages):
    named = Counter(op for _, _, op in _ops(parsed) if op.kind in SENDS or op.kind in RECVS)
    expected = set()
    for send, recv, producer, consumers in _transfers(where, n_stages, [op for op in position if op.kind in COMPUTE]):
        expected |= {send, recv}
        for message, rank in ((send, where[send.stage]), (recv, where[recv.stage])):
            if named[message] != 1:
                raise ValueError(f"rank {rank} names {message} {named[message]} times; the transfer "
                                 f"of {producer}'s result needs it once")
        if position[send][1] <= position[producer][1]:
            raise ValueError(f"rank {where[send.stage]}: {send} comes before {producer}, whose result it sends")
        consumer = next(Op(recv.stage, k, recv.mb) for k in consumers if Op(recv.stage, k, recv.mb) in position)
        if position[recv][1] >= position[consumer][1]:
            raise ValueError(f"rank {where[recv.stage]}: {recv} comes after {consumer}, which needs it")
    for message in named:
        if message not in expected:
            raise ValueError(f"rank {where.get(message.stage, '?')} names {message}, a message no transfer needs")


def _check_waits(ops, position):
    named = Counter(op for _, _, op in ops if op.kind in WAITS)
    for rank, i, op in ops:
        if op.kind in SENDS:
            wait = Op(op.stage, "WAIT_" + op.kind, op.mb)
            if named[wait] != 1:
                raise ValueError(f"rank {rank} names {wait} {named[wait]} times; {op} needs it once")
            if position[wait][1] <= i:
                raise ValueError(f"rank {rank}: {wait} comes before {op}, the send it waits for")
        elif op.kind in WAITS and Op(op.stage, WAITS[op.kind], op.mb) not in position:
            raise ValueError(f"rank {rank} names {op}, a wait for a send no list names")


def simulate(schedule, cost: dict | None = None, latency: float = 0.0) -> dict:
    """``{rank: [(op, start, end), ...]}``: every rank runs its list in order, each action as soon
    as the rank is free and its inputs are there (a pair when both of its actions' are, as torch's
    lowering places it; then its forward and its backward, one after the other): F after the
    previous stage's F of that micro-batch, B or I after the next stage's B or I (the last
    stage's after its own F), W after its I; ``latency`` more when they come from another rank
    (in lists with messages, from the send's time). Messages and waits take no time; a wait holds
    its rank until its send has arrived and the peer has reached the matching receive (torch's
    rule: a send completes once its receive is posted). ValueError if the ranks get stuck (a
    deadlock), naming what each waits for."""
    parsed = parse(schedule)
    cost = dict(COST, **(cost or {}))
    where = stage_ranks(parsed)
    n_stages, ranks = len(where), len(parsed)
    scale = ranks / n_stages                  # a rank's v stages share its layers
    explicit = any(op.kind in SENDS or op.kind in RECVS for _, _, op in _ops(parsed))
    done: dict[Op, float] = {}                # op -> end time (for sends: when sent)
    free, next_entry = [0.0] * ranks, [0] * ranks
    timeline: dict[int, list] = {rank: [] for rank in parsed}

    def arrival(source: Op, target_stage: int, send_kind: str):
        """When `source`'s result can be used by `target_stage`: None while not yet there."""
        if source not in done:
            return None
        if where[source.stage] == where[target_stage]:
            return done[source]
        if explicit:
            send = Op(source.stage, send_kind, source.mb)
            return done[send] + latency if send in done else None
        return done[source] + latency

    def ready(op: Op):
        if op.kind in RECVS:
            return 0.0
        if op.kind in WAITS:
            send = Op(op.stage, WAITS[op.kind], op.mb)
            recv = Op(op.stage + (1 if send.kind == "SEND_F" else -1), "RECV" + send.kind[4:], op.mb)
            return max(done[send] + latency, done[recv]) if send in done and recv in done else None
        if op.kind in SENDS:
            produced = [Op(op.stage, k, op.mb) for k in (("F",) if op.kind == "SEND_F" else ("B", "I"))]
            return next((done[p] for p in produced if p in done), None)
        if op.kind == "W":
            return done.get(Op(op.stage, "I", op.mb))
        if op.kind == "F":
            return 0.0 if op.stage == 0 else arrival(Op(op.stage - 1, "F", op.mb), op.stage, "SEND_F")
        own = done.get(Op(op.stage, "F", op.mb))
        if op.stage == n_stages - 1 or own is None:
            return own
        later = Op(op.stage + 1, "B", op.mb)
        later = later if later in done else Op(op.stage + 1, "I", op.mb)
        got = arrival(later, op.stage, "SEND_B")
        return None if got is None else max(own, got)

    remaining = sum(len(entries) for entries in parsed.values())
    while remaining:
        moved = False
        for rank, entries in parsed.items():
            while next_entry[rank] < len(entries):
                ops = entries[next_entry[rank]]
                times = [ready(op) for op in ops]
                if any(t is None for t in times):
                    break
                t = max([free[rank], *times])
                for op in ops:                    # a pair: its forward, then its backward
                    end = t + (cost[op.kind] * scale if op.kind in COMPUTE else 0.0)
                    if op.kind in COMPUTE:
                        timeline[rank].append((op, t, end))
                    done[op], t = end, end
                free[rank] = t
                next_entry[rank] += 1
                remaining -= 1
                moved = True
        if not moved:
            waiting = "; ".join(f"rank {r} at {'+'.join(map(str, parsed[r][next_entry[r]]))}"
                                for r in parsed if next_entry[r] < len(parsed[r]))
            raise ValueError(f"deadlock: no rank can go on ({waiting}): each waits for an action "
                             "that comes later in some rank's list")
    return timeline


def bubble(timeline: dict, within: str = "step") -> float:
    """Idle time over compute time, all ranks together: ``within="step"``, from the first start
    to the last end on any rank, (p x span - busy) / busy, what a step that ends in a flush (every
    rank waits for the optimizer step) pays; ``within="rank"``, between each rank's own first
    start and last end, what is left when nothing holds the ranks together between steps. Works
    on measured timelines too."""
    if within not in ("step", "rank"):
        raise ValueError("within must be 'step' or 'rank'")
    busy = sum(end - start for rank in timeline.values() for _, start, end in rank)
    if within == "step":
        return (len(timeline) * span(timeline) - busy) / busy
    return sum(span({0: rank}) for rank in timeline.values()) / busy - 1


def span(timeline: dict) -> float:
    """From the first start to the last end on any rank."""
    intervals = [(start, end) for rank in timeline.values() for _, start, end in rank]
    return max(end for _, end in intervals) - min(start for start, _ in intervals)


def peak_in_flight(schedule) -> list[int]:
    """Per rank, the most (stage, micro-batch) activations held at once, in list order: one more
    at each F, one fewer at each B or W (after an I the stage still keeps what its W needs: each
    layer's input and the gradient of its output; messages and waits count nothing). In one
    stage's activations: divide by v for a rank that holds v smaller stages. For a timeline, count ``order(timeline)``."""
    parsed = parse(schedule)
    peaks = []
    for rank in sorted(parsed):
        live = peak = 0
        for ops in parsed[rank]:
            for op in ops:
                live += {"F": 1, "B": -1, "W": -1}.get(op.kind, 0)
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


def order(timeline: dict) -> dict:
    """A timeline's actions as lists (``{rank: ["2F0", ...]}``), each rank's in the order they started."""
    return {rank: [str(op) for op, _, _ in sorted(entries, key=lambda e: e[1])]
            for rank, entries in timeline.items()}


def messages(schedule) -> int:
    """Point-to-point messages in one step: each F whose next stage is on another rank sends its
    activation, each B or I whose previous stage is on another rank sends that input's gradient
    (counted from the compute actions: named sends, receives and waits add nothing)."""
    parsed = parse(schedule)
    where = stage_ranks(parsed)
    compute = [op for _, _, op in _ops(parsed) if op.kind in COMPUTE]
    return sum(1 for _ in _transfers(where, len(where), compute))


def draw(ax, timeline: dict, title: str = "", scale: float = 1.0, unit: str = "forwards"):
    """Ranks as rows, time across (``scale`` times the timeline's unit, e.g. 1e3 for seconds
    -> ms): F blue, B orange, I yellow, W green, the micro-batch written in; a rank's later
    stages (when it holds several) hatched. Only compute is drawn (timelines hold nothing else)."""
    t0 = min(start for rank in timeline.values() for _, start, _ in rank)
    where = {op.stage: rank for rank, entries in timeline.items() for op, _, _ in entries}
    first = {rank: min((s for s, r in where.items() if r == rank), default=None) for rank in timeline}
    for rank, entries in timeline.items():
        for op, start, end in entries:
            ax.broken_barh([((start - t0) * scale, (end - start) * scale)], (rank - 0.4, 0.8),
                           facecolor=COLOURS[op.kind], edgecolor="black", linewidth=0.4,
                           hatch="//" if op.stage != first[rank] else None)
            ax.text(((start + end) / 2 - t0) * scale, rank, str(op.mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in sorted(timeline)])
    ax.set_ylim(len(timeline) - 0.4, -0.6)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=10)
    return ax
