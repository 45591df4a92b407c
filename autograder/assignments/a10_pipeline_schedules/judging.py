"""Judging Assignment 10, in the grader: the generators' lists (placement, validity, bubble and
peak in flight against the text's bounds, with :mod:`course.schedules`' model), the schedules the
grader writes for ``run_schedule`` (random valid ones, and bad ones it must refuse), the
timelines, and the one-process gradients. Each failure is an AssertionError the student reads.
"""
from __future__ import annotations

import copy
import random

import torch

from autograder.checking.expect import float32_tolerance_of_all, tensor

from course import schedules

from .ranks import SPEED_M, grader_batches, grader_stages, mse

#: floating-point slack on a bound (the model's times are sums of multiples of 1 / v)
SLACK = 1e-9


def call_text(name: str, args) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def lists_of(reply: dict, what: str) -> list[list[str]]:
    """The lists a generator returned, or an AssertionError saying what came back instead."""
    assert isinstance(reply, dict), "the probe's reply was tampered with"
    assert "error" not in reply, f"{what} raised {reply.get('error')}"
    lists = reply.get("lists")
    if isinstance(lists, dict):
        raise AssertionError(f"{what} returned {lists.get('bad')}")
    assert isinstance(lists, list) and all(isinstance(r, list) for r in lists), \
        "the probe's reply was tampered with"
    return lists


def validate(lists, what: str, p: int, m: int, placement: dict, kinds: str) -> dict:
    """Part 1's rules 1-4, the stated placement (``{stage: rank}``) and kinds of action; returns
    the model's timeline."""
    assert len(lists) == p, f"{what} returned {len(lists)} list(s); there are {p} ranks"
    for rank, entries in enumerate(lists):
        for action in entries:
            try:
                ops = schedules.parse_action(action)
            except ValueError:
                ops = ()
            if len(ops) != 1 or ops[0].kind not in kinds or str(ops[0]) != action.strip() \
                    or action != action.strip():
                raise AssertionError(f"{what}: rank {rank}'s list holds {action!r}, not an action "
                                     f"'<stage><kind><micro-batch>' with kind one of {', '.join(kinds)}")
            stage = ops[0].stage
            if placement.get(stage) != rank:
                where = (f"on rank {placement[stage]}" if stage in placement
                         else f"not one of the {len(placement)} stages 0..{len(placement) - 1}")
                raise AssertionError(f"{what}: rank {rank}'s list holds {action}, but stage {stage} "
                                     f"is {where} in the placement the text states")
    try:
        return schedules.check(lists, m)
    except ValueError as exc:
        raise AssertionError(f"{what} is not a valid schedule: {exc}") from None


def assert_within(lists, timeline, what: str, bubble_bound: float, peak_bounds: list) -> None:
    got = schedules.bubble(timeline)
    assert got <= bubble_bound + SLACK, (
        f"{what}: its bubble is {got:.4f} (idle over compute time, course.schedules' model); the "
        f"text's bound is {bubble_bound:.4f}")
    peaks = schedules.peak_in_flight(lists)
    for rank, (peak, bound) in enumerate(zip(peaks, peak_bounds)):
        assert peak <= bound, (f"{what}: rank {rank} holds {peak} micro-batches' activations at its "
                               f"peak (course.schedules.peak_in_flight); the text's bound is {bound}")


# --------------------------------------------------------------------- the three generators

def interleaved_placement(p: int, v: int) -> dict:
    return {s: s % p for s in range(p * v)}


def v_placement(p: int) -> dict:
    return {s: s if s < p else 2 * p - 1 - s for s in range(2 * p)}


def interleaved_bounds(p: int, v: int, m: int):
    return (p - 1) / (v * m), [min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)]


def h1_bounds(p: int, m: int):
    return (p - 1) / (3 * m), [p] * p


def v_bounds(p: int, m: int):
    return (p - 1) / (6 * m), [2 * p] * p


def random_interleaved(rng: random.Random) -> tuple:
    p, v = rng.randint(1, 6), rng.randint(1, 4)
    return p, v, p * rng.randint(1, 5)


def random_h1(rng: random.Random) -> tuple:
    p = rng.randint(1, 6)
    return p, rng.randint(p, 5 * p)


def random_v(rng: random.Random) -> tuple:
    p = rng.randint(1, 6)
    return p, rng.randint(2 * p, 5 * p)


# --------------------------------------------------------------------- schedules the grader writes

