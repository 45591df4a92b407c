"""What each process of Assignment 4's BucketedDDP checks runs: its model (many small
parameters, several buckets), the student's wrapper with the grader's SGD around it, and the
collectives and the moment parameter 0's gradient is computed, logged in order; and, for the
speed check, ranks that stay up (:func:`ddp_server`) with the student's wrapper (or the
reference's) and a trusted baseline on the same model.

Trusted harness code like :mod:`.ranks` (which it uses): imports nothing heavier than torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autograder.checking.collectives import collectives_counted
from autograder.checking.probes import describe

from .ranks import collectives_sized, step_rows


class Layers(nn.Module):
    """Float64 tanh layers of width ``width`` (many small parameters: several buckets); with
    ``unused``, a parameter between them that the loss never touches; with ``late``, a layer
    ``pre`` registered last but applied first, so that its gradients come last in backward and
    the buckets after bucket 0 complete before it."""

    def __init__(self, width: int, depth: int, unused: bool = False, late: bool = False):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.unused = nn.Parameter(torch.ones(3)) if unused else None
        self.rest = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.register_buffer("scale", torch.ones(width))
        self.pre = nn.Linear(width, width) if late else None
        self.double()

    def forward(self, x):
        if self.pre is not None:
            x = torch.tanh(self.pre(x))
        x = torch.tanh(self.first(x)) * self.scale
        for layer in self.rest:
            x = torch.tanh(layer(x))
        return x


def ddp_model(seed: int, shape) -> Layers:
    """The model of a BucketedDDP check, of ``shape`` (width, depth, unused, late), from
    ``seed`` (each rank passes its own: rank 0's is the one broadcast). Its buffer differs per
    seed too, so that it needs the broadcast."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Layers(*shape)
        with torch.no_grad():
            model.scale.uniform_(0.5, 1.5)
        return model


def ddp_seed(seed: int, rank: int) -> int:
    return seed + 7919 * rank


def rank_bucketed_ddp_case(rank, world_size, i, case, cls, seed, steps, per_rank, lr):
    """Case ``(shape, bucket_bytes)`` (seeds 101 apart): the student's BucketedDDP around a
    model that differs per rank (until broadcast); each step: forward and backward on this
    rank's share, ``finish_gradient_synchronization()``, then the grader's plain SGD. Logs, in
    one list and in order, the collectives issued on the default group from forward to the end
    of finish (``(op, in, out)``) and the moment the gradient of managed parameter 0 is
    computed (``("grad of parameter 0",)``)."""
    shape, bucket_bytes = case
    seed = seed + 101 * i
    width = shape[0]
    model = ddp_model(ddp_seed(seed, rank), shape)
    managed = [p for p in model.parameters() if p.requires_grad]
    X, y = (torch.randn(steps * per_rank * world_size, width, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed + k)) for k in (1, 2))
    ddp = cls(model, bucket_bytes)
    events: list = []
    managed[0].register_hook(lambda grad: events.append(("grad of parameter 0",)))
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        rows = step_rows(step, per_rank, world_size, rank)
        events.clear()
        with collectives_sized(events), collectives_counted(ddp.finish_gradient_synchronization) \
                as counted:
            F.mse_loss(ddp(X[rows]), y[rows]).backward()
            ddp.finish_gradient_synchronization()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in managed]
        out.append({"grads": describe(grads), "events": list(events), "counted": dict(counted)})
        with torch.no_grad():
            for p in managed:
                if p.grad is not None:
                    p -= lr * p.grad
    return out


def ddp_server(rank, world_size, cls, seed, shape, per_rank, bucket_bytes):
    """The ``setup`` of a :class:`~autograder.checking.ranks.RankServer`: commands ``step``
    (one step's gradients with ``cls``: zero_grad, forward and backward on this rank's share of
    a fixed batch, ``finish_gradient_synchronization()``) and ``per_parameter`` (the same
    gradients with one blocking all-reduce per parameter after backward, on a model of its own:
    the trusted baseline); ``result``: the managed parameters' gradients after the last
    ``step``, and how many ``step`` s completed (``steps``: each starts from zeroed gradients,
    so only this count tells a skipped step from a done one)."""
    width = shape[0]
    X, y = (torch.randn(per_rank * world_size, width, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed + i)) for i in (1, 2))
    rows = step_rows(0, per_rank, world_size, rank)
    model = ddp_model(ddp_seed(seed, rank), shape)
    ddp = cls(model, bucket_bytes)
    baseline = ddp_model(ddp_seed(seed, 0), shape)

    steps = [0]

    def step():
        model.zero_grad(set_to_none=True)
        F.mse_loss(ddp(X[rows]), y[rows]).backward()
        ddp.finish_gradient_synchronization()
        steps[0] += 1

    def per_parameter():
        baseline.zero_grad(set_to_none=True)
        F.mse_loss(baseline(X[rows]), y[rows]).backward()
        for p in baseline.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size

    return {"step": step, "per_parameter": per_parameter,
            "result": lambda: {"grads": describe([p.grad for p in model.parameters()
                                                  if p.requires_grad]),
                               "steps": steps[0]}}
