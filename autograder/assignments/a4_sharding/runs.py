"""Assignment 4's classes in the grader: the cases of the multi-process runs that each class's
checks share (one run per world size, :func:`~.judging.runs_per_world_size`, case by case:
:mod:`.cases`), and walks over what every rank of those runs replied, next to what it should be
(:mod:`.expected`; BucketedDDP's buckets: :func:`ddp_bucket_plans`). A walk asks for the
cases its check grades; a case that raised fails the walk with that case's error, and no other
case's."""
from __future__ import annotations

import torch

from autograder.checking.expect import assert_close, sequence, tensor

from . import expected
from .ddp_ranks import ddp_model
from .judging import plain, runs_per_world_size
from .probes import (probe_apply_fsdp, probe_bucketed_ddp, probe_helper_values,
                     probe_sharded_linear, probe_sharded_optimizer)

TAMPERED = "the probe's reply was tampered with"


def case_ranks(outcomes, n_cases: int, index: int, world: int, where: str):
    """Every rank's reply to case ``index`` of a run on ``world`` ranks; an AssertionError with
    the case's error where it raised (or the run stopped in it)."""
    assert isinstance(outcomes, list) and len(outcomes) == n_cases, TAMPERED
    outcome = outcomes[index]
    assert isinstance(outcome, dict), TAMPERED
    if "error" in outcome:
        raise AssertionError(f"{where}: {outcome['error']}\n(this case fails the checks that "
                             "grade it; the other cases are graded on their own)")
    ranks = outcome.get("ranks")
    assert isinstance(ranks, list) and len(ranks) == world, TAMPERED
    return ranks


def _walk(runs: dict, cases, indices, min_world: int, where, skip_failed: bool):
    """(world, case index, rank, reply) of the ``indices`` cases on ``min_world`` or more
    ranks; ``where(world, rank, index)`` names them in messages."""
    for world, outcomes in runs.items():
        if world < min_world:
            continue
        for i in indices:
            try:
                ranks = case_ranks(outcomes, len(cases), i, world, where(world, None, i))
            except AssertionError:
                if skip_failed:
                    continue
                raise
            for rank, reply in enumerate(ranks):
                yield world, i, rank, reply


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


def optimizer_each(student, min_world: int = 1, skip_failed: bool = False):
    """(seed, world size, rank, case index, case, reply) of every rank of every case run on
    ``min_world`` or more ranks."""
    seed, runs = runs_per_world_size(student, "opt", "sharded_optimizer_matches_one_process",
                                     probe_sharded_optimizer, OPT_CASES, OPT_STEPS,
                                     OPT_PER_RANK)
    for world, i, rank, reply in _walk(runs, OPT_CASES, range(len(OPT_CASES)), min_world,
                                       lambda w, r, i: optimizer_where(w, r, OPT_CASES[i]),
                                       skip_failed):
        yield seed, world, rank, i, OPT_CASES[i], reply


def optimizer_where(world, rank, case) -> str:
    kind, name, kwargs = case
    who = "" if rank is None else f", rank {rank}"
    return f"{world} rank(s){who}, {name}({kwargs}) on the {kind} model"


# ---------------------------------------------------------------------------- BucketedDDP

#: (model shape (width, depth, an unused parameter, a layer registered last but used first),
#: bucket bytes), float64: the main case (several buckets, parameter 0 in the last one); an
#: unused parameter (index 2); buckets that complete out of bucket order (bucket 0 holds the
#: layer used first, whose gradients come last; buckets of 24, 36 and 20 elements, so that the
#: order of the all-reduces names the buckets).
DDP_CASES = [((6, 4, False, False), 400), ((5, 3, True, False), 256),
             ((4, 3, False, True), 288)]
DDP_MAIN, DDP_UNUSED, DDP_LATE = 0, 1, 2
DDP_NAMES = ("the main model", "the model with an unused parameter",
             "the model whose first layer is registered last")
DDP_STEPS, DDP_PER_RANK, DDP_LR = 3, 2, 0.1


def ddp_numels(case: int) -> list[int]:
    """The elements of each managed parameter of a case's model (its shape alone sets them)."""
    shape, _ = DDP_CASES[case]
    return [p.numel() for p in ddp_model(0, shape).parameters() if p.requires_grad]


