"""Assignment 1's probes: they run in the sandbox beside the student's code, call one of its
functions on inputs the grader chose, and describe what came back (no judging here)."""
from __future__ import annotations

import torch

from autograder.checking.probes import describe, student_function
from course.models import lenet_params

from .spec import SPEC

def probe_copy_params(ns, params, device):
    fn = student_function(ns, SPEC.function("copy_params"))
    out = fn(params, torch.device(device))
    items = list(out) if isinstance(out, (list, tuple)) else None
    shares = ([any(type(o) is torch.Tensor and o.untyped_storage().data_ptr()
                   == p.untyped_storage().data_ptr() for p in params) for o in items]
              if items is not None else [])
    return {"out": describe(out), "shares_input_storage": shares,
            "inputs_after": [describe(p) for p in params]}


def probe_allreduce(ns, data):
    fn = student_function(ns, SPEC.function("allreduce"))
    originals = list(data)
    fn(data)
    return {"tensors": [describe(t) for t in originals]}


def probe_split(ns, name, X, y, devices, *extra):
    fn = student_function(ns, SPEC.function(name))
    out = fn(X, y, [torch.device(d) for d in devices], *extra)
    return {"out": describe(out), "inputs_after": [describe(X), describe(y)]}


def probe_train_batch(ns, X, y, params, devices, lr):
    """The student's train_batch, with the student's own split_batch and allreduce."""
    fn = student_function(ns, SPEC.function("train_batch"))
    devs = [torch.device(d) for d in devices]
    replicas = [[p.detach().clone().to(d).requires_grad_() for p in params] for d in devs]
    fn(X.to(devs[0]), y.to(devs[0]), replicas, devs, lr)
    grads = [[p.grad for p in r] for r in replicas]
    grads_zero = all(gr is None or (type(gr) is torch.Tensor and not gr.any()) for r in grads for gr in r)
    return {"replicas": [[describe(p) for p in r] for r in replicas], "grads_zero": grads_zero}


def probe_train_steps(ns, n, batch, steps, seed):
    """``steps`` calls of train_batch on ``n`` GPUs; synchronized; returns replica 0's first weight."""
    fn = student_function(ns, SPEC.function("train_batch"))
    g = torch.Generator().manual_seed(seed)
    devs = [torch.device(f"cuda:{i}") for i in range(n)]
    params = lenet_params(scale=0.1, generator=g)
    replicas = [[p.to(d).requires_grad_() for p in params] for d in devs]
    X = torch.rand(batch, 1, 28, 28, generator=g).to(devs[0])
    y = torch.randint(0, 10, (batch,), generator=g).to(devs[0])
    for _ in range(steps):
        fn(X, y, replicas, devs, 0.1)
    for d in devs:
        torch.cuda.synchronize(d)
    return {"first": replicas[0][0].detach().cpu()}


probe_train_steps.timed = True  # the worker skips its clean-up after it: that would be timed too


