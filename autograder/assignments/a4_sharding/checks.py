"""Checks for Assignment 4: memory and sharding.

Graded functions (see the notebook for their specifications): ``assign_buckets``,
``shard_bounds``, ``model_state_bytes``, ``comm_bytes_per_step`` (called in the sandbox, on
fixed cases for every rule the text states and, hidden, on cases from the run's seed on top),
``BucketedDDP``, ``ShardedOptimizer`` and ``ShardedLinear`` (started on 1, 2 and 3 processes:
the cases and the shared runs are in ``runs.py``, run case by case by ``cases.py``, so that a
case that raises fails only the checks that grade it; what each rank runs is in ``ranks.py``
and ``ddp_ranks.py``; BucketedDDP's step time against the reference's: ``timing.py``), the byte
counts again against those runs (``traffic.py``), and ``apply_fsdp`` (FSDP2 on 1-D meshes of 1
and 2 processes and a 2-D mesh of 4: ``fsdp_ranks.py``, judged in ``fsdp_judging.py``).

The four functions whose values are graded have each a public check on fixed cases, whose
expected values are data (``public_cases.json``), and a hidden check on fresh random cases
against the answer key (``solutions/a4_sharding/answer_key.py``: the instructor's; without it
the hidden checks SKIP as reserved). Every other expectation is computed here, in the grader,
from the released contracts, independently of the functions students write (``expected.py``:
torch's chunks, torch's optimizers, dense float64 computations); BucketedDDP's all-reduces are
judged against the buckets of the ``assign_buckets`` the class runs with: the student's own, as
each class runs with the student's own helpers (:func:`.runs.ddp_bucket_plans`). The
collectives are logged by the grader's own hooks on the process group, and FSDP's units read
from its own state, never reported by the student. Points and call timeouts: ``spec.py``.
"""
from __future__ import annotations

import torch

from autograder.checking.expect import assert_close, sequence, tensor

from . import expected
from .judging import (judge_hidden_cases, judge_value_errors, judge_values, public_cases,
                      returned_values)
from .runs import (ALLOWED, DDP_LATE, DDP_MAIN, DDP_UNUSED, OPT_PER_RANK, OPT_STEPS,
                   assert_holds_its_shard, ddp_each, ddp_where, judge_ddp_all_reduces,
                   judge_ddp_grads, linear_each, optimizer_each, optimizer_where, shard_param)
from .spec import SPEC
from .timing import judge_step_time
from .fsdp_judging import judge_fsdp_numerics, judge_fsdp_placements, judge_fsdp_units
from .traffic import FP32_ELEMENT, RUN_ELEMENT, state_saved_by_sharding, traffic_of_runs

graded = SPEC.graded
ASSIGNMENT = SPEC.assignment


# ---------------------------------------------------------------------------- assign_buckets
# Each value check in two: the public fixed cases (their expected values are data,
# public_cases.json) and fresh random cases against the answer key (hidden: the instructor's).

@graded
def test_assign_buckets_reverse_order_and_size_rule(student):
    cases, want = public_cases("assign_buckets")
    judge_values(student, "assign_buckets", cases, want, None)


@graded
def test_assign_buckets_hidden_random_cases(student):
    judge_hidden_cases(student, "assign_buckets")


@graded
def test_assign_buckets_rejects_non_positive_bucket_bytes(student):
    judge_value_errors(student, "assign_buckets",
                        [(([1, 2], 0), {}), (([1, 2], -4), {}), (([], 0), {})])


# ---------------------------------------------------------------------------- shard_bounds

@graded
def test_shard_bounds_ceil_chunks_and_empty_shards(student):
    cases, want = public_cases("shard_bounds")
    judge_values(student, "shard_bounds", cases, [tuple(w) for w in want], None, pair=True)


@graded
def test_shard_bounds_hidden_random_cases(student):
    judge_hidden_cases(student, "shard_bounds", pair=True)


@graded
def test_shard_bounds_rejects_invalid_arguments(student):
    judge_value_errors(student, "shard_bounds", [((10, 0, 0), {}), ((10, -1, 0), {}),
                                                  ((10, 3, 3), {}), ((10, 3, -1), {}),
                                                  ((0, 1, 1), {})])


# ---------------------------------------------------------------------------- ZeRO's bytes

