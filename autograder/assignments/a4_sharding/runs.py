"""Assignment 4's classes in the grader: the cases of the multi-process runs that each class's
checks share (one run per world size, :func:`~.judging.runs_per_world_size`), and walks over
what every rank of those runs replied, next to what it should be (:mod:`.expected`)."""
from __future__ import annotations

import torch

from autograder.checking.expect import assert_close, fresh_generator, sequence, tensor
from autograder.checking.timeouts import call_timeout

from . import expected
from .judging import runs_per_world_size
from .probes import (probe_apply_fsdp, probe_bucketed_ddp, probe_sharded_linear,
                     probe_sharded_optimizer)
from .spec import SPEC


# ---------------------------------------------------------------------------- ShardedOptimizer

#: (model kind, optimizer, its arguments); the last one has 12 elements: no padding on 2 or 3
#: ranks, where the byte counts are compared with the run (:mod:`.traffic`).
OPT_CASES = [("mlp", "SGD", {"lr": 0.1, "momentum": 0.9}),
             ("mlp", "AdamW", {"lr": 0.01, "weight_decay": 0.1}),
             ("tiny", "AdamW", {"lr": 0.05}),
             ("tiny", "SGD", {"lr": 0.1, "momentum": 0.5}),
             ("even", "AdamW", {"lr": 0.02, "weight_decay": 0.05})]
OPT_STEPS, OPT_PER_RANK = 3, 3
#: Allowed python-level collective names inside step(): the reduce-scatter and all-gather
#: families (one may call the other); anything else (an all-reduce) is not what step() does.
ALLOWED = ("reduce_scatter", "all_gather", "REDUCE_SCATTER", "ALLGATHER")


def optimizer_runs(student) -> tuple[int, dict]:
    return runs_per_world_size(student, "opt", "sharded_optimizer_matches_one_process",
                               probe_sharded_optimizer, "shard_bounds", OPT_CASES, OPT_STEPS,
                               OPT_PER_RANK)


def optimizer_each(student, min_world: int = 1):
    """(world size, rank, case index, case, reply) of every rank of every run on ``min_world``
    or more ranks."""
    seed, runs = optimizer_runs(student)
    for world, ranks in runs.items():
        if world < min_world:
            continue
        assert isinstance(ranks, list) and len(ranks) == world, "the probe's reply was tampered with"
        for rank, replies in enumerate(ranks):
            assert isinstance(replies, list) and len(replies) == len(OPT_CASES), \
                "the probe's reply was tampered with"
            for i, (case, reply) in enumerate(zip(OPT_CASES, replies)):
                yield seed, world, rank, i, case, reply


def optimizer_where(world, rank, case) -> str:
    kind, name, kwargs = case
    return f"{world} rank(s), rank {rank}, {name}({kwargs}) on the {kind} model"


# ---------------------------------------------------------------------------- BucketedDDP

#: (model shape (width, depth, with an unused parameter), bucket bytes): several buckets of
#: float64 gradients, parameter 0 in the last one; the second case leaves parameter 2 unused.
DDP_CASES = [((6, 4, False), 400), ((5, 3, True), 256)]
DDP_STEPS, DDP_PER_RANK, DDP_LR = 3, 2, 0.1


def ddp_each(student, cases):
    """(seed, world, rank, case index, step, that step's reply, expected gradients, buckets
    as (indices, elements))."""
    seed, runs = runs_per_world_size(student, "ddp", "bucketed_ddp_gradients_match_one_process",
                                     probe_bucketed_ddp, "assign_buckets", DDP_CASES, DDP_STEPS,
                                     DDP_PER_RANK, DDP_LR)
    for world, ranks in runs.items():
        assert isinstance(ranks, list) and len(ranks) == world, "the probe's reply was tampered with"
        for i in cases:
            shape, bucket_bytes = DDP_CASES[i]
            want, numels = expected.one_process_ddp(seed + 101 * i, shape, DDP_STEPS,
                                                    DDP_PER_RANK, world, DDP_LR)
            buckets = [(b, sum(numels[j] for j in b))
                       for b in expected.buckets(numels, bucket_bytes, 8)]
            for rank, replies in enumerate(ranks):
                assert isinstance(replies, list) and len(replies) == len(DDP_CASES) and all(
                    isinstance(r, list) and len(r) == DDP_STEPS for r in replies), \
                    "the probe's reply was tampered with"
                for step, reply in enumerate(replies[i]):
                    yield seed, world, rank, i, step, reply, want[step], buckets


def judge_ddp_grads(student, cases):
    for seed, world, rank, i, step, reply, want, _ in ddp_each(student, cases):
        where = f"{world} rank(s), rank {rank}, model {i + 1}, step {step + 1}"
        grads = sequence(reply["grads"], f"{where}: the gradients", len(want))
        for j, (d, w) in enumerate(zip(grads, want)):
            if w is None:
                assert d.get("kind") == "tensor", (
                    f"{where}: parameter {j} got no gradient in this step; after "
                    f"finish_gradient_synchronization() its .grad should be zeros, got "
                    f"{d.get('value') if d.get('kind') == 'plain' else d.get('kind')}")
            g = tensor(d, f"{where}: gradient {j}")["value"]
            assert_close(g, torch.zeros_like(g) if w is None else w,
                         f"{where}: gradient {j} after finish_gradient_synchronization() (vs the "
                         "full-batch gradient in one process)", rtol=1e-9, atol=1e-12, seed=seed)



