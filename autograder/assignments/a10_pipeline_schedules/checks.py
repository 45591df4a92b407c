"""Checks for Assignment 10: pipeline schedules of today.

Generators: fixed and seeded random (p, v, m), validated by :mod:`.judging` (the stated placement,
each action once, its order on its rank, no deadlock), then their bubble and peak in flight
against the text's bounds; the ValueError cases. The split backward against autograd on the
whole stage, with what ``backward_input`` leaves alive counted in the sandbox. ``run_schedule``
on 2, 3 and 4 gloo ranks (one launch each, shared by the gradient and timeline checks) over
schedules the grader writes (GPipe, torch's own lists) and the student's own valid lists; random
valid schedules on 3 ranks; bad schedules refused on every rank before any call is noted; a timed
run against one process and the reference's speedup. Points: spec.py.
"""
from __future__ import annotations

import random

import torch

from autograder.checking.expect import assert_close, fresh_generator, tensor
from autograder.checking.harness import skip_unless
from autograder.checking.ranks import probe_server_run
from autograder.checking.speed import (against_trusted_baseline, check_work_done, timed,
                                       timed_rounds, usable_cores)
from course import schedules

from . import judging as J
from .probes import (probe_backward_input, probe_backward_weight, probe_generate, probe_refusals,
                     probe_run_cases, probe_value_errors)
from .ranks import (SPEED_DEPTH, SPEED_M, SPEED_P, SPEED_ROWS, SPEED_V, SPEED_WIDTH,
                    grader_batches, grader_stages, schedule_server, speed_scale)
from .spec import SPEC

graded = SPEC.graded
ASSIGNMENT = SPEC.assignment


def _rng() -> random.Random:
    _, seed = fresh_generator()
    return random.Random(seed)


def _generate(student, name, cases, placement_of, kinds, bounds_of=None):
    replies = student.call(probe_generate, name, cases)
    assert isinstance(replies, list) and len(replies) == len(cases), "the reply was tampered with"
    for args, reply in zip(cases, replies):
        what = J.call_text(name, args)
        lists = J.lists_of(reply, what)
        p, m = args[0], args[-1]
        timeline = J.validate(lists, what, p, m, placement_of(*args), kinds)
        if bounds_of is not None:
            J.assert_within(lists, timeline, what, *bounds_of(*args))


def _value_errors(student, name, cases):
    got = student.call(probe_value_errors, name, cases)
    for args, error in zip(cases, got):
        assert error == "ValueError", f"{J.call_text(name, args)} should raise ValueError; it raised {error}"


# ---------------------------------------------------------------------------- interleaved 1F1B

INTERLEAVED = [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 1, 8), (2, 4, 2), (1, 3, 2), (4, 3, 4)]


def _interleaved(student, cases, bounds=True):
    _generate(student, "interleaved_1f1b", cases, lambda p, v, m: J.interleaved_placement(p, v),
              "FB", J.interleaved_bounds if bounds else None)


@graded
def test_interleaved_1f1b_fixed_cases_are_valid(student):
    _interleaved(student, INTERLEAVED, bounds=False)


@graded
def test_interleaved_1f1b_within_the_bubble_and_memory_bounds(student):
    _interleaved(student, INTERLEAVED)


@graded
def test_interleaved_1f1b_random_cases_and_value_errors(student):
    rng = _rng()
    _interleaved(student, [J.random_interleaved(rng) for _ in range(8)])
    _value_errors(student, "interleaved_1f1b",
                  [(2, 2, 3), (4, 2, 2), (0, 1, 1), (2, 0, 2), (2, 2, 0), (2.0, 1, 2), (True, 1, 1),
                   (2, 1, -2)])


# ---------------------------------------------------------------------------- ZB-H1

H1 = [(2, 2), (4, 4), (4, 8), (3, 7), (1, 1), (5, 12)]


def _h1(student, cases):
    _generate(student, "zero_bubble_h1", cases, lambda p, m: {s: s for s in range(p)}, "FIW",
              J.h1_bounds)


@graded
def test_zero_bubble_h1_valid_and_within_bounds(student):
    _h1(student, H1)


@graded
def test_zero_bubble_h1_random_cases_and_value_errors(student):
    rng = _rng()
    _h1(student, [J.random_h1(rng) for _ in range(8)])
    _value_errors(student, "zero_bubble_h1", [(3, 2), (0, 1), (2, 2.5), (True, 2), (2, 0)])


