"""Assignment 3's probes: they run in the sandbox beside the student's code, call one of its
functions on inputs the grader chose (stages they build themselves), and describe what came
back; no judging here. A function runs with the student's own versions of the other graded
functions it calls, as in the student's self-check."""
from __future__ import annotations

import copy

import torch
from torch import nn

from autograder.checking.probes import describe, error_of, student_function
from autograder.checking.ranks import run_ranks

from .models import wide_mlp, workload
from .ranks import train_on_ranks
from .spec import SPEC


def graded_function(ns, name: str):
    """The student's ``name``, with a clear error if it is missing or takes other arguments."""
    return student_function(ns, SPEC.function(name))


# ---------------------------------------------------------------------------- split_into_stages

def probe_split(ns, model, devices, inputs):
    """The stages' types, parameter counts and devices, and each one's output on ``inputs[i]``
    (when there is one input per stage)."""
    fn = graded_function(ns, "split_into_stages")
    stages = fn(model, [torch.device(d) for d in devices])
    if not isinstance(stages, (list, tuple)):
        return {"stages": describe(stages)}
    out = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            out.append({"module": False, "type": type(stage).__name__})
            continue
        params = list(stage.parameters())
        item = {"module": True, "num_params": sum(p.numel() for p in params),
                "devices": sorted({str(p.device) for p in params}), "out": None, "error": None}
        if len(stages) == len(inputs):
            x = inputs[i].to(params[0].device) if params else inputs[i]
            try:
                with torch.no_grad():
                    item["out"] = describe(stage(x))
            except Exception as exc:  # noqa: BLE001 - a wrong split; the grader says why
                item["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(item)
    return {"items": out}


def probe_split_too_few_layers(ns, model, devices):
    fn = graded_function(ns, "split_into_stages")
    try:
        fn(model, [torch.device(d) for d in devices])
    except Exception as exc:  # noqa: BLE001 - the exception is the answer
        return {"raised": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:200]}
    return {"raised": None}


# ---------------------------------------------------------------------------- forwards

class _RecordedStage(nn.Sequential):
    """A stage that logs (stage index, rows) each time it is called, in call order."""

    def __init__(self, index, log, *layers):
        super().__init__(*layers)
        self._index, self._log = index, log

    def forward(self, x):
        rows = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else -1
        self._log.append((self._index, rows))
        return super().forward(x)


def probe_forward(ns, name, model, cuts, devices, x, grad_out, num_microbatches):
    """``name(stages, x[, num_microbatches])`` on recorded stages ``model[cuts[s]:cuts[s+1]]``
    on ``devices[s]``, then a backward of ``grad_out``: the output, the stage calls, and the
    gradients of x and of every stage's parameters."""
    log: list = []
    layers = list(model)
    stages = [_RecordedStage(s, log, *layers[a:b]).to(d)
              for s, (a, b, d) in enumerate(zip(cuts, cuts[1:], devices))]
    x = x.detach().clone().requires_grad_()
    extra = [num_microbatches] if name == "pipelined_forward" else []
    out = graded_function(ns, name)(stages, x, *extra)
    result = {"out": describe(out), "log": [list(e) for e in log], "backward": False}
    if type(out) is torch.Tensor and out.requires_grad and out.shape == grad_out.shape:
        out.backward(grad_out.to(out.device))
        result.update(backward=True, x_grad=describe(x.grad),
                      grads=[[describe(p.grad) for p in stage.parameters()] for stage in stages])
    return result


# ---------------------------------------------------------------------------- schedules, bubble

def probe_pairs(ns, name, pairs):
    """``name(num_stages, num_microbatches)`` for each pair, described."""
    fn = graded_function(ns, name)
    return [describe(fn(p, m)) for p, m in pairs]


def probe_bubble(ns, schedules, invalid):
    """``bubble_fraction(schedule)`` for each of ``schedules``, described, and what it did on
    each of the ``invalid`` ones (:func:`error_of`: ``"ValueError"`` if it raised one). Each
    call gets its own copy, so one that changes its argument changes nothing for the next."""
    fn = graded_function(ns, "bubble_fraction")
    values = [describe(fn(copy.deepcopy(s))) for s in schedules]
    errors = [error_of(lambda s=s: fn(copy.deepcopy(s))) for s in invalid]
    return {"values": values, "errors": errors}


# ---------------------------------------------------------------------------- pipeline_train_step

def probe_pipeline_train(ns, world_size, model, cuts, cases):
    """:func:`~.ranks.train_on_ranks` on ``world_size`` ranks with the student's step."""
    return run_ranks(train_on_ranks, world_size, graded_function(ns, "pipeline_train_step"),
                     model, cuts, cases)


# ---------------------------------------------------------------------------- GPU speedup
# The pipelined forward on 2 GPUs vs the plain split: a wide MLP (from the grader's seed),
# built here once per sandbox, in float32 with full-precision matmuls.

GPU_WIDTH, GPU_LAYERS, GPU_BATCH, GPU_MICROBATCHES, GPU_CALLS = 4096, 8, 4096, 8, 3
GPU_ROW_STEP = 512    # the rows sent back for the grader to check: x[::GPU_ROW_STEP]
_GPU: dict = {}


def gpu_stages(devices, seed):
    """The wide MLP of ``seed`` split in equal stages over ``devices``, and its input."""
    key = (tuple(devices), seed)
    if key not in _GPU:
        _GPU.clear()
        model = wide_mlp(seed, GPU_WIDTH, GPU_LAYERS, classes=None)
        per = len(model) // len(devices)
        _GPU[key] = ([model[s * per:(s + 1) * per].to(d) for s, d in enumerate(devices)],
                     workload(seed, GPU_BATCH, GPU_WIDTH)[0].to(devices[0]))
    return _GPU[key]


def probe_gpu_forward(ns, which, devices, seed, rows_back=False):
    """``GPU_CALLS`` forwards (no grad): the namespace's pipelined_forward or the plain split;
    synchronized. With ``rows_back``, the output's rows ``::GPU_ROW_STEP``."""
    torch.set_float32_matmul_precision("highest")
    stages, x = gpu_stages(devices, seed)
    fn = student_function(ns, SPEC.function("pipelined_forward"))
    with torch.no_grad():
        for _ in range(GPU_CALLS):
            if which == "pipelined":
                out = fn(stages, x, GPU_MICROBATCHES)
            else:
                out = x
                for stage, d in zip(stages, devices):
                    out = stage(out.to(d))
    for d in set(devices):
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)
    if not rows_back:
        return None
    return describe(out[::GPU_ROW_STEP] if type(out) is torch.Tensor else out)


probe_gpu_forward.timed = True  # the sandbox's worker skips its between-call clean-up for it
