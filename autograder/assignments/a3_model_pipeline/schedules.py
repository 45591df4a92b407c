"""Judging orders, in the grader: pipeline schedules (parsed from what a probe described, then
validated from first principles) and the order in which a pipelined forward called its stages.
Each failure is an AssertionError with a message the student reads."""
from __future__ import annotations

import torch

from autograder.checking.expect import sequence

from .models import microbatch_sizes, rand_int
from .probes import probe_pairs

SHAPE = "None, ('F', i) or ('B', i) with 0 <= i < num_microbatches"


def _entry(desc, where: str, m: int):
    """One schedule entry as None or (kind, micro-batch), or a readable AssertionError."""
    kind = desc.get("kind") if isinstance(desc, dict) else None
    if kind == "plain" and desc["value"] is None:
        return None
    if kind in ("list", "tuple") and len(desc["items"]) == 2:
        a, b = desc["items"]
        if (a.get("kind") == "plain" and a["value"] in ("F", "B") and b.get("kind") == "plain"
                and type(b["value"]) is int and 0 <= b["value"] < m):
            return a["value"], b["value"]
    got = desc.get("value") if kind == "plain" else (desc.get("type") or kind)
    if kind in ("list", "tuple"):
        got = [i.get("value", i.get("type", i.get("kind"))) for i in desc["items"]]
    raise AssertionError(f"{where} should be {SHAPE}, got {got!r}")


def parse_schedule(desc, name: str, p: int, m: int) -> list[list]:
    call = f"{name}({p}, {m})"
    steps = sequence(desc, call)
    return [[_entry(e, f"{call}[{t}][{s}] (step {t}, stage {s})", m)
             for s, e in enumerate(sequence(step, f"{call}[{t}] (time step {t}: one entry per "
                                                  f"stage)", p))]
            for t, step in enumerate(steps)]


def validate_schedule(schedule, name: str, p: int, m: int) -> dict:
    """Every dependency respected, every (action, micro-batch, stage) exactly once, shortest
    length; returns ``{(kind, i, s): step}``."""
    call = f"{name}({p}, {m})"
    when: dict = {}
    for t, step in enumerate(schedule):
        for s, entry in enumerate(step):
            if entry is None:
                continue
            key = (*entry, s)
            assert key not in when, (f"{call}: {entry} on stage {s} runs twice (steps "
                                     f"{when[key]} and {t}); each runs exactly once")
            when[key] = t

    def need(before, key, why):
        t, done = when[key], when.get(before)
        assert done is not None and done < t, (
            f"{call}: {key[:2]} runs on stage {key[2]} at step {t}, before {before[:2]} on stage "
            f"{before[2]} ({'which never runs' if done is None else f'step {done}'}): {why}")

    for (kind, i, s) in sorted(when, key=when.get):
        if kind == "F" and s > 0:
            need(("F", i, s - 1), ("F", i, s), "a forward needs the previous stage's output")
        if kind == "B":
            need(("F", i, s), ("B", i, s), "a backward needs its forward's activations")
            if s < p - 1:
                need(("B", i, s + 1), ("B", i, s), "a backward needs the next stage's gradient")
    for s in range(p):
        for i in range(m):
            for kind in "FB":
                assert (kind, i, s) in when, f"{call}: ('{kind}', {i}) never runs on stage {s}"
    shortest = 2 * (m + p - 1)
    assert len(schedule) == shortest, (
        f"{call} has {len(schedule)} time steps; with unit-time forwards and backwards the "
        f"shortest is 2 * (num_microbatches + num_stages - 1) = {shortest}")
    return when


def peak_activations(when: dict, p: int, m: int, length: int) -> list[tuple[int, int]]:
    """Per stage: (most micro-batches whose activations are live at one step, that step). A
    micro-batch is live on a stage from its forward's step through its backward's step."""
    peaks = []
    for s in range(p):
        live = [sum(when[("F", i, s)] <= t <= when[("B", i, s)] for i in range(m))
                for t in range(length)]
        peaks.append((max(live), live.index(max(live))))
    return peaks


def check_stage_calls(log, p: int, batch: int, num_microbatches: int, call: str,
                      clock_order: bool) -> None:
    """``log``: (stage, rows) per stage call, in call order. Each stage runs every micro-batch
    once, in order; with ``clock_order``, tick by tick (stage s runs micro-batch t - s at t)."""
    sizes = microbatch_sizes(batch, num_microbatches)
    for s in range(p):
        got = [rows for stage, rows in log if stage == s]
        assert got == sizes, (
            f"{call}: stage {s} was called on micro-batches of {got} rows, expected {sizes} "
            f"(x.tensor_split(min(num_microbatches, batch)), each stage called once per "
            f"micro-batch, in micro-batch order)")
    if not clock_order:
        return
    seen = [0] * p
    latest = (-1, None, None)                # (tick, stage, micro-batch) of the latest tick so far
    for stage, _ in log:
        i = seen[stage]
        seen[stage] += 1
        tick = stage + i
        assert tick >= latest[0], (
            f"{call}: stage {stage} ran micro-batch {i} (clock tick {tick}) after stage "
            f"{latest[1]} had run micro-batch {latest[2]} (tick {latest[0]}): issue the calls "
            "tick by tick (at tick t, stage s runs micro-batch t - s), so that stages on "
            "different devices can overlap")
        latest = (tick, stage, i)