# ---------------------------------------------------------------------------- ZB-V

ZBV = [(2, 4), (4, 8), (3, 7), (1, 2), (2, 9)]


def _v(student, cases, bounds):
    _generate(student, "zero_bubble_v", cases, lambda p, m: J.v_placement(p), "FIW",
              J.v_bounds if bounds else None)


@graded
def test_zero_bubble_v_placed_in_a_v_and_valid(student):
    _v(student, ZBV, bounds=False)


@graded
def test_zero_bubble_v_within_bounds_on_random_cases_and_value_errors(student):
    rng = _rng()
    _v(student, ZBV + [J.random_v(rng) for _ in range(6)], bounds=True)
    _value_errors(student, "zero_bubble_v", [(2, 3), (3, 5), (0, 2), (2, 4.0), (True, 2)])


# ---------------------------------------------------------------------------- split backward

def _random_stage(rng: random.Random, g: torch.Generator):
    widths = [rng.randint(1, 9) for _ in range(rng.randint(2, 5))]
    layers = []
    for a, b in zip(widths, widths[1:]):
        linear = torch.nn.Linear(a, b, bias=rng.random() < 0.7, dtype=torch.float64)
        with torch.no_grad():
            for p in linear.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        layers.append(linear)
        for _ in range(rng.randint(0, 2)):
            layers.append(rng.choice([torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU])())
    rows = rng.randint(1, 6)
    x = torch.randn(rows, widths[0], generator=g, dtype=torch.float64)
    return torch.nn.Sequential(*layers), x, torch.randn(rows, widths[-1], generator=g, dtype=torch.float64)


def _autograd(stage, x, grad_output) -> dict:
    """What autograd gives on the whole stage: ``{"input": x's gradient, "weights": [...]}``."""
    x = x.clone().requires_grad_()
    for p in stage.parameters():
        p.grad = None
    stage(x).backward(grad_output)
    grads = [p.grad.clone() for p in stage.parameters()]
    for p in stage.parameters():
        p.grad = None
    return {"input": x.grad, "weights": grads}


def _close(actual, expected, what):
    # float64: 1e-11 relative to the largest value is ~45,000 units in the last place, far above
    # the rounding of these short sums in another order, far below any wrong term
    scale = max(expected.abs().max().item(), 1e-300) if expected.numel() else 1.0
    assert_close(actual, expected, what, rtol=1e-11, atol=1e-11 * scale)


def _split_cases(n):
    _, seed = fresh_generator()
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    return [_random_stage(rng, g) for _ in range(n)]


@graded
def test_backward_input_matches_autograd(student):
    cases = _split_cases(6)
    replies = student.call(probe_backward_input, cases)
    for i, ((stage, x, grad_output), reply) in enumerate(zip(cases, replies)):
        what = f"backward_input(stage, x, grad_output) with stage = {stage}, x of shape {tuple(x.shape)}"
        assert "bad" not in reply, f"{what}: {reply['bad']}"
        want = _autograd(stage, x, grad_output)["input"]
        got = tensor(reply["grad_input"], f"{what}: grad_input")["value"]
        _close(got, want, f"{what}: grad_input")
        assert not any(reply["grads"]), f"{what} changed a parameter's .grad; only backward_weight may"


@graded
def test_backward_input_keeps_only_what_the_weights_need(student):
    cases = _split_cases(6)
    replies = student.call(probe_backward_input, cases)
    for (stage, x, _), reply in zip(cases, replies):
        what = f"backward_input(stage, x, grad_output) with stage = {stage}, x of shape {tuple(x.shape)}"
        assert "bad" not in reply, f"{what}: {reply['bad']}"
        assert reply["graph_alive"] == 0, (
            f"{what}: {reply['graph_alive']} tensor(s) that autograd saved for a backward during the "
            "call are still held after it returned: an autograd graph outlives it")
        rows = x.shape[0]
        bound = sum(rows * (l.in_features + l.out_features) for l in stage
                    if isinstance(l, torch.nn.Linear)) * x.element_size()
        assert reply["kept_bytes"] <= bound, (
            f"{what}: after it returned, {reply['kept_bytes']} bytes of tensors it made are still "
            f"alive besides grad_input; the text allows {bound} (each Linear's input and the "
            "gradient of its output)")


