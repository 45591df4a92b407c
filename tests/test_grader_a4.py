"""Assignment 4 through the CLI: the reference scores full, the stubs zero, each planted bug
loses points of the function it breaks and of no other.

Grading runs start processes (every rank imports torch), so the bugs in the four functions
that run in the sandbox itself, and one in ``apply_fsdp``, are planted together in one run;
``BucketedDDP`` and ``ShardedOptimizer`` keep their full points there although
``assign_buckets`` and ``shard_bounds`` are broken, because the grader runs them with the
reference's versions. The classes' own bugs (and two more in ``apply_fsdp``) are graded with
``--only``, one bug per function in each of two runs, beside the byte counts, which keep their
points. A correct but slow ``BucketedDDP`` loses its speed check only (or none, where the
machine cannot show the reference's speedup).
"""
from __future__ import annotations

import resource
import time

import nbformat
import pytest

from autograder.checking.spec import functions_of, load_spec
from conftest import (REPO, assert_full_marks, assert_stubs_score_zero, grade, plant_bugs,
                      points_by_function)

SOURCE = REPO / "solutions" / "a4_sharding" / "sharding.ipynb"
RELEASE = REPO / "assignments" / "a4_sharding" / "sharding.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it); each fails its
# function's value check (its ValueError check still passes: that part is not broken), and the
# byte counts' bugs their comparison with the classes' runs as well
LEAF_BUGS = {
    # buckets filled in forward order: the first bucket waits for the last gradient
    "assign_buckets": ("for index in reversed(range(len(param_numels))):",
                       "for index in range(len(param_numels)):"),
    # floor instead of ceil: the last elements belong to nobody
    "shard_bounds": ("chunk = (numel + world_size - 1) // world_size",
                     "chunk = numel // world_size"),
    # stage 1 does not shard the optimizer state (only stage 2 does)
    "model_state_bytes": ("state_bytes * (shard if stage >= 1 else num_params)",
                          "state_bytes * (shard if stage >= 2 else num_params)"),
    # stage 2 counted as if it all-gathered parameters in backward as well
    "comm_bytes_per_step": ("k = 3 if stage == 3 else 2", "k = 3 if stage >= 2 else 2"),
    # fully_shard on the root only: one FSDP unit, the blocks are not their own
    "apply_fsdp": ("    for block in blocks:\n        fully_shard(block, mesh=mesh)\n", ""),
}
# The classes' bugs, two runs with one bug in each class: (function, bug, the checks it fails)
CLASS_BUG_RUNS = {
    "no_mean_and_no_overlap": [
        ("ShardedOptimizer", ("        shard_grad /= self.world_size\n", ""),
         "sharded_optimizer_matches_one_process"),
        # every bucket waits for finish_gradient_synchronization(): correct, but no overlap
        ("BucketedDDP", ("        while len(self.launched) < len(self.buckets) and "
                         "self.waiting[len(self.launched)] == 0:\n"
                         "            self._launch(len(self.launched))\n\n    def _launch",
                         "        pass\n\n    def _launch"),
         "bucketed_ddp_first_all_reduce_before_parameter_0_gradient"),
        # the gathered vector kept on the layer: alive between forward and backward
        ("ShardedLinear", ("        dist.all_gather_single(full, send)\n",
                           "        dist.all_gather_single(full, send)\n        self._kept = full\n"),
         "sharded_linear_keeps_no_full_weight_between_forward_and_backward"),
        # the blocks sharded, the root forgotten
        ("apply_fsdp", ("    fully_shard(model, mesh=mesh)\n    return model\n",
                        "    return model\n"),
         "apply_fsdp_each_block_and_the_root_its_own_unit")],
    "all_reduce_and_no_mean": [
        ("ShardedOptimizer", ("        dist.reduce_scatter_single(shard_grad, flat_grad)\n",
                              "        dist.all_reduce(flat_grad)\n"
                              "        shard_grad.copy_(flat_grad[self.rank * self.chunk:"
                              "(self.rank + 1) * self.chunk])\n"),
         "sharded_optimizer_one_reduce_scatter_one_all_gather_per_step"),
        ("BucketedDDP", ("            flat /= world_size\n", ""),
         "bucketed_ddp_gradients_match_one_process"),
        # the gathered weight saved for backward instead of gathered again
        ("ShardedLinear", ("        ctx.save_for_backward(x)\n        return F.linear(x, weight, bias)\n"
                           "\n    @staticmethod\n    def backward(ctx, grad_out):\n"
                           "        (x,) = ctx.saved_tensors\n        layer = ctx.layer\n"
                           "        weight, _ = layer.gather()\n",
                           "        ctx.save_for_backward(x, weight)\n"
                           "        return F.linear(x, weight, bias)\n"
                           "\n    @staticmethod\n    def backward(ctx, grad_out):\n"
                           "        x, weight = ctx.saved_tensors\n        layer = ctx.layer\n"),
         "sharded_linear_keeps_no_full_weight_between_forward_and_backward"),
        # the first block skipped: its parameters go to the root's unit
        ("apply_fsdp", ("    for block in blocks:\n", "    for block in list(blocks)[1:]:\n"),
         "apply_fsdp_each_block_and_the_root_its_own_unit")],
}