@graded
def test_model_state_bytes_every_stage_and_precision(student):
    cases, want = public_cases("model_state_bytes")
    judge_values(student, "model_state_bytes", cases, want, None)


@graded
def test_model_state_bytes_hidden_random_sizes(student):
    judge_hidden_cases(student, "model_state_bytes")


@graded
def test_model_state_bytes_rejects_invalid_arguments(student):
    judge_value_errors(student, "model_state_bytes", [
        ((10, 0), {"stage": 1, "mixed_precision": False}),
        ((10, -2), {"stage": 0, "mixed_precision": True}),
        ((10, 2), {"stage": 4, "mixed_precision": False}),
        ((10, 2), {"stage": -1, "mixed_precision": True})])


@graded
def test_comm_bytes_per_step_every_stage(student):
    cases, want = public_cases("comm_bytes_per_step")
    judge_values(student, "comm_bytes_per_step", cases, want, None)


@graded
def test_comm_bytes_per_step_hidden_random_sizes(student):
    judge_hidden_cases(student, "comm_bytes_per_step")


@graded
def test_comm_bytes_per_step_rejects_invalid_arguments(student):
    judge_value_errors(student, "comm_bytes_per_step", [
        ((10, 0), {"stage": 1}), ((10, -1), {"stage": 3}), ((10, 2), {"stage": 4}),
        ((10, 2), {"stage": -1, "element_size": 2})])


@graded
def test_sharded_optimizer_matches_one_process(student):
    firsts = {}
    for seed, world, rank, i, case, r in optimizer_each(student):
        kind, name, kwargs = case
        where = optimizer_where(world, rank, case)
        assert all(g is True for g in r["grads_none"]), \
            f"{where}: after step(), some param.grad is not None"
        want = expected.one_process(kind, seed + i, name, kwargs, OPT_STEPS, OPT_PER_RANK, world)
        params = sequence(r["params"], f"{where}: the parameters", len(want))
        got = [tensor(d, "parameter")["value"] for d in params]
        for j, (g, w) in enumerate(zip(got, want)):
            # float64 sums in another order stray by ~1e-16 relative; 1e-9 leaves room for
            # AdamW's division, and still catches any real difference (a missing mean: ~1e-1)
            assert_close(g, w, f"{where}: parameter {j} after {OPT_STEPS} steps (vs {name} in "
                         "one process on the full batches)", rtol=1e-9, atol=1e-12, seed=seed)
        first = firsts.setdefault((world, i), got)
        assert all(torch.equal(a, b) for a, b in zip(got, first)), \
            f"{where}: the parameters differ from rank 0's (they must be identical)"


@graded
def test_sharded_optimizer_state_bytes_per_rank(student):
    for seed, world, rank, i, case, r in optimizer_each(student):
        kind, name, kwargs = case
        where = optimizer_where(world, rank, case)
        assert r["is_optimizer"] is True, \
            f"{where}: .optimizer should be a torch.optim.{name}, got {r['optimizer']}"
        assert r["held"] == 1, \
            f"{where}: .optimizer holds {r['held']} parameters; one (the shard's) was expected"
        numel = sum(p.numel() for p in expected.seeded_model(kind, 0).parameters())
        start, end = assert_holds_its_shard(r["owned"], numel, world, rank, where,
                                            ".optimizer holds")
        want = expected.optimizer_state_of(name, kwargs, end - start)
        assert r["state_bytes"] == want, (
            f"{where}: .optimizer's state tensors hold {r['state_bytes']} bytes, expected {want} "
            f"({end - start} float64 element(s) of shard times the state per element: what "
            f"torch.optim.{name} keeps for a parameter of that size)")


