"""What the grader computes by itself to judge Assignment 3 (never in the sandbox): the unsplit
model's outputs and gradients and one-process SGD, each in float64 (the truth) and in float32
(the same computation in the students' precision, from which
:func:`~autograder.checking.expect.assert_close_float32` derives each tolerance)."""
from __future__ import annotations

import copy

import torch

from autograder.checking.expect import assert_close_float32, float32_tolerance, tensor
from autograder.checking.speed import check_work_done
from autograder.checking.training import sgd_steps

from .models import half_cut, input_width, wide_mlp, workload
from .probes import GPU_BATCH, GPU_LAYERS, GPU_ROW_STEP, GPU_WIDTH
from .ranks import CPU_BATCH, CPU_DEPTH, CPU_LR, CPU_WIDTH


def in_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(module).to(dtype)


def expected_stage_outputs(model, bounds, seed):
    """Per stage ``model[a:b]`` of ``bounds``: its input (5 rows, float32: the previous stage's
    float32 output) and its output on it in float64 and in float32."""
    h = torch.randn(5, input_width(model), generator=torch.Generator().manual_seed(seed))
    model64, inputs, out64, out32 = in_dtype(model, torch.float64), [], [], []
    with torch.no_grad():
        for a, b in bounds:
            inputs.append(h)
            out64.append(model64[a:b](h.double()))
            h = model[a:b](h)
            out32.append(h)
    return inputs, out64, out32


def expected_forward(model, x, grad_out, dtype, num_microbatches=None):
    """The unsplit model in ``dtype`` (micro-batch by micro-batch, as the pipeline computes,
    where ``num_microbatches`` is given), then a backward of ``grad_out``: the output, the
    gradient of x and those of the parameters."""
    model = in_dtype(model, dtype)
    x = x.detach().to(dtype, copy=True).requires_grad_()
    if num_microbatches:
        out = torch.cat([model(mb) for mb in x.tensor_split(min(num_microbatches, len(x)))])
    else:
        out = model(x)
    out.backward(grad_out.to(dtype))
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def expected_training(model, X, y, lr, steps, dtype):
    """``steps`` SGD steps of the whole model on the whole batch in one process, in ``dtype``:
    (the model after them, each step's loss)."""
    model = in_dtype(model, dtype)
    losses, _ = sgd_steps(model, [(X.to(dtype), y)] * steps, lr)
    return model, losses


def stages_of(model, cuts) -> list[list[torch.Tensor]]:
    """The parameters of ``model[cuts[r]:cuts[r + 1]]`` for each rank r."""
    return [[p.detach() for p in model[a:b].parameters()] for a, b in zip(cuts, cuts[1:])]


def check_stages(results, want64, want32, call, seed=None):
    """Each rank's stage parameters (``results[rank]["params"]``) against ``want64[rank]``
    (float64) within the tolerance of the float32 run ``want32[rank]``."""
    for rank, (got, w64, w32) in enumerate(zip(results, want64, want32)):
        assert isinstance(got, dict), "the ranks' replies were tampered with"
        assert len(got["params"]) == len(w64), (
            f"{call}: rank {rank}'s stage has {len(got['params'])} parameters, expected "
            f"{len(w64)}")
        for j, (desc, p64, p32) in enumerate(zip(got["params"], w64, w32)):
            assert_close_float32(tensor(desc, "a parameter")["value"], p64, p32,
                                 f"{call}: rank {rank}'s parameter {j} after the step(s) (vs SGD "
                                 "on the whole model in one process)", seed=seed)


def check_returned(results, losses64, losses32, call, seed=None):
    """What each rank's steps returned (``results[rank]["returned"]``): None on every rank but
    the last, which returns each step's loss (float64 ``losses64``; float32 ``losses32``)."""
    tol = float32_tolerance(torch.tensor(losses64), torch.tensor(losses32))
    for rank, got in enumerate(results):
        for k, desc in enumerate(got["returned"]):
            value = (desc.get("value") if desc.get("kind") == "plain"
                     else f"<a {desc.get('type') or desc.get('kind')}>")
            if rank < len(results) - 1:
                assert value is None, f"{call}: rank {rank} returned {value!r}, expected None"
                continue
            assert type(value) in (int, float), \
                f"{call}: the last rank returned {value!r}, expected the loss as a float"
            assert abs(value - losses64[k]) <= tol, (
                f"{call}: the last rank returned loss {value:.6g} at step {k}, expected "
                f"{losses64[k]:.6g} (the mean cross-entropy over the whole batch; tolerance "
                f"{tol:.2g}, inputs from seed {seed})")


def check_timed_run(final, reference_final, seed, sent: int):
    """The stages of the CPU speedup's ranks after the steps they ran (``final``: each rank's
    ``result``): as many steps as the grader asked for (``sent``: its own count of the ``pipe``
    commands it sent; a timed call that returned without its step leaves fewer), and the state
    of that many one-process SGD steps of the whole model in float64. The float32 run that sets
    the tolerance: the reference's ranks (``reference_final``, trusted) where they ran as many
    steps, else one-process SGD in float32."""
    for ranks in (final, reference_final or [{"steps": 0}] * 2):
        assert isinstance(ranks, list) and len(ranks) == 2 and all(
            isinstance(r, dict) and type(r.get("steps")) is int for r in ranks), \
            "the ranks' results were tampered with"
    check_work_done([r["steps"] for r in final], sent,
                    "pipeline_train_step on 2 CPU processes")
    steps = sent
    model = wide_mlp(seed, CPU_WIDTH, CPU_DEPTH)
    cuts = [0, half_cut(model), len(model)]
    X, y = workload(seed, CPU_BATCH, CPU_WIDTH)
    want64 = stages_of(expected_training(model, X, y, CPU_LR, steps, torch.float64)[0], cuts)
    if reference_final and reference_final[0]["steps"] == steps:
        want32 = [[tensor(d, "the reference's parameter")["value"] for d in r["params"]]
                  for r in reference_final]
    else:
        want32 = stages_of(expected_training(model, X, y, CPU_LR, steps, torch.float32)[0], cuts)
    check_stages(final, want64, want32, f"the timed run: pipeline_train_step after {steps} steps")


def expected_gpu_rows(seed) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``::GPU_ROW_STEP`` of the timed wide MLP's output, computed here on the CPU:
    (in float64, in float32)."""
    model = wide_mlp(seed, GPU_WIDTH, GPU_LAYERS, classes=None)
    x = workload(seed, GPU_BATCH, GPU_WIDTH)[0][::GPU_ROW_STEP]
    with torch.no_grad():
        rows32 = model(x)
        return model.double()(x.double()), rows32