def with_bugs(tmp_path, bugs: dict, name: str = "submission"):
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4), bugs), path)
    return path


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    """Every check, the speed check included (it passes against itself, or SKIPs where the
    machine cannot show the reference's speedup); the cost of the whole grading is bounded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert_full_marks(report)
    print(report["stdout"])
    print(f"graded in {seconds:.1f} s, {cpu:.1f} CPU seconds")
    assert seconds < 300, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, env=offline_env)
    assert_stubs_score_zero(report)


@pytest.mark.slow
def test_planted_bugs_in_the_sandboxed_functions_lose_their_points_and_no_other(offline_env,
                                                                               tmp_path):
    report = grade(with_bugs(tmp_path, LEAF_BUGS), "--speed", "skip", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    got = points_by_function(report)
    assert got.keys() == functions_of("a4_sharding").keys()
    full = {f: sum(r["max_points"] for r in report["results"]  # the speed check is not run
                   if r["function"] == f and r["status"] != "skipped") for f in got}
    values_check = {"assign_buckets": "assign_buckets_reverse_order_and_size_rule",
                    "shard_bounds": "shard_bounds_ceil_chunks_and_empty_shards",
                    "model_state_bytes": "model_state_bytes_every_stage_and_precision",
                    "comm_bytes_per_step": "comm_bytes_per_step_every_stage",
                    "apply_fsdp": "apply_fsdp_each_block_and_the_root_its_own_unit"}
    status = {r["name"]: r for r in report["results"]}
    for function in full:
        if function in LEAF_BUGS:
            failed = status[values_check[function]]
            assert failed["status"] == "failed" and failed["message"], failed
            assert got[function] < full[function], report["stdout"]
        else:  # BucketedDDP and ShardedOptimizer run with the reference's helpers
            assert got[function] == full[function], (function, report["stdout"])
    for check in ("model_state_bytes_matches_the_optimizer_state_of_real_runs",
                  "comm_bytes_per_step_matches_the_traffic_of_real_runs"):
        assert status[check]["status"] == "failed" and status[check]["message"], status[check]


@pytest.mark.slow
def test_a_zero_size_parameter_joining_an_oversized_bucket_loses_assign_buckets_points(
        offline_env, tmp_path):
    """The corner the text settles: after a parameter larger than bucket_bytes, a zero-size
    parameter starts a new bucket (the if-and-only-if rule); joining the current bucket, the
    reading the text once also allowed, fails the values check (fixed cases: every seed)."""
    bug = ("if current and current_bytes + size > bucket_bytes:",
           "if current and size and current_bytes + size > bucket_bytes:")
    report = grade(with_bugs(tmp_path, {"assign_buckets": bug}, "zero_joins"),
                   "--only", "assign_buckets", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    status = {r["name"]: r for r in report["results"]}
    assert set(status) == {c.name for c in load_spec("a4_sharding").checks
                           if c.function == "assign_buckets"}
    failed = status["assign_buckets_reverse_order_and_size_rule"]
    assert failed["status"] == "failed" and "assign_buckets([" in failed["message"], failed
    assert status["assign_buckets_rejects_non_positive_bucket_bytes"]["status"] == "passed"


#: Graded beside the classes' bugs: compared with the classes' runs, they lose nothing to them
#: (where a run breaks the contract, the contract's bytes stand in for it).
BYTE_COUNTS = ("model_state_bytes", "comm_bytes_per_step")


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(CLASS_BUG_RUNS))
def test_bugs_in_the_classes_fail_their_checks(run, offline_env, tmp_path):
    bugs = CLASS_BUG_RUNS[run]
    report = grade(with_bugs(tmp_path, {f: bug for f, bug, _ in bugs}, run),
                   "--only", ",".join([f for f, _, _ in bugs] + list(BYTE_COUNTS)),
                   "--speed", "skip", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == {f for f, _, _ in bugs} | set(BYTE_COUNTS)
    status = {r["name"]: r["status"] for r in report["results"]}
    full, got = functions_of("a4_sharding"), points_by_function(report)
    for function, _, check in bugs:
        assert status[check] == "failed", report["stdout"]
        assert got[function] < full[function], report["stdout"]
    assert all(r["message"] for r in report["results"] if r["status"] == "failed")
    bystanders = [r for r in report["results"] if r["function"] in BYTE_COUNTS]
    assert bystanders and all(r["status"] == "passed" for r in bystanders), report["stdout"]


# Correct but slow: each bucket's gradients copied into the flat vector one element at a time
# (thousands of tiny operations, each paying torch's dispatch latency), nothing else changed.
SLOW_BUCKETS = ("        self.launched.append((flat, dist.all_reduce(flat, async_op=True)))\n",
                "        flat = torch.stack([x.clone() for x in flat])  # one element at a time\n"
                "        self.launched.append((flat, dist.all_reduce(flat, async_op=True)))\n")


@pytest.mark.slow
def test_correct_but_slow_buckets_lose_only_the_speed_check(offline_env, tmp_path):
    """Every correctness check of BucketedDDP passes; the speed check fails (where this machine
    can show the reference's speedup over one all-reduce per parameter, else it SKIPs with that
    reason), so the slow code loses exactly the speed check's points or none."""
    report = grade(with_bugs(tmp_path, {"BucketedDDP": SLOW_BUCKETS}, "slow_buckets"),
                   "--only", "BucketedDDP", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    speed = {c.name for c in load_spec("a4_sharding").checks if c.speed}
    status = {r["name"]: r for r in report["results"]}
    assert speed and speed < set(status), report["stdout"]
    for name, r in status.items():
        if name not in speed:
            assert r["status"] == "passed", report["stdout"]
            continue
        assert r["status"] in ("failed", "skipped") and r["message"], r
        if r["status"] == "failed":
            assert "reference solution reached" in r["message"], r
        else:
            assert "even the reference solution reached only" in r["message"], r
    print(report["stdout"])


def test_handed_over_results_survive_a_rank_that_aborts_at_exit():
    """A rank that aborts after its work (as gloo sometimes does at process exit) costs
    nothing: the results saved before teardown are the run's results; a rank that aborts
    before its result is saved still fails the run."""
    from autograder.assignments.a4_sharding.ranks import run_ranks_keeping_results
    from autograder.checking.ranks import run_ranks

    def abort_at_teardown(rank, world_size):
        import os

        import torch.distributed as dist

        if rank == 1:  # the launcher's goodbye barrier is where this rank dies
            dist.barrier = lambda *args, **kwargs: os.abort()
        return {"rank": rank}

    def abort_before_returning(rank, world_size):
        import os

        if rank == 1:
            os.abort()
        return {"rank": rank}

    with pytest.raises(RuntimeError):  # what the guard is for: the plain run fails
        run_ranks(abort_at_teardown, 2)
    assert run_ranks_keeping_results(abort_at_teardown, 2) == [{"rank": 0}, {"rank": 1}]
    with pytest.raises(RuntimeError):
        run_ranks_keeping_results(abort_before_returning, 2)
