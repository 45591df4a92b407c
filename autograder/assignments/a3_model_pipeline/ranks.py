"""What each process of Assignment 3's pipeline checks runs: trusted code that a probe starts on
N ranks (``autograder.checking.ranks``), which builds each rank's stage, calls the student's
``pipeline_train_step`` and returns plain data for the grader to judge. Imports only torch."""
from __future__ import annotations

import copy

from autograder.checking.probes import describe
from autograder.checking.training import sgd_steps

from .models import half_cut, wide_mlp, workload

# The two-process pipeline on CPU vs one process. Narrow enough that a stage's weights (1 MiB)
# stay in a core's cache across micro-batches of 512 rows: on a quiet 2-core machine the
# reference reaches ~1.3-1.5x.
CPU_WIDTH, CPU_DEPTH, CPU_BATCH, CPU_MICROBATCHES, CPU_LR = 256, 8, 4096, 8, 0.01


def train_on_ranks(rank, world_size, step, model, cuts, cases):
    """Body of each rank: stage ``rank`` of ``model``; for each case ``(X, y, m, lr, steps)``,
    ``steps`` calls of the student's step from fresh weights. Returns, per case, the stage's
    parameters after them and what each call returned."""
    from course.launch import device_for

    results = []
    for X, y, m, lr, steps in cases:
        stage = copy.deepcopy(model[cuts[rank]:cuts[rank + 1]]).to(device_for(rank))
        returned = [describe(step(stage, X, y, m, lr)) for _ in range(steps)]
        results.append({"params": [describe(p.detach().cpu()) for p in stage.parameters()],
                        "returned": returned})
    return results


def pipeline_server(rank, world_size, step, seed):
    """Set-up of each rank of a :class:`~autograder.checking.ranks.RankServer` for the CPU
    speedup: its half of the :func:`~.models.wide_mlp` of ``seed``, and the commands

    - ``pipe``: one ``step(stage, X, y, CPU_MICROBATCHES, CPU_LR)`` (on both ranks),
    - ``base``: one SGD step of the whole model on the whole batch in this process alone (rank
      0 only; the other rank has no such command and waits),
    - ``result``: the stage's parameters and how many ``pipe`` steps it ran.
    """
    model = wide_mlp(seed, CPU_WIDTH, CPU_DEPTH)
    cut = half_cut(model)
    stage = model[:cut] if rank == 0 else model[cut:]
    X, y = workload(seed, CPU_BATCH, CPU_WIDTH)
    steps = [0]

    def pipe():
        step(stage, X, y, CPU_MICROBATCHES, CPU_LR)
        steps[0] += 1

    def result():
        return {"params": [describe(p.detach()) for p in stage.parameters()], "steps": steps[0]}

    commands = {"pipe": pipe, "result": result}
    if rank == 0:
        whole = wide_mlp(seed, CPU_WIDTH, CPU_DEPTH)
        commands["base"] = lambda: sgd_steps(whole, [(X, y)], CPU_LR)
    return commands