@graded
def test_sharded_optimizer_one_reduce_scatter_one_all_gather_per_step(student):
    # counts are graded on 2 or more ranks only
    for seed, world, rank, i, case, r in optimizer_each(student, min_world=2):
        kind, name, kwargs = case
        where = optimizer_where(world, rank, case)
        numel = sum(p.numel() for p in expected.seeded_model(kind, 0).parameters())
        padded = world * -(-numel // world)
        for step, (log, counted) in enumerate(zip(r["sized"], r["counted"])):
            ops = sorted(op for op, _, _ in log)
            assert ops == ["ALLGATHER", "REDUCE_SCATTER"], (
                f"{where}, step {step + 1}: step() issued {ops or 'no collective'} on the default "
                "process group; expected exactly one reduce-scatter and one all-gather")
            rs = next(x for x in log if x[0] == "REDUCE_SCATTER")
            ag = next(x for x in log if x[0] == "ALLGATHER")
            assert rs[1] == padded and ag[2] == padded, (
                f"{where}, step {step + 1}: the reduce-scatter's input has {rs[1]} element(s) "
                f"and the all-gather's output {ag[2]}; both should be the padded flat buffer "
                f"({padded} = {world} x ceil({numel} / {world}))")
            other = sorted(k for k, v in counted.items() if v and not any(a in k for a in ALLOWED))
            assert not other, f"{where}, step {step + 1}: step() also called {', '.join(other)}"


@graded
def test_sharded_optimizer_parameters_view_one_padded_flat_buffer(student):
    for seed, world, rank, i, case, r in optimizer_each(student):
        where = optimizer_where(world, rank, case)
        numel = sum(p.numel() for p in expected.seeded_model(case[0], 0).parameters())
        padded = world * -(-numel // world)
        layout = r["layout"]
        assert layout["one_storage"] is True, \
            f"{where}: after construction the parameters do not all view one buffer"
        assert layout["in_order"] is True, (
            f"{where}: after construction the parameters are not contiguous views at consecutive "
            "offsets of the buffer, in the order given")
        assert layout["room"] >= padded, (
            f"{where}: the buffer the parameters view holds {layout['room']} element(s) from the "
            f"first parameter on; padded, it should hold {padded} = {world} x ceil({numel} / "
            f"{world})")


@graded
def test_bucketed_ddp_gradients_match_one_process(student):
    judge_ddp_grads(student, [DDP_MAIN])


@graded
def test_bucketed_ddp_unused_parameter_counts_as_zeros(student):
    judge_ddp_grads(student, [DDP_UNUSED])
    # every bucket all-reduced once, the unused parameter's by finish (its order: DDP_LATE's)
    judge_ddp_all_reduces(student, DDP_UNUSED, only=False, ordered=False)


@graded
def test_bucketed_ddp_one_all_reduce_per_bucket_in_bucket_order(student):
    judge_ddp_all_reduces(student, DDP_MAIN, only=True, ordered=True)


@graded
def test_bucketed_ddp_a_bucket_that_completes_early_waits_for_those_before_it(student):
    # bucket 0 completes last here; the buckets' sizes differ, so the order of the all-reduces'
    # sizes is the order the buckets were launched in
    judge_ddp_all_reduces(student, DDP_LATE, only=False, ordered=True)


@graded
def test_bucketed_ddp_first_all_reduce_before_parameter_0_gradient(student):
    # the case can show overlap: several buckets, parameter 0 in the last one (a test of the
    # grader's asserts it with the answer key)
    for seed, world, rank, i, step, reply, _ in ddp_each(student, [DDP_MAIN]):
        if world < 2:
            continue
        where = ddp_where(world, rank, i, step)
        kinds = [e[0] for e in reply["events"]]
        assert "grad of parameter 0" in kinds, \
            f"{where}: the gradient of parameter 0 was never computed"
        first = kinds.index("ALLREDUCE") if "ALLREDUCE" in kinds else len(kinds)
        assert first < kinds.index("grad of parameter 0"), (
            f"{where}: the first all-reduce was issued after the gradient of parameter 0 was "
            "computed: launch each bucket during backward, as soon as its gradients are in")


@graded
def test_bucketed_ddp_step_time_against_the_reference(student):
    judge_ddp_grads(student, [DDP_MAIN])  # a speed counts only for correct code
    judge_step_time(student)


@graded
def test_sharded_linear_outputs_and_gradients_match_dense(student):
    for seed, world, rank, case, r, want, where in linear_each(student):
        close = dict(rtol=1e-10, atol=1e-12, seed=seed)
        assert_close(tensor(r["output"], f"{where}: the output")["value"], want["outputs"][rank],
                     f"{where}: the output (vs nn.Linear with the same full values)", **close)
        if case[4]:
            assert_close(tensor(r["input_grad"], f"{where}: the input's gradient")["value"],
                         want["input_grads"][rank], f"{where}: the input's gradient", **close)
        grads = sequence(r["grads"], f"{where}: the parameters' gradients")
        assert len(grads) == 1, f"{where}: the layer should have one parameter (its shard)"
        assert_close(tensor(grads[0], f"{where}: the shard's gradient")["value"],
                     want["grads"][rank], f"{where}: the shard's gradient (vs the slice of the "
                     "mean over ranks of the dense gradients)", **close)


@graded
def test_sharded_linear_stores_its_shard_initialised_like_nn_linear(student):
    for seed, world, rank, case, r, want, where in linear_each(student):
        initial = shard_param(r, where, "initial")
        assert_holds_its_shard(initial.numel(), want["numel"], world, rank, where,
                               "the layer stores")
        assert torch.equal(initial.reshape(-1), want["initial"][rank]), (
            f"{where}: the initial shard differs from the slice of nn.Linear({case[0]}, "
            f"{case[1]}, bias={case[2]}) under the same random state (seed {seed})")


@graded
def test_sharded_linear_two_all_gathers_one_reduce_scatter(student):
    # counts are graded on 2 or more ranks only
    for seed, world, rank, case, r, want, where in linear_each(student, min_world=2):
        padded = world * -(-want["numel"] // world)
        ops = sorted((op, i if op == "REDUCE_SCATTER" else o) for op, i, o in r["sized"])
        expect = [("ALLGATHER", padded), ("ALLGATHER", padded), ("REDUCE_SCATTER", padded)]
        assert ops == expect, (
            f"{where}: forward and backward issued {ops or 'no collective'} (op, elements of the "
            f"padded vector) on the default process group; expected {expect}")


@graded
def test_sharded_linear_keeps_no_full_weight_between_forward_and_backward(student):
    # on one rank the shard is the whole layer
    for seed, world, rank, case, r, want, where in linear_each(student, min_world=2):
        limit = want["weight_numel"]
        saved = [n for n in r["saved"] if n >= limit]
        assert not saved, (f"{where}: forward saved for backward a tensor of {max(saved)} "
                           f"elements, as large as the full weight ({limit}): free it and "
                           "gather it again in backward")
        assert r["alive"] < limit, (
            f"{where}: after forward a tensor of {r['alive']} elements (as large as the full "
            f"weight, {limit}) is still alive: free the gathered vector after use")


# ---------------------------------------------------------------------------- the byte counts
# against the runs above (after them in this file: they reuse those runs)

@graded
def test_model_state_bytes_matches_the_optimizer_state_of_real_runs(student):
    seed, saved = state_saved_by_sharding(student)
    cases = [((p, n), {"stage": s, "mixed_precision": False}) for p, n in saved for s in (0, 1)]
    values = iter(returned_values(student, "model_state_bytes", cases))
    for (p, n), (one, each, source) in saved.items():
        (call0, _, stage0), (call1, _, stage1) = next(values), next(values)
        want = (one - each) * FP32_ELEMENT // RUN_ELEMENT
        assert stage0 - stage1 == want, (
            f"{call0} - {call1} = {stage0 - stage1!r}, what ZeRO stage 1 saves per rank in your "
            f"accounting (fp32 Adam state); expected {want}: {source}, so sharding saved "
            f"{one - each} bytes of float64 moments, {want} in fp32")


@graded
def test_comm_bytes_per_step_matches_the_traffic_of_real_runs(student):
    seed, sent = traffic_of_runs(student)
    cases = [((p, n), {"stage": s, "element_size": RUN_ELEMENT}) for p, n, s in sent]
    judge_values(student, "comm_bytes_per_step", cases, [b for b, _ in sent.values()], seed,
                 why=[source for _, source in sent.values()])


# ---------------------------------------------------------------------------- apply_fsdp
# (what each judges: fsdp_checks.py)

@graded
def test_apply_fsdp_each_block_and_the_root_its_own_unit(student):
    judge_fsdp_units(student, "units")


@graded
def test_apply_fsdp_bf16_parameters_fp32_reductions(student):
    judge_fsdp_units(student, "mixed precision")


@graded
def test_apply_fsdp_last_block_keeps_its_parameters_after_forward(student):
    judge_fsdp_units(student, "resharding")


@graded
def test_apply_fsdp_shards_dim_0_and_matches_the_dense_model(student):
    judge_fsdp_placements(student, 1)
    judge_fsdp_numerics(student, 1)


@graded
def test_apply_fsdp_hsdp_on_a_2d_mesh(student):
    judge_fsdp_placements(student, 2)
    judge_fsdp_numerics(student, 2)
