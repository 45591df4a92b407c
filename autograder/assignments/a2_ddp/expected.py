"""What data-parallel training must equal, and the judging of a train_ddp run (in the grader).

The expectation is plain SGD on one process over the same global batches, computed in float64;
a float32 run of the same gives the tolerance (:func:`~autograder.checking.expect.assert_close_float32`),
so the bar follows the computation, not a guess that a busy machine's summation order can miss.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from autograder.checking.expect import (assert_close_float32, float32_tolerance_of_all, sequence,
                                        tensor)
from autograder.checking.training import sgd_steps

from .ranks import make_data, seeded_model


def one_process_sgd(model: nn.Module, batches, lr: float, world_size: int = 1
                    ) -> tuple[tuple, tuple]:
    """``((params, last grads) in float64, the same in float32)`` of plain SGD with mean
    cross-entropy over each of ``batches`` on one process, from ``model``'s parameters.

    The float32 part sets the tolerance (:func:`float32_tolerance_of_all`), so it must stray
    from float64 as far as correct float32 code can. With ``world_size > 1`` it is run twice,
    on whole batches and summed as ``world_size`` ranks sum (each batch's equal shares, their
    gradients averaged); the params and the grads each come from the run that strays farther.
    Why: at one seed the whole-batch run of a CNN strayed 3.6e-08 while correct DDP on 2
    processes strayed 2.85e-06, over the 16x bar derived from the whole-batch run alone."""
    def run(dtype, shares):
        m = copy.deepcopy(model).to(dtype)
        _, grads = sgd_steps(m, [(X.to(dtype), y) for X, y in batches], lr, shares=shares)
        return [p.detach().clone() for p in m.parameters()], grads

    params64, grads64 = run(torch.float64, 1)
    runs32 = [run(torch.float32, shares) for shares in sorted({1, world_size})]
    params32 = max((r[0] for r in runs32), key=lambda r32: float32_tolerance_of_all(params64, r32))
    grads32 = max((r[1] for r in runs32), key=lambda r32: float32_tolerance_of_all(grads64, r32))
    return (params64, grads64), (params32, grads32)


def _fetched(ranks, world_size, n, epochs, what) -> list[list[int]]:
    """Each rank's examples in the order it read them, after checking that every rank read its
    share of each epoch once, in a new order each epoch."""
    per_rank = n // world_size
    fetched = []
    for rank, r in enumerate(ranks):
        f = r.get("fetched") if isinstance(r, dict) else None
        assert isinstance(f, list) and all(isinstance(i, int) for i in f), "reply tampered with"
        assert f, (f"{what}: rank {rank} never read the data set in its own process: use "
                   "make_dataloader (num_workers=0) on the dataset you were given")
        assert len(f) == epochs * per_rank, (
            f"{what}: rank {rank} read {len(f)} examples; {epochs} epoch(s) over its shard of "
            f"{per_rank} should read {epochs * per_rank} (one pass of its loader per epoch, and "
            "nothing else)")
        fetched.append(f)
    for e in range(epochs):
        shares = [f[e * per_rank:(e + 1) * per_rank] for f in fetched]
        assert sorted(i for s in shares for i in s) == list(range(n)), (
            f"{what}: in epoch {e} the ranks did not read every example exactly once between "
            "them: use make_dataloader(dataset, batch_size, rank, world_size, seed)")
        if e:
            before = [f[(e - 1) * per_rank:e * per_rank] for f in fetched]
            assert shares != before, (
                f"{what}: epochs {e - 1} and {e} read the examples in the same order: call "
                "loader.sampler.set_epoch(epoch) at the start of every epoch")
    return fetched


#: Expectations already computed in this grading run, by everything they depend on: the timed
#: run on 2 processes reads the same batches as the correctness check's (seconds in float64).
_EXPECTED: dict[tuple, tuple] = {}


def _expected_training(kind, seed, n, epochs, batch_size, lr, fetched) -> tuple[list, list]:
    """(float64, float32) parameters after one-process SGD on the global batches that the
    ranks read (``fetched``: each rank's examples, in order)."""
    key = (kind, seed, n, epochs, batch_size, lr, tuple(tuple(f) for f in fetched))
    if key not in _EXPECTED:
        X, y = make_data(kind, seed + 1, n)
        per_rank, batches = n // len(fetched), []
        for e in range(epochs):
            for s in range(per_rank // batch_size):
                rows = [i for f in fetched for i in
                        f[e * per_rank + s * batch_size:e * per_rank + (s + 1) * batch_size]]
                batches.append((X[rows], y[rows]))
        (want, _), (want32, _) = one_process_sgd(seeded_model(kind, seed, rank=0), batches, lr,
                                                 len(fetched))
        _EXPECTED[key] = want, want32
    return _EXPECTED[key]


def judge_training(ranks, world_size, kind, seed, n, epochs, batch_size, lr, what) -> None:
    """Every rank read its share of each epoch once, in a new order each epoch, and ended with
    the parameters of one-process SGD on the global batches it actually saw."""
    assert isinstance(ranks, list) and len(ranks) == world_size, f"{what}: reply tampered with"
    fetched = _fetched(ranks, world_size, n, epochs, what)
    replicas = []
    for rank, r in enumerate(ranks):
        items = sequence(r["params"], f"{what}: what train_ddp returned on rank {rank} "
                         "(the list of model.parameters())")
        replicas.append([tensor(d, f"{what}: rank {rank}'s parameter {i}")["value"]
                         for i, d in enumerate(items)])
    for rank, params in enumerate(replicas[1:], start=1):
        assert len(params) == len(replicas[0]), f"{what}: ranks returned different parameter lists"
        for i, (a, b) in enumerate(zip(params, replicas[0])):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (
                f"{what}: rank {rank}'s parameter {i} differs from rank 0's; every replica must "
                "start equal (DDP copies rank 0's parameters when it wraps the model) and take "
                "the same steps (DDP averages the gradients during backward)")
    want, want32 = _expected_training(kind, seed, n, epochs, batch_size, lr, fetched)
    assert len(replicas[0]) == len(want), (
        f"{what}: train_ddp returned {len(replicas[0])} tensors; return the model's "
        f"{len(want)} parameters, in model.parameters() order")
    tol = float32_tolerance_of_all(want, want32)  # one training run: one tolerance
    for i, (got, w, w32) in enumerate(zip(replicas[0], want, want32)):
        assert_close_float32(got, w, w32, f"{what}: parameter {i} after training (vs SGD on one "
                             "process over the same global batches, starting from rank 0's "
                             "model)", seed=seed, tol=tol)
