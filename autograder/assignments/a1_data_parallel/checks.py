"""Checks for Assignment 1: data parallel from scratch.

Graded functions (see the notebook for their specifications): ``copy_params``, ``allreduce``,
``split_batch``, ``split_batch_weighted``, ``train_batch``, and the speedup of ``train_batch``
on two GPUs. Each ``test_*`` runs here, makes fresh random inputs, has a probe (``probes.py``)
call the student's function in the sandbox, and judges what came back. Points: ``spec.py``.
Nothing of the reference solution enters the student's sandbox: ``train_batch`` runs with the
student's own ``split_batch`` and ``allreduce``, and the speedup's baseline (one GPU) is the
reference's, timed in a sandbox of its own.
"""
from __future__ import annotations

import torch

from autograder.checking.expect import (assert_close, assert_close_float32, devices_for,
                                        fresh_generator, sequence, tensor)
from autograder.checking.harness import skip_unless
from autograder.checking.speed import (against_trusted_baseline, judge_rounds, median,
                                       reference_sandbox, timed_calls)
from autograder.checking.training import FunctionalModel, sgd_steps
from course.devices import gpu_count
from course.models import lenet, lenet_params, loss

from .probes import (probe_allreduce, probe_copy_params, probe_split, probe_train_batch,
                     probe_train_steps)
from .spec import SPEC

graded = SPEC.graded
ASSIGNMENT = SPEC.assignment


# ---------------------------------------------------------------------------- copy_params

def _check_copy(student, device, dtype):
    g, seed = fresh_generator()
    params = [torch.randn(*s, generator=g).to(dtype) for s in [(4, 3), (3,), (2, 2, 2)]]
    r = student.call(probe_copy_params, params, device)
    items = sequence(r["out"], "copy_params(...)", len(params))
    for i, (item, p) in enumerate(zip(items, params)):
        t = tensor(item, f"copy_params(...)[{i}]")
        assert t["device"] == device, f"copy_params(...)[{i}] is on {t['device']}, expected {device}"
        assert t["requires_grad"], f"copy_params(...)[{i}] should have requires_grad=True"
        assert_close(t["value"], p, f"copy_params(...)[{i}]", rtol=0, atol=0, seed=seed)
    assert not any(r["shares_input_storage"]), \
        "copy_params must return new tensors, not the inputs themselves (use .clone())"
    for i, (desc, p) in enumerate(zip(r["inputs_after"], params)):
        t = tensor(desc, f"params[{i}] after copy_params")
        assert not t["requires_grad"], "copy_params set requires_grad on its inputs"
        assert_close(t["value"], p, f"params[{i}] after copy_params (inputs must stay untouched)",
                     rtol=0, atol=0, seed=seed)


@graded
def test_copy_params_values_device_grad(student):
    _check_copy(student, devices_for(1)[0], torch.float32)


@graded
def test_copy_params_new_tensors_inputs_untouched(student):
    _check_copy(student, "cpu", torch.float64)
    if gpu_count() >= 2:
        _check_copy(student, "cuda:1", torch.float32)


# ---------------------------------------------------------------------------- allreduce

def _check_allreduce(student, shapes_and_devices, dtype):
    g, seed = fresh_generator()
    data = []
    for shape, device in shapes_and_devices:
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        t = (t * 10).round().to(dtype) if not dtype.is_floating_point else t.to(dtype)
        data.append(t.to(device))
    expected = sum(t.cpu() for t in data)
    r = student.call(probe_allreduce, data)
    for i, (desc, (shape, device)) in enumerate(zip(r["tensors"], shapes_and_devices)):
        t = tensor(desc, f"data[{i}] after allreduce")
        assert t["device"] == device, \
            f"data[{i}] moved from {device} to {t['device']}; it must stay on its device"
        assert_close(t["value"], expected, f"data[{i}] after allreduce", seed=seed)


@graded
def test_allreduce_two_devices(student):
    devices = devices_for(2)
    _check_allreduce(student, [((5, 7), d) for d in devices], torch.float32)


@graded
def test_allreduce_one_and_many_devices(student):
    for n in (1, 3, 4):
        _check_allreduce(student, [((6,), d) for d in devices_for(n)], torch.float32)


@graded
def test_allreduce_dtypes_and_shapes(student):
    devices = devices_for(3)
    _check_allreduce(student, [((2, 3, 4), d) for d in devices], torch.float64)
    _check_allreduce(student, [((9,), d) for d in devices], torch.int64)
    _check_allreduce(student, [((1, 1), d) for d in devices], torch.float32)


# ---------------------------------------------------------------------------- split_batch

