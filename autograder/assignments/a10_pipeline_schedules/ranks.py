"""What the ranks of ``run_schedule``'s checks run (started by a probe with
:func:`autograder.checking.ranks.run_ranks`, or kept up by a ``RankServer`` for the speed check),
beside the student's code: the grader's stages and micro-batches, built the same way on every
rank and in the grader (which computes the one-process gradients from them), and the calls of the
student's ``run_schedule``. Nothing here judges; it imports only torch and the grader's
collective counting.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from autograder.checking.probes import describe

ACTIVATIONS = (nn.Tanh, nn.GELU, nn.ReLU)
#: the timed run: float32, p = 2 ranks, v = 2 stages each, m micro-batches of ROWS x WIDTH
SPEED_P, SPEED_V, SPEED_M, SPEED_WIDTH, SPEED_DEPTH, SPEED_ROWS = 2, 2, 8, 768, 2, 128
MAX_TIMELINE = 10_000


def grader_stages(seed: int, n_stages: int, width: int, depth: int,
                  dtype=torch.float64) -> list[nn.Sequential]:
    """``n_stages`` stages of ``depth`` (Linear(width, width), activation) pairs, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    stages = []
    for s in range(n_stages):
        layers = []
        for k in range(depth):
            linear = nn.Linear(width, width, dtype=dtype)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(width, width, generator=g, dtype=dtype) / width ** 0.5)
                linear.bias.copy_(torch.randn(width, generator=g, dtype=dtype) / 4)
            layers += [linear, ACTIVATIONS[(s + k) % len(ACTIVATIONS)]()]
        stages.append(nn.Sequential(*layers))
    return stages


def grader_batches(seed: int, m: int, rows: int, width: int, dtype=torch.float64):
    """``m`` micro-batches and their targets, from ``seed``."""
    g = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(rows, width, generator=g, dtype=dtype) for _ in range(m)]
    targets = [torch.randn(rows, width, generator=g, dtype=dtype) for _ in range(m)]
    return inputs, targets


def mse(output, target):
    """``loss_fn``: one micro-batch's mean squared error."""
    return ((output - target) ** 2).mean()


def _timeline(timeline):
    """The returned timeline as ``[[action, start, end], ...]``, or ``{"bad": why}``."""
    if not isinstance(timeline, (list, tuple)):
        return {"bad": f"run_schedule returned {type(timeline).__name__}, not a list"}
    if len(timeline) > MAX_TIMELINE:
        return {"bad": f"the timeline has {len(timeline)} entries"}
    out = []
    for i, entry in enumerate(timeline):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and type(entry[0]) is str
                and all(type(t) in (float, int) for t in entry[1:])):
            return {"bad": f"timeline[{i}] is {str(entry)[:80]!r}, not (action, start, end)"}
        out.append([str(entry[0])[:40], float(entry[1]), float(entry[2])])
    return out


def _case_inputs(rank, case):
    parts = grader_stages(case["seed"], case["n_stages"], case["width"], case["depth"])
    inputs, targets = grader_batches(case["seed"], case["m"], case["rows"], case["width"])
    return parts, {s: parts[s] for s in case["placement"][rank]}, inputs, targets


def rank_cases(rank, world_size, fn, cases):
    """Each case in turn: fresh stages, the student's ``run_schedule``, then each of this rank's
    stages' gradients and the timeline. A failure is raised (the grader reports the first one)."""
    results = []
    for case in cases:
        parts, mine, inputs, targets = _case_inputs(rank, case)
        timeline = fn(copy.deepcopy(case["schedule"]), mine, inputs, targets, mse)
        results.append({"grads": {s: [None if p.grad is None else describe(p.grad)
                                      for p in parts[s].parameters()] for s in mine},
                        "timeline": _timeline(timeline)})
        dist.barrier()
    return results


def rank_refusals(rank, world_size, fn, cases):
    """Each bad case: what ``run_schedule`` raised on this rank, and how many messages and
    collective calls it made first (noted on every group, by the grader's hooks)."""
    from autograder.checking.collectives import calls_on_every_group

    out = []
    for case in cases:
        _, mine, inputs, targets = _case_inputs(rank, case)
        with calls_on_every_group() as log:
            try:
                fn(copy.deepcopy(case["schedule"]), mine, inputs, targets, mse)
                raised = "nothing (it returned)"
            except ValueError:
                raised = "ValueError"
            except Exception as exc:  # noqa: BLE001 - reported to the grader
                raised = f"{type(exc).__name__}: {exc}"[:300]
        out.append({"raised": raised, "calls": len(log)})
    return out


def speed_scale(step: int) -> float:
    """The timed run's inputs are scaled by this at its step ``step`` (0, 1, ...)."""
    return 1.0 + step / 64


def schedule_server(rank, world_size, fn, seed, schedule, placement):
    """Set-up of each rank of the speed check's ``RankServer``: this rank's stages of the float32
    model of ``seed``; the commands ``pipe`` (one step of the student's ``run_schedule`` from
    ``.grad`` None), ``base`` (rank 0: the same step of the whole model in this process alone)
    and ``result`` (the last step's gradients, and how many ``pipe`` steps ran)."""
    n_stages = SPEED_P * SPEED_V
    parts = grader_stages(seed, n_stages, SPEED_WIDTH, SPEED_DEPTH, torch.float32)
    inputs, targets = grader_batches(seed, SPEED_M, SPEED_ROWS, SPEED_WIDTH, torch.float32)
    mine = {s: parts[s] for s in placement[rank]}
    steps = [0]

    def pipe():
        for s in mine:
            for p in parts[s].parameters():
                p.grad = None
        scale = speed_scale(steps[0])        # new inputs each step: no step's result is another's
        fn(copy.deepcopy(schedule), mine, [x * scale for x in inputs], targets, mse)
        steps[0] += 1

    def result():
        return {"grads": {s: [describe(p.grad) for p in parts[s].parameters()] for s in mine},
                "steps": steps[0]}

    commands = {"pipe": pipe, "result": result}
    if rank == 0:
        whole = nn.Sequential(*copy.deepcopy(parts))

        def base():
            whole.zero_grad(set_to_none=True)
            scale = speed_scale(0)
            for x, y in zip(inputs, targets):
                (mse(whole(x * scale), y) / SPEED_M).backward()
        commands["base"] = base
    return commands
