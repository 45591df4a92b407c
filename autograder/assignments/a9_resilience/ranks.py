"""What the ranks of ``train_resumable``'s checks run (started by the probe with
:func:`autograder.checking.ranks.run_ranks`, beside the student's code): the grader's data set,
which notes every sample id a rank reads, and the ``log`` callback, which writes each step's loss
and ids to a file of the run and SIGKILLs its own rank at the planned step (the grader's
launcher then restarts the job, as torchrun would). Nothing here judges.
"""
from __future__ import annotations

import json
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

#: The job the checks train: samples, global batch, steps, learning rate, checkpoint interval.
SAMPLES, BATCH, STEPS, LR, EVERY = 24, 6, 10, 0.1, 3
D_IN = 4


def grader_model(seed: int) -> nn.Module:
    """``model_fn``: the same weights on every call, whatever the job did to torch's global
    generator before (it seeds it, then draws from it: the text says so)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def samples(seed: int):
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(SAMPLES, D_IN, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


class NotingDataset(torch.utils.data.Dataset):
    """``dataset[i] -> (x_i, y_i)``; every id read is noted for the step being run."""

    def __init__(self, seed: int):
        self.x, self.y = samples(seed)
        self.read: list[int] = []

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        i = int(i)
        if not 0 <= i < SAMPLES:
            raise IndexError(i)
        self.read.append(i)
        return self.x[i], self.y[i]


class Log:
    """``log(step, loss)``: one JSON line per call in ``folder/run<k>-rank<r>.jsonl`` (the
    step, the loss, the ids read since the last call); at ``(kill_rank, kill_step)`` the rank
    kills itself with SIGKILL right after writing."""

    def __init__(self, folder, run, rank, dataset, kill):
        self.path = os.path.join(folder, f"run{run}-rank{rank}.jsonl")
        self.rank, self.dataset, self.kill = rank, dataset, kill

    def __call__(self, step, loss):
        line = {"step": step if type(step) is int else repr(step),
                "loss": loss if type(loss) is float else repr(loss),
                "ids": list(self.dataset.read)}
        self.dataset.read.clear()
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.kill is not None and tuple(self.kill) == (self.rank, step):
            os.kill(os.getpid(), signal.SIGKILL)


def rank_resumable(rank, world_size, fn, seed, folder, directory, run, kill):
    """One rank of one run (an incarnation of the job): train_resumable with the grader's
    model, data set and log; returns the final parameters."""
    dataset = NotingDataset(seed)
    log = Log(folder, run, rank, dataset, kill)
    result = fn(lambda: grader_model(seed), dataset, steps=STEPS, batch_size=BATCH, lr=LR,
                checkpoint_every=EVERY, directory=directory, seed=seed, log=log)
    dist.barrier()
    if not isinstance(result, dict):
        return {"error": f"train_resumable returned {type(result).__name__}, not a dict"}
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else repr(v)
            for k, v in result.items()}