def random_schedule(rng: random.Random, p: int, n_stages: int, m: int, split: float) -> list:
    """A random valid schedule: stages placed at random (each rank at least one), each stage's
    backward whole or split at random (per micro-batch, with probability ``split``), and the
    ranks' lists cut from one random order in which every action follows what it needs (so no
    deadlock)."""
    order = list(range(n_stages))
    rng.shuffle(order)
    place = {s: (i if i < p else rng.randrange(p)) for i, s in enumerate(order)}
    splits = {(s, mb): rng.random() < split for s in range(n_stages) for mb in range(m)}
    done, lists = set(), [[] for _ in range(p)]
    pending = {(s, k, mb) for s in range(n_stages) for mb in range(m)
               for k in (("F", "I", "W") if splits[(s, mb)] else ("F", "B"))}

    def ready(s, k, mb):
        if k == "F":
            return s == 0 or (s - 1, "F", mb) in done
        if k == "W":
            return (s, "I", mb) in done
        later = s == n_stages - 1 or (s + 1, "B", mb) in done or (s + 1, "I", mb) in done
        return (s, "F", mb) in done and later

    while pending:
        action = rng.choice(sorted(a for a in pending if ready(*a)))
        pending.discard(action)
        done.add(action)
        s, k, mb = action
        lists[place[s]].append(f"{s}{k}{mb}")
    schedules.check(lists, m)
    return lists


def bad_schedules(rng: random.Random) -> list[tuple[str, list, int]]:
    """(what is wrong, lists, m) for 2 ranks, 2 stages (stage s on rank s): each must be refused."""
    good = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    cases = [
        ("a deadlock: rank 1 runs micro-batch 1 first, rank 0 waits for micro-batch 0's backward",
         [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]], 2),
        ("a deadlock between I and F", [["0F0", "0I0", "0F1", "0I1", "0W0", "0W1"],
                                        ["1F1", "1I1", "1W1", "1F0", "1I0", "1W0"]], 2),
        ("W before its I", [good[0], ["1F0", "1W0", "1I0", "1F1", "1B1"]], 2),
        ("micro-batch 1's W missing", [good[0], ["1F0", "1B0", "1F1", "1I1"]], 2),
        ("a forward twice", [["0F0", "0F1", "0B0", "0B1", "0F1"], good[1]], 2),
        ("stage 1 on both ranks", [["0F0", "0F1", "0B0", "0B1", "1F0"],
                                   ["1F1", "1B0", "1B1"]], 2),
        ("micro-batch 2 named, with m = 2", [["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"],
                                             ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]], 2),
        ("a backward before its forward", [["0F0", "0F1", "0B0", "0B1"],
                                           ["1B0", "1F0", "1F1", "1B1"]], 2),
    ]
    rng.shuffle(cases)
    for what, lists, m in cases:
        try:
            schedules.check(lists, m)
        except ValueError:
            continue
        raise AssertionError(f"the grader's bad schedule ({what}) is valid")  # pragma: no cover
    return cases


def placement_by_rank(lists) -> list[list[int]]:
    """Each rank's stages, as the lists place them (the first rank that names a stage has it)."""
    out = [[] for _ in lists]
    seen = set()
    for rank, entries in enumerate(lists):
        for action in entries:
            stage = schedules.parse_action(action)[0].stage
            if stage not in seen:
                seen.add(stage)
                out[rank].append(stage)
    return [sorted(s) for s in out]


# --------------------------------------------------------------------- what the runs must give

def one_process(case) -> tuple[list, list]:
    """Per stage, the gradients of one process's step on the whole model, and per parameter the
    sum over micro-batches of each one's absolute gradient (for the tolerance)."""
    parts = grader_stages(case["seed"], case["n_stages"], case["width"], case["depth"])
    inputs, targets = grader_batches(case["seed"], case["m"], case["rows"], case["width"])
    params = [p for part in parts for p in part.parameters()]
    total = [torch.zeros_like(p) for p in params]
    scale = [torch.zeros_like(p) for p in params]
    for x, y in zip(inputs, targets):
        h = x
        for part in parts:
            h = part(h)
        grads = torch.autograd.grad(mse(h, y) / case["m"], params)
        for t, s, g in zip(total, scale, grads):
            t += g
            s += g.abs()
    return total, scale


def tolerance(scale: torch.Tensor, case) -> torch.Tensor:
    """Float64 rounding of a sum of m per-micro-batch gradients, each a product through the
    stages' layers, computed in another order: 64 (m + layers) units in the last place of the
    sum of the terms' magnitudes."""
    eps = torch.finfo(torch.float64).eps
    return 64 * (case["m"] + case["n_stages"] * case["depth"]) * eps * scale + 1e-300