def ddp_bucket_plans(student) -> list[list[tuple[list[int], int]]]:
    """Each case's buckets as (indices, elements), in bucket order: what ``assign_buckets``
    gives for the case's float64 parameters and bucket bytes, as the text has the class build
    them ("the buckets come from your assign_buckets"): those of the ``assign_buckets`` the
    class runs with (the student's own, with the key or without), asked in the sandbox, so that
    the class is judged against the buckets it was given (and assign_buckets by its own
    checks)."""
    calls = [(ddp_numels(i), bucket_bytes, 8) for i, (_, bucket_bytes) in enumerate(DDP_CASES)]

    def run():
        replies = student.call(probe_helper_values, "BucketedDDP", "assign_buckets",
                               [(args, {}) for args in calls])
        assert isinstance(replies, list) and len(replies) == len(calls), TAMPERED
        return [plain(r, f"assign_buckets{args}, whose buckets BucketedDDP is judged "
                         "against,") for r, args in zip(replies, calls)]
    plans = student.shared("ddp-buckets", run)
    out = []
    for args, plan in zip(calls, plans):
        numels = args[0]
        assert isinstance(plan, list) and all(isinstance(b, list) for b in plan) and sorted(
            j for b in plan for j in b) == list(range(len(numels))), (
            f"assign_buckets{args} returned {plan}, which does not hold each parameter's index "
            "once; BucketedDDP's all-reduces are judged against the buckets it returns")
        out.append([(b, sum(numels[j] for j in b)) for b in plan])
    return out


def ddp_each(student, cases):
    """(seed, world, rank, case index, step, that step's reply, expected gradients)."""
    seed, runs = runs_per_world_size(student, "ddp", "bucketed_ddp_gradients_match_one_process",
                                     probe_bucketed_ddp, DDP_CASES, DDP_STEPS, DDP_PER_RANK,
                                     DDP_LR)
    wants = {}
    for world, i, rank, replies in _walk(runs, DDP_CASES, cases, 1, ddp_where, False):
        if (world, i) not in wants:
            wants[world, i], _ = expected.one_process_ddp(seed + 101 * i, DDP_CASES[i][0],
                                                          DDP_STEPS, DDP_PER_RANK, world, DDP_LR)
        assert isinstance(replies, list) and len(replies) == DDP_STEPS, TAMPERED
        for step, reply in enumerate(replies):
            yield seed, world, rank, i, step, reply, wants[world, i][step]


def ddp_where(world, rank, case, step=None) -> str:
    who = "" if rank is None else f", rank {rank}"
    when = "" if step is None else f", step {step + 1}"
    return f"{world} rank(s){who}, {DDP_NAMES[case]}{when}"


def judge_ddp_grads(student, cases):
    for seed, world, rank, i, step, reply, want in ddp_each(student, cases):
        where = ddp_where(world, rank, i, step)
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


def judge_ddp_all_reduces(student, case: int, *, only: bool, ordered: bool):
    """On 2 or more ranks, per step, from forward to the end of finish: one all-reduce per
    bucket, of its elements, in bucket order (``ordered``) or in any order; with ``only``, no
    other collective either (the main model's check: the other cases judge their own rule)."""
    plans = None
    for seed, world, rank, i, step, reply, _ in ddp_each(student, [case]):
        if world < 2:
            continue  # counts are graded on 2 or more ranks only
        if plans is None:  # after the run: a class that raises fails with its own error
            plans = ddp_bucket_plans(student)
        buckets = plans[i]
        where = ddp_where(world, rank, i, step)
        got = [(e[0], e[1]) for e in reply["events"] if len(e) == 3]
        if not only:
            got = [e for e in got if e[0] == "ALLREDUCE"]
        want = [("ALLREDUCE", n) for _, n in buckets]
        what = ("per bucket, in bucket order," if ordered else "per bucket") + \
            " of each bucket's elements"
        if only:
            what += ", and no other collective (buffers are broadcast at construction only)"
        assert (got if ordered else sorted(got)) == (want if ordered else sorted(want)), (
            f"{where}: forward, backward and finish_gradient_synchronization() issued "
            f"{got or 'no collective'} on the default process group; expected one all-reduce "
            f"{what}: {want} (buckets {[b for b, _ in buckets]})")
        if only:
            other = sorted(k for k, v in reply["counted"].items()
                           if v and "all_reduce" not in k and "ALLREDUCE" not in k)
            assert not other, f"{where}: it also called {', '.join(other)}"


