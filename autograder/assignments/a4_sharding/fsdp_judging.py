"""How Assignment 4's apply_fsdp checks judge what the ranks of its runs saw (:mod:`.fsdp_ranks`):
FSDP's units, their mixed precision policies and resharding as FSDP2's own state has them, each
parameter's DTensor layout, and one forward and backward against the dense model in float64
within a tolerance derived from bf16 (:func:`~.expected.fsdp_case`); runs in the grader."""
from __future__ import annotations

from autograder.checking.expect import assert_close, sequence, tensor

from . import expected
from .runs import FSDP_PER_RANK, fsdp_each, fsdp_where

ASPECTS = ("units", "mixed precision", "resharding")


def _param_blocks(r):
    """(index, what FSDP's state says) of the blocks that hold parameters."""
    blocks = r["blocks"]
    assert isinstance(blocks, list) and all(isinstance(b, dict) for b in blocks), \
        "the probe's reply was tampered with"
    return [(j, b) for j, b in enumerate(blocks) if b.get("has_params") is True]


def judge_fsdp_units(student, aspect: str) -> None:
    """One of :data:`ASPECTS` on the 1-D runs: each block that holds parameters and the root
    are units managing exactly their own parameters; the root's and each block unit's policy
    computes in bf16 and reduces in fp32; each block unit but the last reshards after forward,
    the last does not: the last block that holds parameters, which in the nn.Sequential is not
    its last child (a block that is no unit: the units check says so)."""
    assert aspect in ASPECTS
    for seed, world, rank, i, kind, shape, r in fsdp_each(student, 1):
        where = fsdp_where(world, rank, kind, shape)
        blocks, root = _param_blocks(r), r["root"]
        if aspect == "units":
            assert r["returned_model"] is True, f"{where}: it should return the model it was given"
            skipped = [j for j, b in blocks if b.get("unit") is not True]
            assert not skipped, (f"{where}: block(s) {skipped} (of {len(r['blocks'])}) hold "
                                 "parameters but are not FSDP modules: each block is its own unit")
            assert root.get("unit") is True, f"{where}: the model itself is not an FSDP module"
            for j, b in blocks:
                assert b.get("owns") is True, (
                    f"{where}: block {j}'s unit manages {b.get('managed')} parameter(s), not "
                    f"exactly the block's {b.get('expected')}")
            assert root.get("owns") is True, (
                f"{where}: the root's unit manages {root.get('managed')} parameter(s), not exactly "
                f"the {root.get('expected')} outside the blocks")
        elif aspect == "mixed precision":
            units = [("the root", root)] + [(f"block {j}", b) for j, b in blocks]
            for name, u in units:
                if u.get("unit") is not True:
                    continue  # not a unit: the units check says so
                got = (u.get("param_dtype"), u.get("reduce_dtype"))
                assert got == ("bfloat16", "float32"), (
                    f"{where}: {name}'s MixedPrecisionPolicy has param_dtype={got[0]} and "
                    f"reduce_dtype={got[1]}; bfloat16 and float32 were asked for")
        else:
            children = len(r["blocks"])
            for n, (j, b) in enumerate(blocks):
                if b.get("unit") is not True:
                    continue
                last = n == len(blocks) - 1
                after = children - 1 - j
                which = ("not the last block" if not last else "the last block" if not after
                         else "the last block: the last that holds parameters; "
                         + ("the block after it holds none" if after == 1 else
                            f"the {after} blocks after it hold none"))
                assert b.get("reshard") is (not last), (
                    f"{where}: block {j} ({which}) has reshard_after_forward={b.get('reshard')}, "
                    f"expected {not last}")


def judge_fsdp_placements(student, dims: int) -> None:
    """Every parameter a DTensor on the mesh given, Shard(0) over the mesh (1-D) or
    (Replicate(), Shard(0)) over (replicate, shard) (2-D), holding its rank's rows of dim 0."""
    want_placements = [("Shard", 0)] if dims == 1 else [("Replicate", None), ("Shard", 0)]
    for seed, world, rank, i, kind, shape, r in fsdp_each(student, dims):
        where = fsdp_where(world, rank, kind, shape)
        shards = shape[-1]
        want = expected.fsdp_local_shapes(kind, shards, rank % shards)
        assert isinstance(r["params"], list) and len(r["params"]) == len(want), \
            f"{where}: the model has {len(r['params'])} parameters, {len(want)} were expected"
        for (name, local), p in zip(want, r["params"]):
            assert p["dtensor"] is True, f"{where}: parameter {name} is not a DTensor"
            assert p["on_mesh"] is True, f"{where}: parameter {name} is not on the mesh passed in"
            got = [tuple(x) for x in p["placements"]]
            assert got == want_placements, (
                f"{where}: parameter {name} has placements "
                f"{[f'{k}({d})' if d is not None else f'{k}()' for k, d in got]}, expected "
                f"{[f'{k}({d})' if d is not None else f'{k}()' for k, d in want_placements]}")
            assert p["local_shape"] == local, (
                f"{where}: parameter {name}'s local shard has shape {p['local_shape']}, expected "
                f"{local} (the rows of dim 0 of shard {rank % shards} of {shards})")


def judge_fsdp_numerics(student, dims: int) -> None:
    """Each rank's output and every parameter's full gradient after one forward and backward
    against the dense model in float64, within the tolerance derived from bf16."""
    wants = {}
    for seed, world, rank, i, kind, shape, r in fsdp_each(student, dims):
        where = fsdp_where(world, rank, kind, shape)
        if (world, i) not in wants:  # the same for every rank
            wants[world, i] = expected.fsdp_case(kind, seed + i, FSDP_PER_RANK, world)
        want = wants[world, i]
        how = ("vs the dense model in float64; the tolerance is twice how far the same "
               "computation in bf16 with fp32 reductions strays from it, plus one bf16 rounding")
        assert_close(tensor(r["output"], f"{where}: the output")["value"], want["outputs"][rank],
                     f"{where}: the output ({how})", rtol=0, atol=want["output_tol"], seed=seed)
        grads = sequence(r["grads"], f"{where}: the gradients", len(want["grads"]))
        for j, (d, w) in enumerate(zip(grads, want["grads"])):
            assert_close(tensor(d, f"{where}: parameter {j}'s gradient")["value"], w,
                         f"{where}: parameter {j}'s full gradient ({how})", rtol=0,
                         atol=want["grad_tol"], seed=seed)