def judge_timelines(timelines, lists, what: str) -> None:
    """Part 4's timeline on every rank: the rank's actions in list order, each from its start to
    its end, after the previous one, and after what it needs ended (on any rank: one clock)."""
    n_stages = len(schedules.stage_ranks(lists))
    start, end = {}, {}
    for rank, (timeline, entries) in enumerate(zip(timelines, lists)):
        if isinstance(timeline, dict):
            raise AssertionError(f"{what}: rank {rank}: {timeline.get('bad')}")
        actions = [a for a, _, _ in timeline]
        assert actions == entries, (f"{what}: rank {rank}'s timeline lists {actions[:12]}...; its "
                                    f"list is {entries[:12]}... (one entry per action, in order)")
        previous = float("-inf")
        for action, t0, t1 in timeline:
            assert previous <= t0 <= t1, (f"{what}: rank {rank}'s {action} runs from {t0:.6f} to "
                                          f"{t1:.6f}, the action before it ended at {previous:.6f}")
            previous = t1
            op = schedules.parse_action(action)[0]
            start[op], end[op] = t0, t1
    for op, t0 in start.items():
        needs = []
        if op.kind == "F" and op.stage > 0:
            needs = [schedules.Op(op.stage - 1, "F", op.mb)]
        elif op.kind in ("B", "I") and op.stage < n_stages - 1:
            needs = [o for o in (schedules.Op(op.stage + 1, k, op.mb) for k in "BI") if o in end]
        elif op.kind == "W":
            needs = [schedules.Op(op.stage, "I", op.mb)]
        for need in needs:
            assert end[need] <= t0, (f"{what}: {op} started at {t0:.6f}, before {need}, which it "
                                     f"needs, ended ({end[need]:.6f})")


def judge_gradients(case, per_rank, what):
    """Every rank's stages' ``.grad`` against :func:`one_process`, within :func:`tolerance`."""
    want, scale = one_process(case)
    sizes = [sum(1 for _ in part.parameters()) for part in
             grader_stages(case["seed"], case["n_stages"], case["width"], case["depth"])]
    offsets = [sum(sizes[:s]) for s in range(len(sizes))]
    for rank, reply in enumerate(per_rank):
        grads = reply["grads"]
        assert sorted(grads) == case["placement"][rank], "the reply was tampered with"
        for s, descs in grads.items():
            for i, desc in enumerate(descs):
                where = f"{what}: stage {s}'s parameter {i} (rank {rank})"
                assert desc is not None, f"{where}: its .grad is None after the step"
                got = tensor(desc, f"{where}: .grad")["value"]
                k = offsets[s] + i
                assert got.shape == want[k].shape and got.dtype == want[k].dtype, \
                    f"{where}: .grad of shape {tuple(got.shape)} {got.dtype}, expected {tuple(want[k].shape)} {want[k].dtype}"
                diff = (got - want[k]).abs()
                bad = diff > tolerance(scale[k], case)
                assert not bad.any(), (f"{where}: .grad differs from one process's by up to "
                                       f"{diff.max().item():.3g} (the step's loss is the mean over "
                                       f"{case['m']} micro-batches)")


def judge_speed_gradients(results, parts, inputs, targets, seed):
    """The timed run's last step (float32) against one float64 process, within the stray of a
    float32 one (:func:`~autograder.checking.expect.float32_tolerance_of_all`)."""
    whole32 = torch.nn.Sequential(*parts)
    whole64 = torch.nn.Sequential(*[copy.deepcopy(p).double() for p in parts])
    for model, dtype in ((whole32, torch.float32), (whole64, torch.float64)):
        model.zero_grad(set_to_none=True)
        for x, y in zip(inputs, targets):
            (mse(model(x.to(dtype)), y.to(dtype)) / SPEED_M).backward()
    want32 = [p.grad for p in whole32.parameters()]
    want64 = [p.grad for p in whole64.parameters()]
    tol = float32_tolerance_of_all(want64, want32)
    per_stage = len(list(parts[0].parameters()))
    for rank, result in enumerate(results):
        for s, descs in result["grads"].items():
            for i, desc in enumerate(descs):
                got = tensor(desc, f"stage {s}'s parameter {i}: .grad")["value"]
                k = s * per_stage + i
                diff = (got.double() - want64[k]).abs().max().item()
                assert diff <= tol, (f"run_schedule's timed run (seed {seed}): stage {s}'s parameter "
                                     f"{i} has wrong gradients after the last step (off by {diff:.3g})")
