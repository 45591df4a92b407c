"""Checks for Assignment 2: DDP and collectives.

Graded functions (see the notebook for their specifications): ``average_gradients``,
``ring_allreduce`` (with its bandwidth), ``make_dataloader`` and ``train_ddp`` (with its
weak-scaling speedup). Each ``probe_*`` runs in the sandbox beside the student's code and starts
the student's function on N fresh processes with :func:`course.launch.launch` (gloo on CPU
processes, NCCL where every process can have its own GPU); what each of those processes runs
(``rank_*``) is in :mod:`autograder.checks.a2_ddp_ranks`, light enough for every rank to import.
Each ``test_*`` runs in the grader, computes the expectation itself (one-process SGD, sums) from
the same seeds, and judges. Process start-up costs seconds, so a run on N processes that two
checks of the same function can share is made once (:func:`_cached`).

The speed checks time the student's function and the reference solution's in the same
processes, call for call in turn (:func:`reference_function`), so that whatever else runs on
the machine slows both alike; the timings are taken inside the ranks (see
:func:`autograder.checks.a2_ddp_ranks.ring_timing` for why and how they are kept honest).

:mod:`autograder.bench` reuses the same rank functions to measure the reference solution.
"""
from __future__ import annotations

import contextlib
import io
import os
import time

import torch

from autograder.checks.a2_ddp_ranks import (WithUnusedParameter, make_data,
                                            rank_average_gradients, rank_ring, rank_train_ddp,
                                            ring_input, run_ranks, seeded_model,
                                            sgd_on_global_batches)
from autograder.harness import graded, skip_unless
from autograder.probing import (assert_close, describe, fresh_generator, reference_helpers,
                                sequence, student_function, tensor)
from autograder.speedup import judge, median, reference_cells
from course import FULL_RUN
from course.devices import gpu_count

ASSIGNMENT = "a2_ddp"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def can_show_speedup() -> tuple[bool, str]:
    """Two processes can only be faster than one with a core (or a GPU) each."""
    gpus, cores = gpu_count(), usable_cores()
    return gpus >= 2 or cores >= 2, (
        f"needs 2 GPUs or 2 CPU cores, this machine has {gpus} GPU(s) and {cores} core(s): two "
        "processes would take turns on one core")


def reference_function(cells, name: str):
    """The reference solution's ``name``, defined from its ``cells`` (run where the probe runs),
    or None without cells (the student edition). The speed checks time it in the same
    processes as the student's code, call for call in turn: whatever else the machine does
    then slows both alike, and the two figures compare fairly."""
    if not cells:
        return None
    ns: dict = {"__name__": "__reference__"}  # not importable: travels to the ranks by value
    with contextlib.redirect_stdout(io.StringIO()):  # the set-up cell's printout
        for cell_id, source in cells:
            exec(compile(source, f"<reference {cell_id}>", "exec"), ns)
    return ns[name]


def _cached(student, key, compute):
    """One multi-process run shared by several checks of the same function (each run costs
    seconds of process start-up); a failure is remembered and fails each of them alike."""
    cache = student.__dict__.setdefault("_a2_runs", {})
    if key not in cache:
        try:
            cache[key] = ("ok", compute())
        except AssertionError as exc:
            cache[key] = ("failed", exc)
    status, value = cache[key]
    if status == "failed":
        raise AssertionError(str(value))
    return value


# ---------------------------------------------------------------------------- average_gradients

def probe_average_gradients(ns, world_size, seed, steps, batch, lr):
    fn = student_function(ns, "average_gradients", ["model"])
    return run_ranks(rank_average_gradients, world_size, fn, seed, steps, batch, lr)


AVG_WORLD, AVG_STEPS, AVG_BATCH, AVG_LR = 3, 3, 12, 0.5


def _average_gradients_run(student):
    """(the ranks' replies, seed) of one 3-process run, shared by both checks."""
    def run():
        _, seed = fresh_generator()
        return student.call(probe_average_gradients, AVG_WORLD, seed, AVG_STEPS, AVG_BATCH,
                            AVG_LR), seed
    return _cached(student, "average_gradients", run)


def _expected_average_gradients(seed):
    model = WithUnusedParameter(seeded_model("mlp", seed, rank=0))
    X, y = make_data("mlp", seed + 1, AVG_STEPS * AVG_BATCH)
    batches = [(X[s * AVG_BATCH:(s + 1) * AVG_BATCH], y[s * AVG_BATCH:(s + 1) * AVG_BATCH])
               for s in range(AVG_STEPS)]
    return sgd_on_global_batches(model, batches, AVG_LR)


