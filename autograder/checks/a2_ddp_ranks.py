"""What each process of Assignment 2's checks runs (``rank_*``), and the pieces the grader
shares with it (models, data, single-process SGD).

These functions are trusted harness code: a probe in the sandbox starts them with
:func:`run_ranks` on N processes (:func:`course.launch.launch`); they set the stage, call the
student's function, and return plain data for the grader to judge. Every rank imports this
module, so it imports nothing heavier than torch (no pytest, no nbformat).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autograder.probing import describe
from course.launch import default_backend, device_for
from course.models import mlp

#: Seconds a collective (or a receive) may wait before its process group gives up: a ring
#: whose ranks wait for each other fails after this, with a message, instead of hanging.
COLLECTIVE_TIMEOUT = 20.0
#: Seconds for one whole multi-process run (start-up included) before every rank is stopped.
LAUNCH_TIMEOUT = 90.0

# The clock of the in-rank timings, taken when this trusted module is imported in a rank,
# before any student code runs there (so patching time.perf_counter later changes nothing).
_clock = time.perf_counter


def run_ranks(fn, world_size: int, *args, backend: str | None = None,
              timeout: float = LAUNCH_TIMEOUT) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the ranks' results.

    Two or more: fresh processes started by :func:`course.launch.launch`; a failed or stuck
    rank becomes a RuntimeError whose message is the end of that rank's traceback. One: this
    process joins a process group of one and calls ``fn`` itself, which spares a process start
    (seconds of importing torch) and behaves the same for the code under test.
    """
    from course.launch import LaunchError, launch

    if world_size == 1:
        return [_in_this_process(fn, *args, backend=backend)]
    try:
        return launch(fn, world_size, *args, backend=backend, timeout=timeout,
                      collective_timeout=COLLECTIVE_TIMEOUT, quiet=True)
    except LaunchError as exc:
        raise RuntimeError(f"with {world_size} processes, {_short_failure(str(exc))}") from None
    except TimeoutError:
        raise RuntimeError(
            f"with {world_size} processes, the ranks were still running after {timeout:.0f} s "
            "and were stopped: does every send have a matching receive on the other rank, "
            "and does every rank make the same calls in the same order?") from None