@graded
def test_backward_weight_delayed_and_reordered_matches_autograd(student):
    _, seed = fresh_generator()
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(3):
        stage, x, grad_output = _random_stage(rng, g)
        xs = [x] + [torch.randn(x.shape, generator=g, dtype=x.dtype) for _ in range(2)]
        gos = [grad_output] + [torch.randn(grad_output.shape, generator=g, dtype=x.dtype) for _ in range(2)]
        start = [None if rng.random() < 0.5 else torch.randn(p.shape, generator=g, dtype=p.dtype)
                 for p in stage.parameters()]
        order = [2, 0, 1]
        got = student.call(probe_backward_weight, stage, xs, gos, order, start)
        want = [torch.zeros_like(p) if s is None else s.clone() for p, s in zip(stage.parameters(), start)]
        for xi, gi in zip(xs, gos):
            for w, grad in zip(want, _autograd(stage, xi, gi)["weights"]):
                w += grad
        what = (f"backward_weight after backward_input on 3 micro-batches, called in the order "
                f"{order}, with stage = {stage}")
        for i, (desc, w) in enumerate(zip(got, want)):
            _close(tensor(desc, f"{what}: parameter {i}'s .grad")["value"], w, f"{what}: parameter {i}'s .grad")


# ---------------------------------------------------------------------------- run_schedule

def _torch_lists(name, p, m, v):
    """torch's own lists for a built-in schedule, as Part 1's strings (DualPipeV's overlapped
    pairs as their forward, then their backward); None where torch refuses or they are not valid."""
    try:
        order = schedules.torch_order(name, p, m, v)
        lists = [[str(op) for a in order[r] for op in schedules.parse_action(a)] for r in range(p)]
        schedules.check(lists, m)
        return lists
    except (ValueError, AssertionError):
        return None


def _gpipe(p, m):
    return [[f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)] for r in range(p)]


def _own(student, name, args, kinds, placement):
    """The student's own lists for args where the grader's validator accepts them, else None."""
    reply = student.call(probe_generate, name, [args])[0]
    try:
        lists = J.lists_of(reply, name)
        J.validate(lists, name, args[0], args[-1], placement, kinds)
        return lists
    except AssertionError:
        return None


def _case(seed, lists, m, width=6, rows=3, depth=2):
    return {"seed": seed, "schedule": lists, "m": m, "n_stages": len(schedules.stage_ranks(lists)),
            "width": width, "rows": rows, "depth": depth, "placement": J.placement_by_rank(lists)}


def _runs(student):
    """One launch each on 2, 3 and 4 ranks, shared by the gradient and timeline checks."""
    def compute():
        _, seed = fresh_generator()
        plans = {
            2: [("GPipe", _gpipe(2, 3), 3), ("torch's interleaved 1F1B", _torch_lists("Interleaved1F1B", 2, 4, 2), 4),
                ("torch's ZB-V", _torch_lists("ZBVZeroBubble", 2, 4, 2), 4),
                ("your zero_bubble_h1(2, 3)", _own(student, "zero_bubble_h1", (2, 3), "FIW", {0: 0, 1: 1}), 3)],
            3: [("torch's ZB-H1", _torch_lists("InterleavedZeroBubble", 3, 3, 1), 3),
                ("torch's DualPipeV", _torch_lists("DualPipeV", 3, 6, 2), 6),
                ("your interleaved_1f1b(3, 2, 3)", _own(student, "interleaved_1f1b", (3, 2, 3), "FB",
                                                        J.interleaved_placement(3, 2)), 3)],
            4: [("torch's ZB-V", _torch_lists("ZBVZeroBubble", 4, 8, 2), 8),
                ("your zero_bubble_v(4, 8)", _own(student, "zero_bubble_v", (4, 8), "FIW", J.v_placement(4)), 8)],
        }
        out = {}
        for world, plan in plans.items():
            named = [(what, _case(seed + world, lists, m)) for what, lists, m in plan if lists is not None]
            replies = student.call(probe_run_cases, world, [case for _, case in named])
            assert isinstance(replies, list) and len(replies) == world, "the reply was tampered with"
            out[world] = (named, replies)
        return out
    return student.shared("a10-runs", compute)


@graded
def test_run_schedule_gradients_match_one_process(student):
    for world, (named, replies) in _runs(student).items():
        for k, (what, case) in enumerate(named):
            J.judge_gradients(case, [reply[k] for reply in replies], f"run_schedule on {world} ranks, {what}")