@graded("average_gradients", points=2, timeout=120)
def test_average_gradients_training_matches_one_process(student):
    ranks, seed = _average_gradients_run(student)
    want, _ = _expected_average_gradients(seed)
    for rank, r in enumerate(ranks):
        params = sequence(r["params"], f"rank {rank}'s parameters", len(want))
        for i, (desc, w) in enumerate(zip(params, want)):
            assert_close(tensor(desc, "parameter")["value"], w,
                         f"rank {rank}'s parameter {i} after {AVG_STEPS} SGD steps on "
                         f"{AVG_WORLD} processes with your average_gradients (vs one process on "
                         "the global batches)", rtol=1e-4, atol=1e-5, seed=seed)


@graded("average_gradients", points=1, timeout=120)
def test_average_gradients_averages_and_skips_missing_grads(student):
    ranks, seed = _average_gradients_run(student)
    _, want = _expected_average_gradients(seed)
    for rank, r in enumerate(ranks):
        grads = sequence(r["grads"], f"rank {rank}'s gradients", len(want))
        for i, (desc, w) in enumerate(zip(grads, want)):
            if w is None:
                assert desc.get("kind") == "plain" and desc.get("value") is None, (
                    f"rank {rank}: a parameter without a gradient (.grad is None) got one; "
                    "skip parameters whose .grad is None")
                continue
            g = tensor(desc, f"rank {rank}'s gradient {i}")["value"]
            assert_close(g, w, f"rank {rank}'s gradient {i} after average_gradients (vs the "
                         "gradient of the mean loss over the global batch)",
                         rtol=1e-4, atol=1e-6, seed=seed)


# ---------------------------------------------------------------------------- ring_allreduce

def probe_ring(ns, world_size, seed, cases, timing=None, reference_cells=None):
    fn = student_function(ns, "ring_allreduce", ["tensor"])
    reference = reference_function(reference_cells, "ring_allreduce")
    start = time.perf_counter()
    ranks = run_ranks(rank_ring, world_size, fn, seed, cases, timing, reference)
    return {"ranks": ranks, "wall": time.perf_counter() - start}


F32, F64 = torch.float32, torch.float64
RING_TWO_CASES = [((8,), F32), ((5,), F32), ((3, 7), F32), ((1,), F32), ((1000,), F64),
                  ((100003,), F32)]
# empty, one element, fewer elements than ranks, primes, not divisible, large
RING_AWKWARD_CASES = [((0,), F32), ((1,), F32), ((2,), F64), ((3,), F32), ((13,), F32),
                      ((97,), F64), ((4, 5), F32), ((65537,), F32)]
#: The timed tensor (float32 elements), calls timed after the warm-up ones.
RING_TIMED_NUMEL = (16 << 20) if FULL_RUN else (4 << 20)
RING_WARMUP, RING_REPEATS = 2, 15


def _judge_ring_result(r, world_size, seed, shape, dtype, what):
    assert isinstance(r, dict), f"{what}: the probe's reply was tampered with"
    used = {k: v for k, v in r["collectives"].items() if v}
    assert not used, (
        f"{what}: your ring_allreduce called collective operations ({', '.join(sorted(used))}); "
        "use only point-to-point operations (send, recv, isend, irecv, batch_isend_irecv)")
    t = tensor(r["tensor"], f"{what}: the tensor after ring_allreduce")
    expected = sum(ring_input(seed, rank, shape, dtype) for rank in range(world_size))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=1e-12, atol=1e-12)
    assert_close(t["value"], expected, f"{what}: the tensor after ring_allreduce (vs the sum "
                 f"over the {world_size} ranks)", seed=seed, **tol)


def _judge_ring_cases(reply, world_size, seed, cases):
    for rank, r in enumerate(reply["ranks"]):
        for i, ((shape, dtype), case) in enumerate(zip(cases, r["cases"])):
            what = (f"{world_size} process(es), rank {rank}, tensor of shape {tuple(shape)} "
                    f"({str(dtype).removeprefix('torch.')})")
            _judge_ring_result(case, world_size, seed + i, shape, dtype, what)
            assert case["returned_none"], \
                f"{what}: ring_allreduce should work in place and return None"