def _check_split(student, name, batch, devices, sizes, weights=()):
    g, seed = fresh_generator()
    X = torch.randn(batch, 1, 4, 4, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    r = student.call(probe_split, name, X, y, devices, *weights)
    pair = sequence(r["out"], f"{name}(...)", 2)
    xs = sequence(pair[0], f"{name}(...)[0] (the X shards)", len(devices))
    ys = sequence(pair[1], f"{name}(...)[1] (the y shards)", len(devices))
    got = []
    for i, (xd, yd, dev) in enumerate(zip(xs, ys, devices)):
        xt, yt = tensor(xd, f"X shard {i}"), tensor(yd, f"y shard {i}")
        assert xt["device"] == dev and yt["device"] == dev, \
            f"shard {i} is on {xt['device']}/{yt['device']}, expected {dev}"
        assert xt["value"].shape[0] == yt["value"].shape[0], \
            f"shard {i}: X has {xt['value'].shape[0]} examples but y has {yt['value'].shape[0]}"
        got.append(xt["value"].shape[0])
    assert got == sizes, (f"{name} with batch {batch} over {len(devices)} device(s)"
                          f"{' and weights ' + str(list(weights[0])) if weights else ''} "
                          f"gave shard sizes {got}, expected {sizes}")
    assert_close(torch.cat([tensor(d, "X shard")["value"] for d in xs]), X,
                 f"the X shards, concatenated in device order", rtol=0, atol=0, seed=seed)
    assert_close(torch.cat([tensor(d, "y shard")["value"] for d in ys]), y,
                 f"the y shards, concatenated in device order", rtol=0, atol=0, seed=seed)
    for desc, original, what in zip(r["inputs_after"], (X, y), ("X", "y")):
        assert_close(tensor(desc, f"{what} after {name}")["value"], original,
                     f"{what} after {name} (inputs must stay untouched)", rtol=0, atol=0, seed=seed)


def even_sizes(batch: int, n: int) -> list[int]:
    """Like ``torch.tensor_split``: the first ``batch % n`` shards get one more."""
    return [batch // n + (1 if i < batch % n else 0) for i in range(n)]


@graded
def test_split_batch_even(student):
    for n, batch in ((2, 16), (4, 8), (1, 5)):
        _check_split(student, "split_batch", batch, devices_for(n), even_sizes(batch, n))


@graded
def test_split_batch_uneven(student):
    for n, batch in ((2, 9), (3, 10), (4, 7)):
        _check_split(student, "split_batch", batch, devices_for(n), even_sizes(batch, n))


# (weights, batch, expected sizes), worked out by hand from the notebook's rule: quotas
# batch * w / sum(w), integer parts first, leftovers to the largest remainders, ties earlier.
WEIGHTED_PROPORTIONAL = [([2, 1], 30, [20, 10]), ([3, 1], 10, [8, 2]),
                         ([0.5, 0.25, 0.25], 12, [6, 3, 3]), ([1, 3], 9, [2, 7])]
WEIGHTED_ROUNDING = [([1, 1, 1], 10, [4, 3, 3]), ([1, 2, 2], 11, [2, 5, 4]),
                     ([5, 3, 2], 7, [4, 2, 1]), ([1, 1], 1, [1, 0]), ([2, 1, 1], 5, [3, 1, 1])]


@graded
def test_split_batch_weighted_proportional(student):
    for weights, batch, sizes in WEIGHTED_PROPORTIONAL:
        _check_split(student, "split_batch_weighted", batch, devices_for(len(weights)),
                     sizes, (weights,))


@graded
def test_split_batch_weighted_rounding(student):
    for weights, batch, sizes in WEIGHTED_ROUNDING:
        _check_split(student, "split_batch_weighted", batch, devices_for(len(weights)),
                     sizes, (weights,))


# ---------------------------------------------------------------------------- train_batch
# train_batch runs with the student's own split_batch and allreduce (the text says it calls
# them), in the instructor's grading as in the student's self-check: no reference code ever
# enters a sandbox that runs student code. A bug there costs train_batch's points too, and its
# failure says which helper is wrong (:func:`_helpers_note`).

def expected_sgd_step(X, y, params, lr, dtype=torch.float64):
    """One SGD step of the trusted LeNet on the whole batch, on one device, in ``dtype``."""
    model = FunctionalModel(lenet, [p.to(dtype) for p in params])
    sgd_steps(model, [(X.to(dtype), y)], lr, loss=lambda out, y: loss(out, y).mean())
    return [p.detach() for p in model.params]


HELPERS = SPEC.function("train_batch").helpers


def _check_train(student, batch, n):
    """train_batch's step on ``n`` devices against one SGD step on the whole batch; a failure
    says which of the student's helpers is wrong too, if any."""
    student.with_own_helpers("train_batch", HELPERS, lambda: _judge_train(student, batch, n),
                             lambda: _helpers_note(student))


def _helpers_note(student) -> str:
    """What the student's split_batch and allreduce do on a small case."""
    devices, wrong = devices_for(3), []
    for name, check in (
            ("split_batch", lambda: _check_split(student, "split_batch", 7, devices,
                                                 even_sizes(7, 3))),
            ("allreduce", lambda: _check_allreduce(student, [((4, 5), d) for d in devices],
                                                   torch.float32))):
        try:
            check()
        except AssertionError as exc:
            wrong.append(f"your {name}: {str(exc).splitlines()[0].rstrip(': ')}")
    if not wrong:
        return ("(train_batch runs with your own split_batch and allreduce; both gave "
                "right results on a small case here)")
    return ("train_batch runs with your own split_batch and allreduce, and this is wrong "
            "with " + "; ".join(wrong) + " (fix that first; its own checks say more)")


def _judge_train(student, batch, n):
    g, seed = fresh_generator()
    params = lenet_params(scale=0.1, generator=g)
    X = torch.rand(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    lr = 0.5
    expected = expected_sgd_step(X, y, params, lr)
    expected32 = expected_sgd_step(X, y, params, lr, torch.float32)
    devices = devices_for(n)
    r = student.call(probe_train_batch, X, y, params, devices, lr)
    for d, replica in enumerate(r["replicas"]):
        for i, (desc, want, want32) in enumerate(zip(replica, expected, expected32)):
            t = tensor(desc, f"replica {d} parameter {i}")
            assert t["device"] == devices[d], f"replica {d} parameter {i} moved to {t['device']}"
            assert_close_float32(t["value"], want, want32, f"replica {d} parameter {i} after "
                                 "train_batch (vs one SGD step on the whole batch)", seed=seed)
    first = [tensor(d, "parameter")["value"] for d in r["replicas"][0]]
    for d, replica in enumerate(r["replicas"][1:], start=1):
        for i, desc in enumerate(replica):
            assert_close(tensor(desc, "parameter")["value"], first[i],
                         f"replica {d} parameter {i} (vs replica 0)", rtol=0, atol=1e-6, seed=seed)
    assert r["grads_zero"], "after train_batch every replica's gradients should be zero"


@graded
def test_train_batch_matches_single_device_sgd(student):
    _check_train(student, 16, 2)


@graded
def test_train_batch_one_device(student):
    _check_train(student, 8, 1)


@graded
def test_train_batch_three_devices_uneven_batch(student):
    _check_train(student, 13, 3)


# ---------------------------------------------------------------------------- speedup

SPEEDUP_BATCH = 1024
SPEEDUP_STEPS = 5


def seconds_on(call, gpus: int) -> float:
    """Seconds of SPEEDUP_STEPS train_batch steps on ``gpus`` GPUs (median of 3), timed here."""
    return median(timed_calls(call, probe_train_steps, gpus, SPEEDUP_BATCH, SPEEDUP_STEPS, 0,
                              repeats=3))


def speedup_round(i, student_call, reference_call):
    """One round: the reference's seconds on 1 GPU (in its own sandbox, which never ran student
    code) over each side's on 2. A student's speedup is never measured against their own
    one-GPU run, which they could pad; in the student edition, with no reference, it is (a
    self-check against a fixed threshold)."""
    return against_trusted_baseline(i, lambda call: seconds_on(call, 1),
                                    lambda call: seconds_on(call, 2), student_call, reference_call)


@graded
def test_train_batch_speedup_two_gpus(student):
    _check_train(student, 32, 2)  # a speedup counts only for correct code, measured or not
    skip_unless(gpu_count() >= 2,
                f"train_batch is correct, but its speedup needs 2 or more CUDA GPUs and this "
                f"machine has {gpu_count()}: CPU stand-ins share one CPU in one process, so "
                "splitting a batch over them cannot be faster")
    with reference_sandbox(ASSIGNMENT) as reference:
        judge_rounds(lambda i: speedup_round(i, student.call, reference),
                     what="train_batch on 2 GPUs vs the reference solution's on 1 at batch 1024",
                     fixed_threshold=1.3, reference_minimum=1.1,
                     has_reference=reference is not None)
    _check_train(student, SPEEDUP_BATCH // 8, 2)  # the code that was timed is right in this run
