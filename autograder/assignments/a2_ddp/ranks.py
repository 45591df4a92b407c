"""What each process of Assignment 2's checks runs, and the models and data it shares with the
grader.

Trusted harness code: a probe in the sandbox starts these on N processes, one-shot
(``rank_*``, with :func:`autograder.checking.ranks.run_ranks`) or as ranks that stay up
(``*_server``: the ``setup`` of a :class:`~autograder.checking.ranks.RankServer`, whose
commands the grader times from its own process). They set the stage, call the student's
function and return plain data for the grader to judge. Every rank imports this module, so it
imports nothing heavier than torch (no pytest, no nbformat). The ranks' fork server imports it
before the submission is loaded (the spec's ``rank_modules``): what it binds at import (the
yardstick ``dist.all_reduce``, torch's flight recorder in
:mod:`autograder.checking.collectives`) is torch's own, whatever student code does later.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autograder.checking.collectives import collectives_counted
from autograder.checking.probes import describe
from course.launch import device_for

# dist.all_reduce as this trusted module found it when the ranks' fork server imported it,
# before any student code existed there: the bandwidth check's yardstick, whatever a
# submission rebinds later.
_ALL_REDUCE = dist.all_reduce


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- models and data

def seeded_model(kind: str, seed: int, rank: int | None = None) -> nn.Module:
    """The model a check trains: deterministic from ``seed`` and the rank, and different on
    every rank, so replicas that were never made equal stay different. ``model_fn`` for the
    student's ``train_ddp`` is ``functools.partial(seeded_model, kind, seed)``.

    Both kinds are smooth functions of their parameters (tanh, average pooling: no ReLU, no
    max pooling). Why: the checks compare float32 training with float64 training, within a
    tolerance derived from how far a float32 run strays. At a kink, a value within one
    rounding of zero (ReLU) or of its neighbour (a max pool's argmax) can go one way in
    float32 and the other in float64, and one example's whole gradient goes elsewhere. The
    CNN's ~5 million such values per step made that happen in a few percent of correct
    runs (single-threaded float32 against the grader's float64 truth, 60 seeds), far beyond
    any tolerance derived from a run that happened not to flip: the A2 reference lost its
    weak-scaling points that way. With smooth models every float32 run strays by rounding
    alone (the largest, 2% of the bar over 70 seeds): see tests/test_grader_a2.py."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7919 * rank)
        if kind == "mlp":
            return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))
        if kind == "cnn":
            return small_cnn()
        raise ValueError(kind)


def small_cnn() -> nn.Sequential:
    """A convolutional net for 1x28x28 images: much arithmetic per example, few parameters
    (about 20k), so the gradients to average are small and more processes pay off. Smooth
    (tanh, average pooling), as :func:`seeded_model` explains."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 7 * 7, 10))


INPUT_SHAPES = {"mlp": ((20,), 5), "cnn": ((1, 28, 28), 10)}


def make_data(kind: str, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random examples for ``kind``'s model, the same in every process."""
    shape, classes = INPUT_SHAPES[kind]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


class LoggedDataset(torch.utils.data.Dataset):
    """A map-style data set that writes down which examples were read, in order: the grader
    replays training on exactly the batches each rank saw."""

    def __init__(self, kind: str, seed: int, n: int):
        self.X, self.y = make_data(kind, seed, n)
        self.fetched: list[int] = []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        index = int(index)
        self.fetched.append(index)
        return self.X[index], self.y[index]