def _ring_two_processes(student):
    """(reply, seed, timing seed, wall seconds) of the 2-process run: the correctness cases,
    then the timed calls, the reference ring's among them where it is at hand and the speed
    can be judged here (one run, shared by two checks)."""
    def run():
        _, seed = fresh_generator()
        timing_seed = seed + 1_000_003
        cells = reference_cells(ASSIGNMENT) if can_show_speedup()[0] else None
        start = time.perf_counter()
        reply = student.call(probe_ring, 2, seed, RING_TWO_CASES,
                             (timing_seed, RING_TIMED_NUMEL, RING_WARMUP, RING_REPEATS), cells)
        return reply, seed, timing_seed, time.perf_counter() - start
    return _cached(student, "ring2", run)


@graded("ring_allreduce", points=2, timeout=180)
def test_ring_allreduce_two_processes(student):
    reply, seed, _, _ = _ring_two_processes(student)
    _judge_ring_cases(reply, 2, seed, RING_TWO_CASES)


@graded("ring_allreduce", points=2, timeout=240)
def test_ring_allreduce_one_three_four_processes_awkward_sizes(student):
    for world_size in (1, 3, 4):
        _, seed = fresh_generator()
        reply = student.call(probe_ring, world_size, seed, RING_AWKWARD_CASES)
        _judge_ring_cases(reply, world_size, seed, RING_AWKWARD_CASES)


def ring_fractions(reply, wall: float) -> dict[str, float]:
    """{ring: median all_reduce seconds / median ring seconds} for the student's ring
    ("tested") and the reference's where it was timed; a call's time is its slowest rank's."""
    timings = [r["timing"] for r in reply["ranks"]]
    per_call = {name: [max(v) for v in zip(*(t["seconds"][name] for t in timings))]
                for name in timings[0]["seconds"]}
    every = [x for v in per_call.values() for x in v]
    assert per_call["tested"] and all(isinstance(x, float) and x > 0 for x in every), \
        "the timings of ring_allreduce were tampered with"
    assert sum(every) <= wall, \
        "the timings reported from the processes do not fit in the time the grader measured"
    builtin = median(per_call.pop("all_reduce"))
    return {name: builtin / median(v) for name, v in per_call.items()}


@graded("ring_allreduce", points=2, timeout=240, speedup=True)
def test_ring_allreduce_bandwidth(student):
    skip_unless(*can_show_speedup())
    reply, _, timing_seed, wall = _ring_two_processes(student)
    for rank, r in enumerate(reply["ranks"]):  # the run that was timed must be right
        _judge_ring_result(r["timing"], 2, timing_seed, (RING_TIMED_NUMEL,), F32,
                           f"the timed run, rank {rank}")
    fractions = ring_fractions(reply, wall)
    judge(fractions["tested"], fractions.get("reference"), 0.5,
          f"ring_allreduce speed as a fraction of dist.all_reduce's ({RING_TIMED_NUMEL >> 20}M "
          "float32 on 2 processes)")


# ---------------------------------------------------------------------------- make_dataloader

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

    fn = student_function(ns, "make_dataloader",
                          ["dataset", "batch_size", "rank", "world_size", "seed"])
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


def _check_loaders(student, cases):
    ranks_per_case = student.call(probe_make_dataloader, cases)
    orders = []  # per case: per epoch: per rank: the index sequence
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


@graded("make_dataloader", points=2)
def test_make_dataloader_disjoint_shards_cover_the_data(student):
    _, seed = fresh_generator()
    cases = [(24, 2, 5, seed, [0]), (24, 3, 4, seed, [0]), (10, 3, 2, seed, [0]),
             (7, 4, 3, seed, [0]), (13, 1, 4, seed, [0]), (3, 4, 2, seed, [0])]
    _check_loaders(student, cases)


@graded("make_dataloader", points=1)
def test_make_dataloader_new_order_each_epoch(student):
    _, seed = fresh_generator()
    other = (seed + 12345) % (2 ** 31)
    cases = [(40, 2, 8, seed, [0, 1, 0, 2]), (40, 2, 8, other, [0]), (25, 3, 4, seed, [0, 1])]
    orders = _check_loaders(student, cases)
    e0, e1, e0_again, e2 = orders[0]
    case = "make_dataloader(dataset of 40, batch_size=8, rank, world_size=2, seed)"
    assert e0 != e1 and e1 != e2 and e0 != e2, (
        f"{case}: two of set_epoch(0), set_epoch(1) and set_epoch(2) gave the same order; "
        "every epoch should shuffle anew")
    assert e0 == e0_again, (f"{case}: set_epoch(0) twice gave two different orders; the order "
                            "must depend only on the seed and the epoch, so that every rank "
                            "computes the same shuffle")
    assert e0 != orders[1][0], f"{case}: two different seeds gave the same order"
    assert any(o != sorted(o) for o in e0), f"{case}: the examples are not shuffled"
    assert orders[2][0] != orders[2][1], \
        "make_dataloader(dataset of 25, ..., world_size=3, ...): epochs 0 and 1 gave the same order"


