"""What the ranks of ``make gpu-check`` run (started by ``course.launch.launch``): Assignment 2's
reference functions on NCCL, CUDA work in launched ranks, and allreduce timings.

This module is imported by name in every rank (``course.launch`` gives the ranks the parent's
module path), so it imports torch and the course toolkit only. Every function returns plain
data; the parent judges it. Assignment 2's functions arrive as arguments, executed from the
solution notebook by the parent (see :mod:`.distributed`).
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course.launch import device_for


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))  # smooth: see a2_ddp seeded_model


class _Logged(torch.utils.data.Dataset):
    """Random examples; records which were read, in order (to replay the training)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.X, self.y = torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)
        self.fetched: list[int] = []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.fetched.append(int(i))
        return self.X[i], self.y[i]


def _ring_input(seed: int, rank: int, shape, dtype):
    g = torch.Generator().manual_seed(seed + 1009 * rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def rank_a2_checks(rank, world, fns, seed=0):
    """Assignment 2's four functions on this rank's GPU: {check: (ok, detail)}."""
    device = device_for(rank)
    out = {"setup": (device.type == "cuda" and dist.get_backend() == "nccl",
                     f"backend {dist.get_backend()}, device {device}, "
                     f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")}

    # average_gradients: the mean over the ranks of each slice's gradient is the gradient of the
    # whole batch's mean loss; a parameter without .grad stays without.
    model = _mlp(seed).to(device)
    model.unused = nn.Parameter(torch.zeros(3, device=device))
    X, y = torch.randn(4 * world, 20, generator=torch.Generator().manual_seed(seed)), \
        torch.randint(0, 5, (4 * world,), generator=torch.Generator().manual_seed(seed + 1))
    F.cross_entropy(model(X[4 * rank:4 * rank + 4].to(device)), y[4 * rank:4 * rank + 4].to(device)).backward()
    fns["average_gradients"](model)
    whole = _mlp(seed)
    F.cross_entropy(whole(X), y).backward()
    mine = [p for name, p in model.named_parameters() if name != "unused"]
    err = max((p.grad.cpu() - q.grad).abs().max().item() for p, q in zip(mine, whole.parameters()))
    out["average_gradients"] = (err < 1e-5 and model.unused.grad is None,
                                f"largest difference from the whole batch's gradient {err:.2g}")

    # ring_allreduce: in place, the sum over the ranks, for awkward sizes and both dtypes.
    bad = []
    for i, (shape, dtype) in enumerate([((0,), torch.float32), ((1,), torch.float64),
                                        ((7,), torch.float32), ((3, 5), torch.float64),
                                        (((1 << 20) + 3,), torch.float32)]):
        t = _ring_input(seed + i, rank, shape, dtype).to(device)
        returned = fns["ring_allreduce"](t)
        _sync(device)
        want = sum(_ring_input(seed + i, r, shape, dtype) for r in range(world))
        if returned is not None or not torch.allclose(t.cpu(), want, rtol=1e-5, atol=1e-5):
            bad.append(f"{tuple(shape)} {dtype}")
    out["ring_allreduce"] = (not bad, "wrong for " + ", ".join(bad) if bad else
                             f"5 shapes, float32 and float64, on {world} rank(s)")

    # make_dataloader: every rank's shards (computed here for all ranks) cover each epoch once.
    problems = []
    for n in (3, 10, 17):
        for epoch in (0, 1):
            seen = []
            for r in range(world):
                loader = fns["make_dataloader"](list(range(n)), 2, r, world, seed)
                loader.sampler.set_epoch(epoch)
                seen += [int(v) for batch in loader for v in batch]
            if sorted(seen) != list(range(n)):
                problems.append(f"n={n} epoch {epoch}")
    out["make_dataloader"] = (not problems, "shards do not cover " + ", ".join(problems)
                              if problems else "shards cover every example once per epoch")

    # train_ddp: DDP with device_ids on this GPU; equals plain SGD on the global batches.
    batch, epochs, lr = 8, 2, 0.05
    data = _Logged(world * batch * 3, seed + 2)
    params = fns["train_ddp"](rank, world, lambda: _mlp(seed + 100 * dist.get_rank()), data,
                              epochs, batch, lr, seed)
    fetched = [None] * world
    dist.all_gather_object(fetched, data.fetched)
    replay = _mlp(seed)  # rank 0's model, which DDP gives every rank
    steps = len(data) // (world * batch)
    for e in range(epochs):
        for s in range(steps):
            rows = [i for r in range(world) for i in fetched[r][(e * steps + s) * batch:(e * steps + s + 1) * batch]]
            replay.zero_grad()
            F.cross_entropy(replay(data.X[rows]), data.y[rows]).backward()
            with torch.no_grad():
                for p in replay.parameters():
                    p -= lr * p.grad
    err = max((p.cpu() - q.detach()).abs().max().item() for p, q in zip(params, replay.parameters()))
    out["train_ddp"] = (err < 1e-4, f"largest difference from one-process SGD {err:.2g}")
    return out


def rank_cuda_work(rank, world):
    """CUDA work in a launched rank: a matrix product on this rank's GPU, then an allreduce
    (of the GPU tensor under NCCL, of its CPU copy under gloo). Returns what the rank saw."""
    gpu = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    initialized_before = torch.cuda.is_initialized() if dist.get_backend() != "nccl" else None
    a = torch.full((256, 256), 1.0, device=gpu)
    value = (a @ a)[0, 0]  # 256
    x = torch.full((1 << 20,), float(rank + 1), device=gpu) * (value / 256)
    if dist.get_backend() == "nccl":
        dist.all_reduce(x)
    else:
        x = x.cpu()
        dist.all_reduce(x)
    torch.cuda.synchronize(gpu)
    return {"pid": os.getpid(), "backend": dist.get_backend(), "device": str(gpu),
            "name": torch.cuda.get_device_name(gpu), "initialized_before": initialized_before,
            "sum_ok": bool(torch.all(x == world * (world + 1) / 2).item())}


def fork_child_cuda(conn):
    """In a child *forked* from a process that has initialised CUDA: try to use CUDA."""
    try:
        torch.zeros(1, device="cuda")
        conn.send("CUDA worked in the forked child")
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def rank_bandwidth(rank, world, ring, sizes, warmup, repeats):
    """{size: {"ring": seconds list, "all_reduce": seconds list, "max_error": e}}: the ring and
    dist.all_reduce on the same float32 tensor, called in turn between barriers."""
    device = device_for(rank)
    out = {}
    for n in sizes:
        original = _ring_input(n, rank, (n,), torch.float32).to(device)
        t = original.clone()
        times = {"ring": [], "all_reduce": []}
        results = {}
        for i in range(warmup + repeats):
            for name, fn in (("ring", ring), ("all_reduce", dist.all_reduce)):
                t.copy_(original)
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                fn(t)
                _sync(device)
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
                results[name] = t.clone()
        err = (results["ring"] - results["all_reduce"]).abs().max().item() if n else 0.0
        out[n] = {"ring": statistics.median(times["ring"]),
                  "all_reduce": statistics.median(times["all_reduce"]), "max_error": err}
    return out
