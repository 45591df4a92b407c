"""The byte counts against real runs, in the grader: what one rank of the student's own
``ShardedOptimizer`` and ``ShardedLinear`` runs sent per step by ring algorithms, and the
optimizer state that sharding saved, from the collectives and the state that the grader counted
in those runs (:mod:`.runs`), at sizes divisible by the world size (no padding).

A run counts only where it issued the contract's collectives (or kept the contract's state):
where it did not, its class's own checks say so, and the byte counts are not judged on it (a
bug costs the points of one function only).
"""
from __future__ import annotations

from autograder.checking.harness import skip_unless

from . import expected
from .runs import linear_each, optimizer_each

#: Bytes per element of the runs (float64) and, for the accounting, of fp32 training.
RUN_ELEMENT, FP32_ELEMENT = 8, 4


def ring_bytes(log, world: int) -> int:
    """Bytes one rank sends in the logged collectives ``(op, input elements, output elements)``
    with ring algorithms: ``N - 1`` of the ``N`` chunks of each one's full vector (an
    all-gather's output, a reduce-scatter's input)."""
    full = sum(out if op == "ALLGATHER" else inp for op, inp, out in log)
    return (world - 1) * full * RUN_ELEMENT // world


def _runs_or_skip(walk, what: str) -> list:
    """Every item ``walk()`` yields, or a SKIP when the run failed (its class's checks fail)."""
    try:
        return list(walk())
    except AssertionError as exc:
        skip_unless(False, f"your {what} did not run to the end here, so the byte counts cannot "
                           f"be compared with its run (its own checks say why: "
                           f"{str(exc).splitlines()[0][:300]})")


def traffic_of_runs(student) -> tuple[int, dict, dict]:
    """(seed, {(P, N, stage): bytes one rank sent}, {(P, N, stage): where it was counted}) for
    one ``step()`` of the ShardedOptimizer (stage 2) and one forward and backward of the
    ShardedLinear (stage 3) on N >= 2 ranks, with P divisible by N, where they issued exactly the
    contract's collectives of the whole vector. SKIP when no run can be used."""
    sent, where, seed = {}, {}, None
    for seed, world, rank, i, case, r in _runs_or_skip(lambda: optimizer_each(student),
                                                       "ShardedOptimizer"):
        numel = sum(p.numel() for p in expected.seeded_model(case[0], 0).parameters())
        if world < 2 or numel % world:
            continue
        for log in r["sized"]:
            if sorted((op, inp if op == "REDUCE_SCATTER" else out) for op, inp, out in log) == [
                    ("ALLGATHER", numel), ("REDUCE_SCATTER", numel)]:
                sent[numel, world, 2] = ring_bytes(log, world)
                where[numel, world, 2] = (f"what one rank sent in one step() of your "
                                          f"ShardedOptimizer on {world} ranks ({numel} float64 "
                                          "elements), by ring algorithms")
    for seed, world, rank, case, r, want in _runs_or_skip(lambda: linear_each(student),
                                                          "ShardedLinear"):
        numel = want["numel"]
        got = sorted((op, inp if op == "REDUCE_SCATTER" else out) for op, inp, out in r["sized"])
        if world >= 2 and numel % world == 0 and got == [
                ("ALLGATHER", numel), ("ALLGATHER", numel), ("REDUCE_SCATTER", numel)]:
            sent[numel, world, 3] = ring_bytes(r["sized"], world)
            where[numel, world, 3] = (f"what one rank sent in one forward and backward of your "
                                      f"ShardedLinear on {world} ranks ({numel} float64 "
                                      "elements), by ring algorithms")
    skip_unless(bool(sent), "neither your ShardedOptimizer nor your ShardedLinear issued the "
                            "contract's collectives in its run (their own checks say how), so "
                            "the bytes they sent cannot be compared with comm_bytes_per_step")
    return seed, sent, where


def state_saved_by_sharding(student) -> tuple[int, dict]:
    """(seed, {(P, N): (AdamW's state on 1 rank, on each of N ranks) in bytes}) of the
    ShardedOptimizer's AdamW cases with P divisible by N >= 2, where each rank kept the
    contract's state (two float64 moments of its shard's elements). SKIP when none did."""
    state: dict = {}
    seed = None
    for seed, world, rank, i, case, r in _runs_or_skip(lambda: optimizer_each(student),
                                                       "ShardedOptimizer"):
        kind, name, kwargs = case
        numel = sum(p.numel() for p in expected.seeded_model(kind, 0).parameters())
        per_element = expected.optimizer_state_per_element(name, kwargs) * RUN_ELEMENT
        if name != "AdamW" or numel % world:
            continue
        kept = r["state_bytes"] if r["is_optimizer"] and r["owned"] == numel // world else None
        state.setdefault(i, {}).setdefault(world, []).append(
            kept if kept == numel // world * per_element else None)
        state[i]["numel"] = numel
    saved = {}
    for runs in state.values():
        (one,) = runs[1]
        for world in (2, 3):
            kept = runs.get(world, [None])
            if one is not None and world in runs and all(k is not None for k in kept):
                saved[runs["numel"], world] = (one, kept[0])
    skip_unless(bool(saved), "your ShardedOptimizer did not keep the contract's AdamW state in "
                             "its run (its own checks say how), so model_state_bytes cannot be "
                             "compared with it")
    return seed, saved