# ---------------------------------------------------------------------------- train_ddp

TRAIN_PARAMS = ["rank", "world_size", "model_fn", "dataset", "epochs", "batch_size", "lr", "seed"]
TRAIN_HELPERS = ["setup", "make_dataloader", "average_gradients"]


def probe_train_ddp(ns, world_size, kind, seed, n, epochs, batch_size, lr, helper_cells,
                    repeats=0, backend=None, reference_cells=None):
    fn = student_function(ns, "train_ddp", TRAIN_PARAMS)
    reference = reference_function(reference_cells, "train_ddp")
    with reference_helpers(fn, helper_cells, ["make_dataloader", "average_gradients"]):
        start = time.perf_counter()
        ranks = run_ranks(rank_train_ddp, world_size, fn, kind, seed, n, epochs, batch_size, lr,
                          repeats, reference, backend=backend)
    return {"ranks": ranks, "wall": time.perf_counter() - start}


def _judge_training(ranks, world_size, kind, seed, n, epochs, batch_size, lr, what):
    """Every rank read its share of each epoch once, in a new order each epoch, and ended with
    the parameters of one-process SGD on the global batches it actually saw."""
    per_rank = n // world_size
    steps_per_epoch = per_rank // batch_size
    fetched = []
    for rank, r in enumerate(ranks):
        f = r["fetched"]
        assert isinstance(f, list) and all(isinstance(i, int) for i in f), "reply tampered with"
        assert f, (f"{what}: rank {rank} never read the data set in its own process: use "
                   "make_dataloader (num_workers=0) on the dataset you were given")
        assert len(f) == epochs * per_rank, (
            f"{what}: rank {rank} read {len(f)} examples; {epochs} epoch(s) over its shard of "
            f"{per_rank} should read {epochs * per_rank} (one pass of its loader per epoch, and "
            "nothing else)")
        fetched.append(f)
    for e in range(epochs):
        shares = [f[e * per_rank:(e + 1) * per_rank] for f in fetched]
        assert sorted(i for s in shares for i in s) == list(range(n)), (
            f"{what}: in epoch {e} the ranks did not read every example exactly once between "
            "them: use make_dataloader(dataset, batch_size, rank, world_size, seed)")
        if e:
            before = [f[(e - 1) * per_rank:e * per_rank] for f in fetched]
            assert shares != before, (
                f"{what}: epochs {e - 1} and {e} read the examples in the same order: call "
                "loader.sampler.set_epoch(epoch) at the start of every epoch")
    replicas = []
    for rank, r in enumerate(ranks):
        items = sequence(r["params"], f"{what}: what train_ddp returned on rank {rank} "
                         "(the list of model.parameters())")
        replicas.append([tensor(d, f"{what}: rank {rank}'s parameter {i}")["value"]
                         for i, d in enumerate(items)])
    for rank, params in enumerate(replicas[1:], start=1):
        assert len(params) == len(replicas[0]), f"{what}: ranks returned different parameter lists"
        for i, (a, b) in enumerate(zip(params, replicas[0])):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (
                f"{what}: rank {rank}'s parameter {i} differs from rank 0's; every replica must "
                "start equal (DDP copies rank 0's parameters when it wraps the model) and take "
                "the same steps (DDP averages the gradients during backward)")
    X, y = make_data(kind, seed + 1, n)
    batches = []
    for e in range(epochs):
        for s in range(steps_per_epoch):
            rows = [i for f in fetched
                    for i in f[e * per_rank + s * batch_size:e * per_rank + (s + 1) * batch_size]]
            batches.append((X[rows], y[rows]))
    want, _ = sgd_on_global_batches(seeded_model(kind, seed, rank=0), batches, lr)
    assert len(replicas[0]) == len(want), (
        f"{what}: train_ddp returned {len(replicas[0])} tensors; return the model's "
        f"{len(want)} parameters, in model.parameters() order")
    for i, (got, w) in enumerate(zip(replicas[0], want)):
        assert_close(got, w, f"{what}: parameter {i} after training (vs SGD on one process "
                     "over the same global batches, starting from rank 0's model)",
                     rtol=1e-4, atol=1e-5, seed=seed)