# ---------------------------------------------------------------------------- ShardedLinear

#: (in, out, bias, batch, input needs grad): features not divisible by 2 or 3, no bias, an
#: input without gradient; every input and output holds fewer elements than the weight. The
#: layers' elements (40, 24, 18): 24 and 18 are divisible by 2 and 3 (no padding: the byte
#: counts are compared with these runs, :mod:`.traffic`), 40 by 2 only.
LINEAR_CASES = [(7, 5, True, 3, True), (6, 4, False, 2, False), (5, 3, True, 2, True)]


def linear_each(student, min_world: int = 1, skip_failed: bool = False):
    """(seed, world, rank, case, reply, what every rank must see, where: for messages) of every
    rank and case of the runs on ``min_world`` or more ranks."""
    seed, runs = runs_per_world_size(student, "linear",
                                     "sharded_linear_outputs_and_gradients_match_dense",
                                     probe_sharded_linear, LINEAR_CASES)
    wants = {}
    for world, i, rank, reply in _walk(runs, LINEAR_CASES, range(len(LINEAR_CASES)), min_world,
                                       lambda w, r, i: linear_where(w, r, LINEAR_CASES[i]),
                                       skip_failed):
        case = LINEAR_CASES[i]
        if (world, i) not in wants:
            wants[world, i] = expected.linear_case(seed + i, case, world)
        yield seed, world, rank, case, reply, wants[world, i], linear_where(world, rank, case)


def assert_holds_its_shard(count: int, numel: int, world: int, rank: int, where: str,
                           holder: str) -> tuple[int, int]:
    """Assert that ``holder`` (".optimizer holds", "the layer stores") has exactly rank
    ``rank``'s share of ``numel`` elements over ``world`` ranks; return that share's bounds."""
    start, end = expected.chunk_bounds(numel, world)[rank]
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
    who = "" if rank is None else f", rank {rank}"
    return (f"{world} rank(s){who}, ShardedLinear({in_f}, {out_f}, bias={bias}) on "
            f"{batch} inputs{'' if needs else ' that need no gradient'}")


# ---------------------------------------------------------------------------- apply_fsdp

#: Each world size's cases (model kind, mesh shape): 1-D meshes on 1 and 2 ranks; a 2-D
#: (replicate, shard) mesh of 2 x 2 on 4 ranks (HSDP); rows of the batch per rank.
FSDP_CASES = {1: [("blocks", (1,)), ("sequential", (1,))],
              2: [("blocks", (2,)), ("sequential", (2,))],
              4: [("blocks", (2, 2)), ("sequential", (2, 2))]}
FSDP_PER_RANK = 2


def fsdp_each(student, dims: int):
    """(seed, world, rank, case index, kind, mesh shape, reply) of every rank and case of the
    runs on ``dims``-D meshes (1-D: one shared run on 1 and 2 ranks; 2-D: one on 4)."""
    worlds = tuple(w for w, cases in FSDP_CASES.items() if len(cases[0][1]) == dims)
    owner = ("apply_fsdp_each_block_and_the_root_its_own_unit" if dims == 1
             else "apply_fsdp_hsdp_on_a_2d_mesh")
    seed, runs = runs_per_world_size(student, f"fsdp-{dims}d", owner, probe_apply_fsdp,
                                     FSDP_CASES, FSDP_PER_RANK, worlds=worlds)
    for world in worlds:
        cases = FSDP_CASES[world]
        for i, (kind, shape) in enumerate(cases):
            where = fsdp_where(world, None, kind, shape)
            for rank, reply in enumerate(case_ranks(runs[world], len(cases), i, world, where)):
                assert isinstance(reply, dict), TAMPERED
                yield seed, world, rank, i, kind, shape, reply


def fsdp_where(world, rank, kind, shape) -> str:
    model = ("a model with .blocks (an nn.ModuleList) and other submodules" if kind == "blocks"
             else "an nn.Sequential")
    who = "" if rank is None else f", rank {rank}"
    mesh = " x ".join(map(str, shape))
    return f"{world} rank(s){who}, a {len(shape)}-D mesh of {mesh}, apply_fsdp on {model}"
