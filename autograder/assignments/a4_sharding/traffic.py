"""The byte counts against real runs, in the grader: what one rank of the student's own
``ShardedOptimizer`` (ZeRO stage 1, reduce-scatter form) and ``ShardedLinear`` (stage 3) runs
sent per step by ring algorithms, and the optimizer state that sharding saved, from the
collectives and the state that the grader counted in those runs (:mod:`.runs`), at sizes
divisible by the world size (no padding).

Where a run did not issue the contract's collectives, or keep the contract's state, or did not
finish (a case that raised), the class's own checks fail it, and the byte counts are compared
with what the contract's collectives send (or the contract's state holds) at the same sizes
instead: a bug in a class costs the points of that class only, and the byte counts are always
graded (never a SKIP, which would leave them unjudged and unearned).
"""
from __future__ import annotations

from . import expected
from .runs import LINEAR_CASES, OPT_CASES, linear_each, optimizer_each

#: Bytes per element of the runs (float64) and, for the accounting, of fp32 training.
RUN_ELEMENT, FP32_ELEMENT = 8, 4
#: The world sizes of the runs that count collectives (1 rank sends nothing).
WORLDS = (2, 3)
_INSTEAD = ("your {what} did not issue the contract's collectives in its run (its own checks say "
            "why), so these are the bytes the contract's collectives send")


def ring_bytes(log, world: int) -> int:
    """Bytes one rank sends in the logged collectives ``(op, input elements, output elements)``
    with ring algorithms: ``N - 1`` of the ``N`` chunks of each one's full vector (an
    all-gather's output, a reduce-scatter's input)."""
    full = sum(out if op == "ALLGATHER" else inp for op, inp, out in log)
    return (world - 1) * full * RUN_ELEMENT // world


def _replies(walk) -> list:
    """Every item ``walk()`` yields (cases that raised left out), or none when the run itself
    failed (its class's checks say why)."""
    try:
        return list(walk())
    except AssertionError:
        return []


def _numel(kind: str) -> int:
    return sum(p.numel() for p in expected.seeded_model(kind, 0).parameters())


def _contract(ops, numel: int) -> list:
    """The contract's collectives of one step, as logged: ``(op, in, out)`` per rank."""
    return [(op, numel, numel) for op in ops]


def traffic_of_runs(student) -> tuple[int | None, dict]:
    """(seed, {(P, N, stage): (bytes one rank sent, where they come from)}) for one ``step()``
    of the ShardedOptimizer (stage 1) and one forward and backward of the ShardedLinear
    (stage 3), at each case's P divisible by N: counted from the run where it issued exactly the
    contract's collectives of the whole vector, else those of the contract."""
    sizes = {(_numel(kind), n, 1) for kind, _, _ in OPT_CASES for n in WORLDS}
    sizes |= {(i * o + (o if bias else 0), n, 3) for i, o, bias, *_ in LINEAR_CASES for n in WORLDS}
    contract = {1: ("ALLGATHER", "REDUCE_SCATTER"), 3: ("ALLGATHER", "ALLGATHER", "REDUCE_SCATTER")}
    sent = {(p, n, s): (ring_bytes(_contract(contract[s], p), n),
                        _INSTEAD.format(what="ShardedOptimizer" if s == 1 else "ShardedLinear"))
            for p, n, s in sorted(sizes) if p % n == 0}
    seed = None
    logs = [(seed, world, _numel(case[0]), 1, log, "one step() of your ShardedOptimizer")
            for seed, world, rank, i, case, r in
            _replies(lambda: optimizer_each(student, skip_failed=True)) for log in r["sized"]]
    logs += [(seed, world, want["numel"], 3, r["sized"],
              "one forward and backward of your ShardedLinear")
             for seed, world, rank, case, r, want, _ in
             _replies(lambda: linear_each(student, skip_failed=True))]
    for seed, world, numel, stage, log, what in logs:
        got = sorted((op, inp if op == "REDUCE_SCATTER" else out) for op, inp, out in log)
        if (numel, world, stage) in sent and got == sorted(
                (op, numel) for op in contract[stage]):
            sent[numel, world, stage] = (ring_bytes(log, world), (
                f"what one rank sent in {what} on {world} ranks ({numel} float64 elements), by "
                "ring algorithms"))
    return seed, sent


def state_saved_by_sharding(student) -> tuple[int | None, dict]:
    """(seed, {(P, N): (AdamW's state on 1 rank, on each of N ranks, in bytes; where they come
    from)}) for the ShardedOptimizer's AdamW cases with P divisible by N: from the run where
    every rank kept the contract's state (two float64 moments of its shard's elements), else
    the contract's."""
    per_element = 2 * RUN_ELEMENT  # AdamW: two moments (expected.optimizer_state_of)
    adamw = {i: _numel(kind) for i, (kind, name, _) in enumerate(OPT_CASES) if name == "AdamW"}
    kept: dict = {}
    seed = None
    for seed, world, rank, i, case, r in _replies(lambda: optimizer_each(student,
                                                                            skip_failed=True)):
        if i in adamw and adamw[i] % world == 0:
            shard = adamw[i] // world
            ok = r["is_optimizer"] is True and r["owned"] == shard \
                and r["state_bytes"] == shard * per_element
            kept.setdefault((i, world), []).append(ok)
    saved = {}
    for i, numel in adamw.items():
        for world in WORLDS:
            if numel % world:
                continue
            one, each = numel * per_element, numel // world * per_element
            from_run = all(kept.get((i, w)) and all(kept[i, w]) for w in (1, world))
            saved[numel, world] = (one, each, (
                f"your ShardedOptimizer's AdamW state was {one} bytes on 1 rank and {each} on "
                f"each of {world} ranks" if from_run else
                f"your ShardedOptimizer did not keep the contract's AdamW state in its run (its "
                f"own checks say why), so the contract's: {one} bytes on 1 rank and {each} on "
                f"each of {world} ranks"))
    return seed, saved