#: The runs on 2 processes (timed) and 1 (for the speedup): every process trains
#: SCALING_EPOCHS x SCALING_STEPS steps of SCALING_BATCH examples of a small CNN per call.
SCALING_BATCH, SCALING_STEPS, SCALING_EPOCHS, SCALING_REPEATS, SCALING_LR = 256, 2, 2, 5, 0.05
#: The run on 3 processes: a small MLP, 2 epochs of 2 steps of 8 examples per process.
TRAIN_BATCH, TRAIN_STEPS, TRAIN_EPOCHS, TRAIN_LR = 8, 2, 2, 0.2


def scaling_backend() -> str:
    return "nccl" if gpu_count() >= 2 else "gloo"


def scaling_run(call, world_size: int, seed: int, helper_cells=None,
                reference_cells=None) -> tuple[dict[str, float], dict]:
    """({"tested": median seconds of one train_ddp call, "reference": the same for the
    reference, where given}, the reply) on ``world_size`` processes: weak scaling, every
    process trains on as many examples whatever their count."""
    n = world_size * SCALING_BATCH * SCALING_STEPS
    start = time.perf_counter()
    reply = call(probe_train_ddp, world_size, "cnn", seed, n, SCALING_EPOCHS, SCALING_BATCH,
                 SCALING_LR, helper_cells, SCALING_REPEATS, scaling_backend(), reference_cells)
    wall = time.perf_counter() - start
    ranks = reply["ranks"]
    per_call = {name: [max(v) for v in zip(*(r["seconds"][name] for r in ranks))]
                for name in ranks[0]["seconds"]}
    every = [x for v in per_call.values() for x in v]
    assert per_call["tested"] and all(isinstance(x, float) and x > 0 for x in every), \
        "the timings of train_ddp were tampered with"
    assert sum(every) <= wall, \
        "the timings reported from the processes do not fit in the time the grader measured"
    return {name: median(v) for name, v in per_call.items()}, reply


def _judge_scaling_run(reply, world_size, seed, what):
    _judge_training(reply["ranks"], world_size, "cnn", seed,
                    world_size * SCALING_BATCH * SCALING_STEPS, SCALING_EPOCHS, SCALING_BATCH,
                    SCALING_LR, what)


def _scaling_cells():
    """The reference solution's cells to time beside the student's, where it is at hand and
    the hardware can show a speedup."""
    return reference_cells(ASSIGNMENT) if can_show_speedup()[0] else None


def _train_two_processes(student):
    """({"tested"/"reference": median seconds}, reply, seed) of the timed 2-process run,
    shared by two checks."""
    def run():
        _, seed = fresh_generator()
        helpers = reference_cells(ASSIGNMENT, TRAIN_HELPERS)
        seconds, reply = scaling_run(student.call, 2, seed, helpers, _scaling_cells())
        return seconds, reply, seed
    return _cached(student, "train2", run)


@graded("train_ddp", points=2, timeout=180)
def test_train_ddp_two_processes_match_one(student):
    _, reply, seed = _train_two_processes(student)
    _judge_scaling_run(reply, 2, seed, "train_ddp on 2 processes")


@graded("train_ddp", points=1, timeout=120)
def test_train_ddp_three_processes_match_one(student):
    _, seed = fresh_generator()
    n = 3 * TRAIN_BATCH * TRAIN_STEPS
    reply = student.call(probe_train_ddp, 3, "mlp", seed, n, TRAIN_EPOCHS, TRAIN_BATCH, TRAIN_LR,
                         reference_cells(ASSIGNMENT, TRAIN_HELPERS))
    _judge_training(reply["ranks"], 3, "mlp", seed, n, TRAIN_EPOCHS, TRAIN_BATCH, TRAIN_LR,
                    "train_ddp on 3 processes")


@graded("train_ddp", points=2, timeout=300, speedup=True)
def test_train_ddp_weak_scaling_two_processes(student):
    skip_unless(*can_show_speedup())
    two, reply2, seed = _train_two_processes(student)
    _judge_scaling_run(reply2, 2, seed, "the timed train_ddp on 2 processes")
    one, reply1 = scaling_run(student.call, 1, seed, reference_cells(ASSIGNMENT, TRAIN_HELPERS),
                              _scaling_cells())
    _judge_scaling_run(reply1, 1, seed, "the timed train_ddp on 1 process")
    speedups = {name: 2 * one[name] / two[name] for name in two if name in one}
    where = "2 GPUs" if gpu_count() >= 2 else "2 CPU processes, one thread each,"
    judge(speedups["tested"], speedups.get("reference"), 1.3,
          f"train_ddp weak scaling: examples per second on {where} vs 1 "
          f"({SCALING_BATCH} examples per process per step)")