class WithUnusedParameter(nn.Module):
    """``body`` plus a parameter the loss never touches: its ``.grad`` stays None."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.body(x)


# ---------------------------------------------------------------------------- average_gradients

def rank_average_gradients(rank, world_size, fn, seed, steps, batch, lr):
    """The harness makes the replicas equal (a broadcast from rank 0); then, each step, every
    rank backpropagates its slice of the global batch, the student's ``average_gradients``
    runs, and plain SGD follows."""
    device = device_for(rank)
    model = WithUnusedParameter(seeded_model("mlp", seed)).to(device)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, 0)
    X, y = make_data("mlp", seed + 1, steps * batch)
    grads = []
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        Xs = torch.tensor_split(X[rows], world_size)[rank].to(device)
        ys = torch.tensor_split(y[rows], world_size)[rank].to(device)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(Xs), ys).backward()
        fn(model)
        grads = [None if p.grad is None else p.grad.detach() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    return {"params": describe([p.detach() for p in model.parameters()]),
            "grads": describe(grads)}


# ---------------------------------------------------------------------------- ring_allreduce

def ring_input(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor for a case: the grader makes the same ones to sum them."""
    g = torch.Generator().manual_seed(seed + 1009 * rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def rank_ring(rank, world_size, fn, seed, cases):
    """Each case: this rank's tensor, the student's ring_allreduce on it, collectives counted
    on every process group (those the ring makes included) and by torch's flight recorder."""
    device = device_for(rank)
    out = []
    for i, (shape, dtype) in enumerate(cases):
        t = ring_input(seed + i, rank, shape, dtype).to(device)
        with collectives_counted(fn, every_group=True) as counts:
            returned = fn(t)
        _sync(device)
        out.append({"tensor": describe(t), "returned_none": returned is None, "collectives": counts})
    return {"cases": out}


def fresh_large_blocks() -> bool:
    """From now on, every block of 1 MiB or more that this process allocates comes fresh from
    the system and goes back to it when freed (glibc's malloc: a fixed mmap threshold); False
    where that cannot be set (not glibc).

    Why: by default glibc keeps or returns a large freed block depending on the blocks alive
    around it (its mmap threshold and heap trimming adapt as the process runs), and a block that
    comes back fresh costs a page fault per 4 kB page when first written. In the grader's ranks,
    two rings that follow the text alike (a receive buffer and a copy of the chunk to send,
    allocated at every step: 8,192 pages per call at 4M floats) faulted anywhere from 2,000 to
    7,500 times per call from one run to the next, and one ran at 0.29x of all_reduce's speed
    while the other ran at 0.50x, only because it kept one more buffer alive into the next
    step. With the threshold fixed, both fault 8,200 times per call, every run: a ring's time
    follows what it allocates, not where. The reference's ranks and the student's are set up
    alike."""
    import ctypes
    import ctypes.util

    M_MMAP_THRESHOLD = -3  # glibc's malloc.h
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 20))
    except (OSError, AttributeError, TypeError):  # no such library or function here
        return False


def ring_server(rank, world_size, fn, seed, sizes):
    """Commands ``ring-N`` (the ring ``fn`` on this rank's float32 tensor of N elements,
    restored first, collectives counted as :func:`rank_ring` counts them) and
    ``all_reduce-N`` (the same with dist.all_reduce, on a tensor of its own), for each N in
    ``sizes``; ``result``: the ring's tensors after its last call, in ``sizes`` order, the
    collectives it called, and how many ring calls completed per size (``calls``: each call
    starts from the same tensor, so only this count tells a skipped call from a done one).
    Large blocks come fresh from the system (:func:`fresh_large_blocks`)."""
    fresh_large_blocks()
    device = device_for(rank)
    originals = [ring_input(seed, rank, (n,), torch.float32).to(device) for n in sizes]
    ring = [o.clone() for o in originals]
    builtin = [o.clone() for o in originals]
    counts: dict[str, int] = {}
    calls = [0] * len(sizes)

    def run_ring(i):
        ring[i].copy_(originals[i])
        with collectives_counted(fn, every_group=True) as c:
            fn(ring[i])
            _sync(device)
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
        calls[i] += 1

    def run_builtin(i):
        builtin[i].copy_(originals[i])
        _ALL_REDUCE(builtin[i])
        _sync(device)

    commands = {"result": lambda: {"tensors": [describe(t) for t in ring], "collectives": counts,
                                   "calls": list(calls)}}
    for i, n in enumerate(sizes):
        commands[f"ring-{n}"] = functools.partial(run_ring, i)
        commands[f"all_reduce-{n}"] = functools.partial(run_builtin, i)
    return commands


# ---------------------------------------------------------------------------- train_ddp

def train_server(rank, world_size, fn, kind, seed, n, epochs, batch_size, lr):
    """Commands ``train`` (the student's train_ddp, ``fn``, on a logged data set of ``n``
    examples) and ``warmup`` (one step of it); ``result``: what the last ``train`` returned, the
    examples this rank read in it, and how many ``train`` commands completed (``trained``: each
    trains from scratch, so only this count tells a skipped command from a done one)."""
    model_fn = functools.partial(seeded_model, kind, seed)
    device = device_for(rank)
    last: dict = {}
    trained = [0]

    def train(examples, rounds):
        dataset = LoggedDataset(kind, seed + 1, examples)
        params = fn(rank, world_size, model_fn, dataset, rounds, batch_size, lr, seed)
        _sync(device)
        return {"params": describe(params), "fetched": list(dataset.fetched)}

    def train_all():
        last.update(train(n, epochs))
        trained[0] += 1

    return {"train": train_all,
            "warmup": lambda: train(world_size * batch_size, 1),
            "result": lambda: {**last, "trained": trained[0]}}


def rank_train_ddp(rank, world_size, fn, kind, seed, n, epochs, batch_size, lr):
    """One-shot: the student's train_ddp once; what it returned and the examples read."""
    commands = train_server(rank, world_size, fn, kind, seed, n, epochs, batch_size, lr)
    commands["train"]()
    return commands["result"]()