def schedules_of(student, name, pairs):
    """The student's ``name(p, m)`` for each pair: parsed, validated, and with
    ``{(kind, i, s): step}`` (in the grader)."""
    items = student.call(probe_pairs, name, pairs)
    assert isinstance(items, list) and len(items) == len(pairs), \
        "the probe's reply was tampered with"
    out = []
    for (p, m), desc in zip(pairs, items):
        schedule = parse_schedule(desc, name, p, m)
        out.append((p, m, schedule, validate_schedule(schedule, name, p, m)))
    return out


def schedule_cases(g, fixed, count, *, more_microbatches=False):
    pairs = list(fixed)
    for _ in range(count):
        p = rand_int(g, 1, 6)
        pairs.append((p, rand_int(g, p + 1, 3 * p + 2) if more_microbatches else rand_int(g, 1, 12)))
    return pairs


# ---------------------------------------------------------------------------- bubble_fraction
# Schedules the grader hands to bubble_fraction(schedule), each with its idle slots and its
# makespan known beforehand: the fixed tables below were counted by hand (tests/test_grader_a3.py
# recounts them), the random ones are built around the number of idle slots they get.

def table(*rows: str) -> list[list]:
    """A schedule written one row per stage (``"F0 F1 . B0"``, ``.`` idle), as time steps."""
    cells = [[None if c == "." else (c[0], int(c[1:])) for c in row.split()] for row in rows]
    assert len({len(r) for r in cells}) == 1, "a table's rows have one entry per time step"
    return [list(step) for step in zip(*cells)]


def rows_of(schedule) -> str:
    """A schedule as one row per stage, the way :func:`table` reads it (for messages)."""
    return " / ".join(" ".join("." if e is None else f"{e[0]}{e[1]}" for e in row)
                      for row in zip(*schedule))


#: (what, rows, idle slots within the makespan, makespan in steps)
BUBBLE_TABLES = (
    ("gpipe_schedule(2, 2), Part 4's example",
     ("F0 F1 .  .  B0 B1",
      ".  F0 F1 B0 B1 ."), 4, 6),
    ("a GPipe schedule of 4 stages and 3 micro-batches",
     ("F0 F1 F2 .  .  .  .  .  .  B0 B1 B2",
      ".  F0 F1 F2 .  .  .  .  B0 B1 B2 .",
      ".  .  F0 F1 F2 .  .  B0 B1 B2 .  .",
      ".  .  .  F0 F1 F2 B0 B1 B2 .  .  ."), 24, 12),
    ("a 1F1B schedule of 3 stages and 5 micro-batches",
     ("F0 F1 F2 .  .  B0 F3 B1 F4 B2 .  B3 .  B4",
      ".  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 .  B4 .",
      ".  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 .  ."), 12, 14),
    ("a schedule whose last step is idle (not part of its makespan)",
     ("F0 .  .",
      ".  F0 ."), 2, 2),
    ("a schedule with an idle step first and two at the end",
     (".  F0 .  .  .",
      ".  .  F0 .  ."), 4, 3),
    ("one stage, busy at every step",
     ("F0 F1 B1 B0",), 0, 4),
    ("an irregular schedule of 3 stages",
     ("F0 .  F1 B1 .  .",
      ".  F0 .  .  B0 .",
      ".  .  .  F1 .  ."), 9, 5),
)

#: (what, schedule): bubble_fraction raises ValueError on each
INVALID_SCHEDULES = (
    ("[] (no time step)", []),
    ("[[], []] (time steps without a stage)", [[], []]),
    ("[[('F', 0), None], [('B', 0)]] (steps of 2 and 1 entries)", [[("F", 0), None], [("B", 0)]]),
    ("[[None, None], [None, None]] (no stage ever works)", [[None, None], [None, None]]),
)


def bubble_tables() -> list[tuple[str, list, int, int]]:
    """:data:`BUBBLE_TABLES` as (what, schedule, idle slots, makespan)."""
    return [(what, table(*rows), idle, makespan) for what, rows, idle, makespan in BUBBLE_TABLES]


def random_bubble_case(g) -> tuple[str, list, int, int]:
    """(what, schedule, idle slots, makespan) of a random schedule of 1 to 6 stages, built
    around its idle count: ``lead`` idle steps, then ``body`` steps in which ``k`` slots are
    idle and the others run ('F' or 'B', i) (one slot of the last is always busy), then
    ``trail`` idle steps after the makespan."""
    p, lead, body, trail = (rand_int(g, 1, 6), rand_int(g, 0, 2), rand_int(g, 1, 12),
                            rand_int(g, 0, 3))
    busy_last = (body - 1) * p + rand_int(g, 0, p - 1)       # a slot of the body's last step
    others = [slot for slot in range(p * body) if slot != busy_last]
    k = rand_int(g, 0, len(others))
    idle = {others[j] for j in torch.randperm(len(others), generator=g)[:k].tolist()}
    schedule = [[None] * p for _ in range(lead)]
    for t in range(body):
        schedule.append([None if t * p + s in idle
                         else ("FB"[rand_int(g, 0, 1)], rand_int(g, 0, 9)) for s in range(p)])
    schedule += [[None] * p for _ in range(trail)]
    what = (f"a random schedule of {p} stage(s): {lead} idle step(s), {body} step(s) with {k} "
            f"idle slot(s) up to the last busy one, then {trail} idle step(s)")
    return what, schedule, k + lead * p, lead + body