def _in_this_process(fn, *args, backend: str | None = None):
    """``fn(0, 1, *args)`` in a process group of one, with one torch thread (as launch gives
    each of its processes)."""
    backend = backend or default_backend(1)
    if backend == "nccl":
        torch.cuda.set_device(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        return fn(0, 1, *args)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


_SECTION = re.compile(r"(?m)^(?=rank \d+ exited with code )")
_LOG_LINE = re.compile(r"^\[[WIEF]\d{4} ")  # torch's own log lines ("[W1122 05:02:48 ...")
_OURS = ("course/launch.py", "<frozen runpy>", "autograder/checks/", "Traceback (most recent")


def _short_failure(text: str) -> str:
    """The first failing rank's exception and the student's frames, without the launcher's
    frames or torch's log lines; the other failed ranks by number."""
    sections = [sec for sec in _SECTION.split(text) if sec.strip()] or [text]
    head, _, body = sections[0].partition("\n")
    keep, under_ours = [], False
    for line in body.splitlines():
        if line.startswith("[rank") and "]: " in line:
            line = line.split("]: ", 1)[1]
        if not line.strip() or _LOG_LINE.match(line) or not line.strip(" ^~"):
            continue
        if any(s in line for s in _OURS):
            under_ours = line.lstrip().startswith("File")
            continue
        if under_ours and line.startswith("    "):
            continue  # the source line (and carets) under one of our frames
        under_ours = False
        keep.append(line.rstrip())
    others = [m.group(1) for sec in sections[1:] if (m := re.match(r"rank (\d+)", sec))]
    message = f"{head.split(';')[0]}:\n" + "\n".join(keep[-12:])
    if others:
        message += f"\n(rank(s) {', '.join(others)} failed as well)"
    if "Timed out" in message or "timed out" in message:
        message += ("\nA rank waited for a message that never came: does every send have a "
                    "matching receive on the other rank, posted before either side waits?")
    return message[-1800:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- models and data

def seeded_model(kind: str, seed: int, rank: int | None = None) -> nn.Module:
    """The model a check trains: deterministic from ``seed`` and the rank, and different on
    every rank, so replicas that were never made equal stay different. ``model_fn`` for the
    student's ``train_ddp`` is ``functools.partial(seeded_model, kind, seed)``."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7919 * rank)
        if kind == "mlp":
            return mlp((20, 32, 5))
        if kind == "cnn":
            return small_cnn()
        raise ValueError(kind)


def small_cnn() -> nn.Sequential:
    """A convolutional net for 1x28x28 images: much arithmetic per example, few parameters
    (about 20k), so the gradients to average are small and more processes pay off."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
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


def sgd_on_global_batches(model: nn.Module, batches, lr: float) -> tuple[list, list]:
    """Plain SGD on one process, mean cross-entropy over each global batch: what data-parallel
    training must equal. Returns (parameters after, gradients of the last step)."""
    grads = []
    for X, y in batches:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(X), y).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    return [p.detach().clone() for p in model.parameters()], grads


# ---------------------------------------------------------------------------- average_gradients

class WithUnusedParameter(nn.Module):
    """``body`` plus a parameter the loss never touches: its ``.grad`` stays None."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.body(x)


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

#: Collectives a ring may not call (python-level names, where this torch has them).
COLLECTIVES = ["all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
               "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object",
               "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
               "gather", "gather_object", "gather_into_tensor", "gather_single", "scatter",
               "scatter_object_list", "broadcast_object_list", "barrier", "monitored_barrier",
               "_broadcast_coalesced"]
#: What the process group's pre-hook counts (its other names are point-to-point or bookkeeping).
_HOOKED_COLLECTIVES = {"BROADCAST", "ALLREDUCE", "REDUCE", "ALLGATHER", "REDUCE_SCATTER",
                       "ALLTOALL", "BARRIER", "SCATTER", "GATHER"}
_HOOK_ID = 424242


@contextlib.contextmanager
def collectives_counted(fn):
    """While inside, every collective call is counted in the yielded dict (what -> calls).

    Two layers: python wrappers around torch.distributed's collective functions (also where
    ``fn``'s globals hold them under their own names), and a pre-hook on the default process
    group, which sees every collective issued on it however it was reached (functional
    collectives included); point-to-point sends and receives are not counted."""
    import torch.distributed.distributed_c10d as c10d

    counts: dict[str, int] = {}
    originals = {name: getattr(c10d, name, None) or getattr(dist, name, None) for name in COLLECTIVES}
    originals = {k: v for k, v in originals.items() if callable(v)}

    def counting(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            counts[f"dist.{name}"] = counts.get(f"dist.{name}", 0) + 1
            return original(*args, **kwargs)
        return wrapper

    wrappers = {name: counting(name, f) for name, f in originals.items()}
    patched = []  # (namespace, name, old value)
    for space in (dist, c10d):
        for name, w in wrappers.items():
            if hasattr(space, name):
                patched.append((space, name, getattr(space, name)))
                setattr(space, name, w)
    by_identity = {id(f): wrappers[name] for name, f in originals.items()}
    g = getattr(fn, "__globals__", {})
    for name, value in list(g.items()):
        if id(value) in by_identity:
            patched.append((g, name, value))
            g[name] = by_identity[id(value)]
    group = c10d._get_default_group()
    hooked = False
    if hasattr(group, "register_pre_hook"):
        def hook(args):
            op = getattr(args.name, "name", str(args.name))
            if op in _HOOKED_COLLECTIVES:
                counts[f"process group {op}"] = counts.get(f"process group {op}", 0) + 1
        try:
            group.register_pre_hook(_HOOK_ID, hook)
            hooked = True
        except Exception:
            pass
    try:
        yield counts
    finally:
        if hooked:
            group.unregister_pre_hook(_HOOK_ID)
        for space, name, old in reversed(patched):
            if isinstance(space, dict):
                space[name] = old
            else:
                setattr(space, name, old)


def ring_input(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor for a case: the grader makes the same ones to sum them."""
    g = torch.Generator().manual_seed(seed + 1009 * rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def rank_ring(rank, world_size, fn, seed, cases, timing=None, reference=None):
    """Each case: this rank's tensor, the student's ring_allreduce on it, collectives counted.
    With ``timing`` (seed, numel, warmup, repeats), then :func:`ring_timing` of ``fn`` (and of
    the ``reference`` ring, where given) against dist.all_reduce."""
    device = device_for(rank)
    out = []
    for i, (shape, dtype) in enumerate(cases):
        t = ring_input(seed + i, rank, shape, dtype).to(device)
        with collectives_counted(fn) as counts:
            returned = fn(t)
        _sync(device)
        out.append({"tensor": describe(t), "returned_none": returned is None, "collectives": counts})
    rings = {"tested": fn, **({"reference": reference} if reference else {})}
    return {"cases": out, "timing": ring_timing(rank, rings, *timing) if timing else None}


def ring_timing(rank, rings: dict, seed, numel, warmup, repeats, count=True):
    """Seconds of each ring in ``rings`` ({name: function}) and of dist.all_reduce on the same
    float32 tensor, called in turn (so that whatever else the machine does slows them alike),
    each call between barriers with the tensor restored before it; and the last result of the
    ring named "tested", whose collectives are counted.

    These timings come from inside the ranks, where the student's code also runs: process
    start-up and joining the group (seconds on a small machine) would swamp any timing of the
    whole run from outside. The clock is the one this module took before any student code ran,
    the grader checks the returned result of this same run, and it checks that the reported
    times fit in the wall-clock time it measured itself."""
    device = device_for(rank)
    original = ring_input(seed, rank, (numel,), torch.float32).to(device)
    t = original.clone()
    calls = {**rings, "all_reduce": dist.all_reduce}
    times: dict[str, list] = {name: [] for name in calls}
    counts: dict[str, int] = {}
    barrier = dist.barrier
    result = None
    for i in range(warmup + repeats):
        for name, fn in calls.items():
            t.copy_(original)
            _sync(device)
            barrier()
            counting = name == "tested" and count
            with collectives_counted(fn) if counting else contextlib.nullcontext({}) as c:
                start = _clock()
                fn(t)
                _sync(device)
                seconds = _clock() - start
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
            if i >= warmup:
                times[name].append(seconds)
            if name == "tested":
                result = t.clone()
    return {"seconds": times, "tensor": describe(result), "collectives": counts}


def rank_ring_sizes(rank, world_size, fn, seed, sizes, warmup, repeats):
    """For :mod:`autograder.bench`: :func:`ring_timing` of ``fn`` for each size, without
    collectives counted; each result is compared here with dist.all_reduce's and only the
    largest difference is returned (tensors of 16M floats would be heavy to send back)."""
    out = {}
    for n in sizes:
        r = ring_timing(rank, {"tested": fn}, seed, n, warmup, repeats, count=False)
        want = ring_input(seed, rank, (n,), torch.float32).to(device_for(rank))
        dist.all_reduce(want)
        got = r.pop("tensor")["value"]
        r["max_error"] = (got - want.cpu()).abs().max().item() if n else 0.0
        out[n] = r
    return out


# ---------------------------------------------------------------------------- train_ddp

def rank_train_ddp(rank, world_size, fn, kind, seed, n, epochs, batch_size, lr, repeats=0,
                   reference=None):
    """The student's train_ddp (``fn``) on a logged data set; returns what it returned and the
    examples this rank read. With ``repeats``, that many calls are timed, after one untimed
    warm-up call of one step; where a ``reference`` train_ddp is given, its calls alternate with
    the student's, so that whatever else the machine does slows both alike. Each call runs
    between barriers and is timed from inside the rank (see :func:`ring_timing` for why)."""
    model_fn = functools.partial(seeded_model, kind, seed)
    device = device_for(rank)
    calls = {"tested": fn, **({"reference": reference} if reference and repeats else {})}
    seconds: dict[str, list] = {name: [] for name in calls}
    if repeats:
        for f in calls.values():
            f(rank, world_size, model_fn, LoggedDataset(kind, seed + 1, world_size * batch_size),
              1, batch_size, lr, seed)
    for _ in range(max(repeats, 1)):
        for name, f in calls.items():
            dataset = LoggedDataset(kind, seed + 1, n)
            dist.barrier()
            start = _clock()
            params = f(rank, world_size, model_fn, dataset, epochs, batch_size, lr, seed)
            _sync(device)
            dist.barrier()
            seconds[name].append(_clock() - start)
            if name == "tested":
                result = {"params": describe(params), "fetched": list(dataset.fetched)}
    return {**result, "seconds": seconds}