@graded
def test_run_schedule_random_valid_schedules(student):
    _, seed = fresh_generator()
    rng = random.Random(seed)
    cases = [_case(seed + i, J.random_schedule(rng, 3, n, m, split), m)
             for i, (n, m, split) in enumerate([(3, 2, 0.0), (5, 3, 0.5), (6, 2, 1.0), (4, 3, 0.5)])]
    replies = student.call(probe_run_cases, 3, cases)
    assert isinstance(replies, list) and len(replies) == 3, "the reply was tampered with"
    for k, case in enumerate(cases):
        J.judge_gradients(case, [reply[k] for reply in replies],
                         f"run_schedule on 3 ranks with the random schedule {case['schedule']}")


@graded
def test_run_schedule_refuses_bad_schedules_before_sending(student):
    bad = J.bad_schedules(_rng())
    _, seed = fresh_generator()
    # last, a valid schedule that must run (a run_schedule that refuses everything fails here)
    cases = [dict(_case(seed, _gpipe(2, m), m), schedule=lists) for _, lists, m in bad]
    cases.append(_case(seed, _gpipe(2, 2), 2))
    replies = student.call(probe_refusals, 2, cases)
    assert isinstance(replies, list) and len(replies) == 2 and \
        all(isinstance(r, list) and len(r) == len(cases) for r in replies), "the reply was tampered with"
    for k, (why, lists, m) in enumerate(bad):
        for rank, reply in enumerate(replies):
            got = reply[k]
            what = f"run_schedule on rank {rank} of 2 with {lists} and m = {m} ({why})"
            assert got["raised"] == "ValueError", f"{what} should raise ValueError; it raised {got['raised']}"
            assert got["calls"] == 0, (f"{what} made {got['calls']} message or collective call(s) "
                                       "before refusing; it must refuse before any")
    for rank, reply in enumerate(replies):
        got = reply[-1]
        assert got["raised"] == "nothing (it returned)" and got["calls"] > 0, (
            f"run_schedule on rank {rank} of 2 with the valid GPipe lists {cases[-1]['schedule']} "
            f"raised {got['raised']} (after the bad schedules, each refused): a valid schedule must run")


@graded
def test_run_schedule_timelines(student):
    for world, (named, replies) in _runs(student).items():
        for k, (what, case) in enumerate(named):
            J.judge_timelines([reply[k]["timeline"] for reply in replies], case["schedule"],
                              f"run_schedule on {world} ranks, {what}: the timeline")


# ---------------------------------------------------------------------------- the time

def _speed_lists():
    lists = _torch_lists("Interleaved1F1B", SPEED_P, SPEED_M, SPEED_V)
    assert lists is not None, "torch's interleaved 1F1B lists are not valid here (a grader bug)"
    return lists


def pipe_over_base(i, student_call, reference_call):
    return against_trusted_baseline(
        i, lambda call: timed(call, probe_server_run, "a10-speed", "base"),
        lambda call: timed(call, probe_server_run, "a10-speed", "pipe"), student_call, reference_call)


@graded
def test_run_schedule_speedup_two_cpu_processes(student):
    cores = usable_cores()
    skip_unless(cores >= 2, f"timing run_schedule needs 2 free CPU cores; this machine gives the "
                            f"grader {cores}: not graded here")
    _, seed = fresh_generator()
    lists = _speed_lists()
    placement = J.placement_by_rank(lists)

    def verify(results, sent):
        check_work_done([r["steps"] for r in results["a10-speed"]], sent("a10-speed", "pipe"),
                        "run_schedule's timed run")
        parts = grader_stages(seed, SPEED_P * SPEED_V, SPEED_WIDTH, SPEED_DEPTH, torch.float32)
        inputs, targets = grader_batches(seed, SPEED_M, SPEED_ROWS, SPEED_WIDTH, torch.float32)
        last = speed_scale(results["a10-speed"][0]["steps"] - 1)
        J.judge_speed_gradients(results["a10-speed"], parts, [x * last for x in inputs], targets, seed)

    timed_rounds(student, ASSIGNMENT,
                 [("a10-speed", "run_schedule", schedule_server, SPEED_P, (seed, lists, placement),
                   "gloo", ("pipe", "base"))],
                 pipe_over_base, verify,
                 what=f"run_schedule on {SPEED_P} CPU processes (interleaved 1F1B, v = {SPEED_V}, "
                      f"m = {SPEED_M}) vs one process",
                 fixed_threshold=1.05, reference_minimum=1.2, processes=SPEED_P, max_rounds=9)