# ---------------------------------------------------------------------------- ShardedLinear

#: (in, out, bias, batch, input needs grad): features not divisible by 2 or 3, no bias, an
#: input without gradient; every input and output holds fewer elements than the weight. The
#: layers' elements (40, 24, 18): 24 and 18 are divisible by 2 and 3 (no padding: the byte
#: counts are compared with these runs, :mod:`.traffic`), 40 by 2 only.
LINEAR_CASES = [(7, 5, True, 3, True), (6, 4, False, 2, False), (5, 3, True, 2, True)]


def linear_each(student, min_world: int = 1):
    """(seed, world, rank, case, reply, what every rank must see, where: for messages) of every
    rank and case of the runs on ``min_world`` or more ranks."""
    seed, runs = runs_per_world_size(student, "linear",
                                     "sharded_linear_outputs_and_gradients_match_dense",
                                     probe_sharded_linear, "shard_bounds", LINEAR_CASES)
    for world, ranks in runs.items():
        if world < min_world:
            continue
        assert isinstance(ranks, list) and len(ranks) == world, "the probe's reply was tampered with"
        for i, case in enumerate(LINEAR_CASES):
            want = expected.linear_case(seed + i, case, world)
            for rank, replies in enumerate(ranks):
                assert isinstance(replies, list) and len(replies) == len(LINEAR_CASES), \
                    "the probe's reply was tampered with"
                yield seed, world, rank, case, replies[i], want, linear_where(world, rank, case)


def assert_holds_its_shard(count: int, numel: int, world: int, rank: int, where: str,
                           holder: str) -> tuple[int, int]:
    """Assert that ``holder`` (".optimizer holds", "the layer stores") has exactly rank
    ``rank``'s share of ``numel`` elements over ``world`` ranks; return that share's bounds."""
    start, end = expected.shard(numel, world, rank)
    assert count == end - start, (
        f"{where}: {holder} {count} element(s); rank {rank} owns "
        f"shard_bounds({numel}, {world}, {rank}) = ({start}, {end})")
    return start, end


def shard_param(reply, where: str, key: str):
    params = sequence(reply[key], f"{where}: the layer's parameters")
    assert len(params) == 1, f"{where}: the layer should have one parameter (its shard), has {len(params)}"
    return tensor(params[0], f"{where}: the shard")["value"]


def linear_where(world, rank, case):
    in_f, out_f, bias, batch, needs = case
    return (f"{world} rank(s), rank {rank}, ShardedLinear({in_f}, {out_f}, bias={bias}) on "
            f"{batch} inputs{'' if needs else ' that need no gradient'}")


# ---------------------------------------------------------------------------- apply_fsdp

#: The two shapes of model (:func:`~.ranks.seeded_model`), the world sizes (one multi-process
#: run: FSDP's first use costs seconds per process), and the training every rank does.
FSDP_KINDS, FSDP_WORLDS = ("blocks", "sequential"), (1, 2)
FSDP_STEPS, FSDP_PER_RANK, FSDP_OPTIMIZER = 2, 2, ("SGD", {"lr": 0.1, "momentum": 0.9})


def fsdp_each(student):
    """(seed, world, rank, kind index, kind, reply) of every rank and model of the one
    apply_fsdp run that all its checks share."""
    def run():
        _, seed = fresh_generator()
        limit = call_timeout(SPEC.check("apply_fsdp_each_block_and_the_root_its_own_unit"),
                             student.calibration)
        return seed, student.call(probe_apply_fsdp, FSDP_WORLDS, seed, FSDP_KINDS, FSDP_STEPS,
                                  FSDP_PER_RANK, FSDP_OPTIMIZER, timeout=limit)
    seed, runs = student.shared("fsdp", run)
    assert isinstance(runs, dict) and sorted(runs) == sorted(FSDP_WORLDS), \
        "the probe's reply was tampered with"
    for world in FSDP_WORLDS:
        assert isinstance(runs[world], list) and len(runs[world]) == world, \
            "the probe's reply was tampered with"
        for rank, replies in enumerate(runs[world]):
            assert isinstance(replies, list) and len(replies) == len(FSDP_KINDS), \
                "the probe's reply was tampered with"
            for i, (kind, reply) in enumerate(zip(FSDP_KINDS, replies)):
                yield seed, world, rank, i, kind, reply


def fsdp_where(world, rank, kind) -> str:
    model = ("a model with .blocks (an nn.ModuleList) and other submodules" if kind == "blocks"
             else "an nn.Sequential")
    return f"{world} rank(s), rank {rank}, apply_fsdp on {model}"
