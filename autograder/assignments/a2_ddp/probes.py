"""Assignment 2's probes: they run in the sandbox beside the student's code, start the student's
function on N fresh processes (:func:`autograder.checking.ranks.run_ranks`; what each process
runs is in :mod:`.ranks`) or call it here, and describe what came back (no judging here).

The speed checks use :func:`autograder.checking.ranks.probe_server_start` and friends instead,
with the setups of :mod:`.ranks`, so that the grader times each command itself.
"""
from __future__ import annotations

import torch

from autograder.checking.probes import describe, student_function
from autograder.checking.ranks import run_ranks

from .ranks import rank_average_gradients, rank_ring, rank_train_ddp
from .spec import SPEC


def probe_average_gradients(ns, world_size, seed, steps, batch, lr):
    fn = student_function(ns, SPEC.function("average_gradients"))
    return run_ranks(rank_average_gradients, world_size, fn, seed, steps, batch, lr)


def probe_ring(ns, world_size, seed, cases):
    fn = student_function(ns, SPEC.function("ring_allreduce"))
    return {"ranks": run_ranks(rank_ring, world_size, fn, seed, cases)}


def probe_train_ddp(ns, world_size, kind, seed, n, epochs, batch_size, lr, backend=None):
    """The student's train_ddp on ``world_size`` processes, with the student's own helpers."""
    fn = student_function(ns, SPEC.function("train_ddp"))
    return {"ranks": run_ranks(rank_train_ddp, world_size, fn, kind, seed, n, epochs,
                               batch_size, lr, backend=backend)}


class IndexedDataset(torch.utils.data.Dataset):
    """Example ``i`` is ``(tensor([i, 2i]), i % 5)``: a batch says which examples it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        index = int(index)
        return torch.tensor([float(index), 2.0 * index]), index % 5


def probe_make_dataloader(ns, cases):
    from torch.utils.data import DataLoader

    fn = student_function(ns, SPEC.function("make_dataloader"))
    out = []
    for n, world_size, batch_size, seed, epochs in cases:
        dataset = IndexedDataset(n)
        ranks = []
        for rank in range(world_size):
            loader = fn(dataset, batch_size, rank, world_size, seed)
            sampler = getattr(loader, "sampler", None)
            info = {"is_loader": isinstance(loader, DataLoader),
                    "type": f"{type(loader).__module__}.{type(loader).__qualname__}",
                    "set_epoch": callable(getattr(sampler, "set_epoch", None)), "epochs": []}
            if info["is_loader"]:
                for epoch in epochs:
                    if info["set_epoch"]:
                        sampler.set_epoch(epoch)
                    info["epochs"].append([describe(b if isinstance(b, (list, tuple)) else [b])
                                           for b in loader])
            ranks.append(info)
        out.append(ranks)
    return out
