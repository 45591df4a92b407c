"""Judging make_dataloader (in the grader): the batches each rank's loader gave, epoch by epoch."""
from __future__ import annotations

import torch

from autograder.checking.expect import sequence, tensor

from .probes import probe_make_dataloader


def _batches_of(desc, what):
    """(the examples of each batch, the batch sizes) from one epoch's described batches."""
    indices = []
    sizes = []
    for j, b in enumerate(desc):
        pair = sequence(b, f"{what}, batch {j} (should be a pair (X, y))", 2)
        X = tensor(pair[0], f"{what}, batch {j}: X")["value"]
        y = tensor(pair[1], f"{what}, batch {j}: y")["value"]
        assert X.dim() == 2 and X.shape[1] == 2 and y.shape == (X.shape[0],), (
            f"{what}, batch {j}: X has shape {tuple(X.shape)} and y {tuple(y.shape)}; the "
            "loader should collate the data set's (x, y) examples into a batch (X, y)")
        idx = X[:, 0].long()
        assert torch.equal(X[:, 1], 2.0 * X[:, 0]) and torch.equal(y.long(), idx % 5), (
            f"{what}, batch {j}: the examples were changed or mixed up; give the data set's "
            "examples unchanged")
        indices.append(idx.tolist())
        sizes.append(len(idx))
    return indices, sizes


def check_loaders(student, cases):
    """Each case ``(n, world_size, batch_size, seed, epochs)``: every rank's loader gives full
    batches of its shard, and the shards of an epoch are disjoint, cover the data set and differ
    in size by one at most. Returns, per case, per epoch, per rank, the examples in order."""
    ranks_per_case = student.call(probe_make_dataloader, cases)
    orders = []
    for (n, world_size, batch_size, seed, epochs), ranks in zip(cases, ranks_per_case):
        case = (f"make_dataloader(dataset of {n}, batch_size={batch_size}, rank, "
                f"world_size={world_size}, seed)")
        per_epoch = [[None] * world_size for _ in epochs]
        for rank, info in enumerate(ranks):
            assert info["is_loader"], f"{case} should return a torch DataLoader, got {info['type']}"
            assert info["set_epoch"], (f"{case}: the loader's sampler has no set_epoch(epoch); "
                                       "the training loop calls loader.sampler.set_epoch(epoch)")
            for e, (epoch, batches) in enumerate(zip(epochs, info["epochs"])):
                what = f"{case} for rank {rank}, epoch {epoch}"
                idx, sizes = _batches_of(batches, what)
                full = ([s == batch_size for s in sizes[:-1]]
                        + [0 < s <= batch_size for s in sizes[-1:]])
                assert all(full), (f"{what}: batch sizes {sizes}; every batch should hold "
                                   f"batch_size={batch_size} examples, the last one possibly fewer")
                per_epoch[e][rank] = [i for b in idx for i in b]
        for e, epoch in enumerate(epochs):
            seen = {}
            for rank, order in enumerate(per_epoch[e]):
                for i in order:
                    where = (f"rank {rank} got example {i} twice" if seen.get(i) == rank else
                             f"example {i} went to rank {seen.get(i)} and to rank {rank}")
                    assert i not in seen, (
                        f"{case}, epoch {epoch}: {where}; the ranks' shards must be disjoint "
                        "(torch's DistributedSampler repeats examples to even them out: this "
                        "assignment asks for every example exactly once)")
                    seen[i] = rank
            missing = sorted(set(range(n)) - set(seen))
            assert not missing, (f"{case}, epoch {epoch}: no rank got example(s) "
                                 f"{missing[:10]}; together the shards must cover the data set")
            lengths = [len(o) for o in per_epoch[e]]
            assert max(lengths) - min(lengths) <= 1, (
                f"{case}, epoch {epoch}: the shards hold {lengths} examples; they should differ "
                "by at most one")
        orders.append(per_epoch)
    return orders
