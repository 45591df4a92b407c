"""Assignment 4 through the CLI: the reference scores full, the stubs zero, each planted bug
loses points of the function it breaks and of no other, and the checks it fails are those of
the rule it breaks (a case that raises costs the checks of that case only).

Grading runs start processes (every rank imports torch), so the bugs in the four functions
that run in the sandbox itself, and one in ``apply_fsdp``, are planted together in one run;
the classes run with the submission's own ``assign_buckets`` and ``shard_bounds`` (as in the
student's self-check), so those two bugs also fail the classes' checks that they break, and
only those (:data:`HELPER_BUGS_FAIL`). The classes' own bugs (and more in ``apply_fsdp``) are graded with
``--only``, at most one bug per function in each run, beside the byte counts, which keep their
points; each names the one check it must fail, and every other check of the run passes. A
correct but slow ``BucketedDDP`` loses its speed check only (or none, where the machine cannot
show the reference's speedup); correct variants the text allows keep every point.

Answer key (``solutions/a4_sharding/answer_key.py``): each value check of the four plain
functions is split into a public check on fixed cases (their expected values are data,
``public_cases.json``, written from the key: a test keeps the two equal) and a hidden check on
fresh random cases against the key. Without the key (``AUTOGRADER_ANSWER_KEY=absent``, the
student's view) the reference earns every public point and the hidden checks are reserved; the
grader's own expectations for the classes (torch's chunks, torch's optimizers' state, the
buckets) agree with the key (unit tests below, no grading).

Tier: both: reference full marks, the reference without the key and stub zero are quick (one
grading each), the key's unit tests too; planted bugs are full.
"""
from __future__ import annotations

import json
import resource
import time

import nbformat
import pytest

from autograder.checking.spec import functions_of, load_spec
from autograder.keys import WITHOUT_KEY_ENV, answer_key, is_reserved
from conftest import (REPO, assert_full_marks, assert_public_points_without_the_key,
                      assert_stubs_score_zero, grade, plant_bugs, points_by_function)

SOURCE = REPO / "solutions" / "a4_sharding" / "sharding.ipynb"
RELEASE = REPO / "assignments" / "a4_sharding" / "sharding.ipynb"
SPEC = load_spec("a4_sharding")
#: The hidden checks: fresh random cases against the answer key, one per plain function.
HIDDEN = {"assign_buckets_hidden_random_cases", "shard_bounds_hidden_random_cases",
          "model_state_bytes_hidden_random_sizes", "comm_bytes_per_step_hidden_random_sizes"}

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
    # stages 1 and 2 counted without the all-gather of the updated parameters
    "comm_bytes_per_step": ("k = 3 if stage == 3 else 2", "k = {0: 2, 3: 3}.get(stage, 1)"),
    # fully_shard on the root only: one FSDP unit, the blocks are not their own
    "apply_fsdp": ("        fully_shard(block, mesh=mesh, mp_policy=policy,\n"
                   "                    reshard_after_forward=block is not holding[-1])\n",
                   "        pass\n"),
}
#: The classes' checks that LEAF_BUGS' helpers break: the classes run with the submission's own
#: assign_buckets and shard_bounds (each confirmed by a grading with that helper's bug alone)
HELPER_BUGS_FAIL = {
    # forward-order buckets: parameter 0 is in bucket 0, whose gradients come last
    "BucketedDDP": {"bucketed_ddp_first_all_reduce_before_parameter_0_gradient"},
    # floor chunks: each rank's shard misses elements, so the steps and the state are wrong
    "ShardedOptimizer": {"sharded_optimizer_matches_one_process",
                         "sharded_optimizer_state_bytes_per_rank"},
    "ShardedLinear": {"sharded_linear_outputs_and_gradients_match_dense",
                      "sharded_linear_stores_its_shard_initialised_like_nn_linear"},
}
# The classes' bugs, runs with at most one bug in each class: (function, bug, the checks it fails:
# those of the rules it breaks); a bug is one (old, new) or a list of them, applied in turn
CLASS_BUG_RUNS = {
    "no_mean_and_no_overlap": [
        ("ShardedOptimizer", ("        shard_grad /= self.world_size\n", ""),
         ("sharded_optimizer_matches_one_process",)),
        # every bucket waits for finish_gradient_synchronization(): correct, but no overlap
        ("BucketedDDP", ("        while len(self.launched) < len(self.buckets) and "
                         "self.waiting[len(self.launched)] == 0:\n"
                         "            self._launch(len(self.launched))\n\n    def _launch",
                         "        pass\n\n    def _launch"),
         ("bucketed_ddp_first_all_reduce_before_parameter_0_gradient",)),
        # the gathered vector kept on the layer: alive between forward and backward
        ("ShardedLinear", ("        dist.all_gather_single(full, send)\n",
                           "        dist.all_gather_single(full, send)\n        self._kept = full\n"),
         ("sharded_linear_keeps_no_full_weight_between_forward_and_backward",)),
        # the blocks sharded, the root forgotten: its own parameters are not sharded either
        ("apply_fsdp", ("    fully_shard(model, mesh=mesh, mp_policy=policy)\n    return model\n",
                        "    return model\n"),
         ("apply_fsdp_each_block_and_the_root_its_own_unit",
          "apply_fsdp_shards_dim_0_and_matches_the_dense_model", "apply_fsdp_hsdp_on_a_2d_mesh"))],
    "all_reduce_and_no_mean": [
        ("ShardedOptimizer", ("        dist.reduce_scatter_single(shard_grad, flat_grad)\n",
                              "        dist.all_reduce(flat_grad)\n"
                              "        shard_grad.copy_(flat_grad[self.rank * self.chunk:"
                              "(self.rank + 1) * self.chunk])\n"),
         ("sharded_optimizer_one_reduce_scatter_one_all_gather_per_step",)),
        # every model's gradients wrong
        ("BucketedDDP", ("            flat /= world_size\n", ""),
         ("bucketed_ddp_gradients_match_one_process",
          "bucketed_ddp_unused_parameter_counts_as_zeros")),
        # the gathered weight saved for backward instead of gathered again
        ("ShardedLinear", ("        ctx.save_for_backward(x)\n        return F.linear(x, weight, bias)\n"
                           "\n    @staticmethod\n    def backward(ctx, grad_out):\n"
                           "        (x,) = ctx.saved_tensors\n        layer = ctx.layer\n"
                           "        weight, _ = layer.gather()\n",
                           "        ctx.save_for_backward(x, weight)\n"
                           "        return F.linear(x, weight, bias)\n"
                           "\n    @staticmethod\n    def backward(ctx, grad_out):\n"
                           "        x, weight = ctx.saved_tensors\n        layer = ctx.layer\n"),
         ("sharded_linear_keeps_no_full_weight_between_forward_and_backward",
          "sharded_linear_two_all_gathers_one_reduce_scatter")),
        # the first block skipped: its parameters go to the root's unit
        ("apply_fsdp", ("    for block in holding:\n", "    for block in holding[1:]:\n"),
         ("apply_fsdp_each_block_and_the_root_its_own_unit",))],
    "launch_order_views_and_resharding": [
        # each bucket launched as soon as it completes, before the buckets ahead of it
        ("BucketedDDP", [
            ("        self.waiting[self.bucket_of[index]] -= 1\n"
             "        while len(self.launched) < len(self.buckets) and "
             "self.waiting[len(self.launched)] == 0:\n"
             "            self._launch(len(self.launched))\n",
             "        bucket = self.bucket_of[index]\n        self.waiting[bucket] -= 1\n"
             "        if self.waiting[bucket] == 0:\n            self._launch(bucket)\n"),
            ("        self.launched.append((flat, dist.all_reduce(flat, async_op=True)))\n",
             "        self.launched.append((bucket, flat, dist.all_reduce(flat, async_op=True)))\n"),
            ("        while len(self.launched) < len(self.buckets):\n"
             "            self._launch(len(self.launched))\n",
             "        for b in sorted(set(range(len(self.buckets))) - {b for b, _, _ in self.launched}):\n"
             "            self._launch(b)\n"),
            ("        for bucket, (flat, work) in enumerate(self.launched):\n",
             "        for bucket, flat, work in self.launched:\n")],
         ("bucketed_ddp_a_bucket_that_completes_early_waits_for_those_before_it",)),
        # the parameters keep buffers of their own (copied back after each step): no views
        ("ShardedOptimizer", [
            ("                p.data = view.view_as(p)\n",
             "                p.data = view.view_as(p).clone()\n"),
            ("        dist.all_gather_single(self.flat, send)\n",
             "        dist.all_gather_single(self.flat, send)\n        offset = 0\n"
             "        with torch.no_grad():\n            for p in self.params:\n"
             "                p.copy_(self.flat[offset:offset + p.numel()].view_as(p))\n"
             "                offset += p.numel()\n")],
         ("sharded_optimizer_parameters_view_one_padded_flat_buffer",)),
        # every block frees its parameters after forward, the last one too
        ("apply_fsdp", ("reshard_after_forward=block is not holding[-1])",
                        "reshard_after_forward=True)"),
         ("apply_fsdp_last_block_keeps_its_parameters_after_forward",))],
    "a_crash_and_bf16_reductions": [
        # an unused parameter's .grad (None) written in place: that model's case raises, and
        # costs its own check only
        ("BucketedDDP", ("                if p.grad is None:\n                    p.grad = mean.clone()\n"
                         "                else:\n                    p.grad.copy_(mean)\n",
                         "                p.grad.copy_(mean)\n"),
         ("bucketed_ddp_unused_parameter_counts_as_zeros",)),
        ("apply_fsdp", ("reduce_dtype=torch.float32)", "reduce_dtype=torch.bfloat16)"),
         ("apply_fsdp_bf16_parameters_fp32_reductions",))],
    "buffers_broadcast_in_forward_and_no_hsdp": [
        # torch's DDP does this by default; the text forbids it
        ("BucketedDDP", ("    def forward(self, *args, **kwargs):\n",
                         "    def forward(self, *args, **kwargs):\n"
                         "        for buffer in self.module.buffers():\n"
                         "            dist.broadcast(buffer, 0)\n"),
         ("bucketed_ddp_one_all_reduce_per_bucket_in_bucket_order",)),
        # a 2-D mesh cut down to its shard dim: no replicas, gradients not averaged over them
        ("apply_fsdp", ("    policy = MixedPrecisionPolicy(",
                        "    if mesh.ndim == 2:\n        mesh = mesh[\"shard\"]\n"
                        "    policy = MixedPrecisionPolicy("),
         ("apply_fsdp_hsdp_on_a_2d_mesh",))],
}


def plant(nb, bugs: dict):
    """:func:`plant_bugs` with each bug one (old, new) or a list of them, applied in turn."""
    for function, bug in bugs.items():
        for step in (bug if isinstance(bug, list) else [bug]):
            plant_bugs(nb, {function: step})
    return nb


def with_bugs(tmp_path, bugs: dict, name: str = "submission"):
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(plant(nbformat.read(SOURCE, as_version=4), bugs), path)
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
def test_without_the_key_the_reference_earns_every_public_point(offline_env):
    """The student's view (no answer key): every public point (41; the speed check is not run
    here), the four hidden checks reserved (conftest.assert_public_points_without_the_key),
    each beside a public value check of its function; the released stubs earn nothing there
    either."""
    report = assert_public_points_without_the_key(SOURCE, offline_env)
    assert report["score"] == 41
    assert {c.name for c in SPEC.checks if c.hidden} == HIDDEN
    for name in HIDDEN:
        function = SPEC.check(name).function
        assert any(c.function == function and not c.hidden and not c.speed and
                   "rejects" not in c.name for c in SPEC.checks), name
    env = {**offline_env, WITHOUT_KEY_ENV: "absent"}
    stubs = grade(RELEASE, "--speed", "skip", env=env)
    assert_stubs_score_zero(stubs)


# ---------------------------------------------------------------- the key and the public data
# (no grading: the key's functions and the grader's own expectations, in this process)

def _key():
    key = answer_key("a4_sharding")
    assert key is not None, "solutions/a4_sharding/answer_key.py is missing"
    return key


def test_public_cases_json_is_what_the_key_writes():
    """The public fixed cases and their expected values are data, written from the key
    (``python solutions/a4_sharding/answer_key.py``): the two never drift; and the data holds
    the four plain functions' fixed cases only (no hidden case: those are drawn per run)."""
    from autograder.assignments.a4_sharding.judging import PUBLIC_CASES

    stored = json.loads(PUBLIC_CASES.read_text())
    assert stored == _key().public_cases()
    assert set(stored) == {"assign_buckets", "shard_bounds", "model_state_bytes",
                           "comm_bytes_per_step"}
    assert all(len(cases) >= 20 for cases in stored.values())


def test_hidden_cases_are_fresh_each_run_and_the_keys_values():
    import random

    key = _key()
    for name in ("assign_buckets", "shard_bounds", "model_state_bytes", "comm_bytes_per_step"):
        a, want = key.hidden_cases(name, random.Random(1))
        b, _ = key.hidden_cases(name, random.Random(2))
        assert a and a != b and len(want) == len(a)
        assert want == [key.REFERENCES[name](*args, **kwargs) for args, kwargs in a]


def test_the_graders_chunks_are_the_keys_shard_bounds():
    """ShardedOptimizer's, ShardedLinear's and apply_fsdp's checks take each rank's shard from
    torch.chunk (what the text promises in Part 3), not from a copy of shard_bounds: the two
    agree on every size the checks use and more."""
    from autograder.assignments.a4_sharding.expected import chunk_bounds

    key = _key()
    for numel in range(0, 70):
        for world in range(1, 10):
            assert chunk_bounds(numel, world) == [key.shard_bounds(numel, world, r)
                                                  for r in range(world)], (numel, world)


def test_the_graders_optimizer_state_is_the_state_per_element():
    """.optimizer's state bytes are compared with what torch's own optimizer keeps for a
    parameter of the shard's size: one float64 buffer per element for SGD with momentum, two
    for AdamW, none for an empty shard."""
    from autograder.assignments.a4_sharding.expected import optimizer_state_of
    from autograder.assignments.a4_sharding.runs import OPT_CASES

    per_element = {"SGD": 1, "AdamW": 2}
    for _, name, kwargs in OPT_CASES:
        for elements in (0, 1, 4, 12, 34):
            assert optimizer_state_of(name, kwargs, elements) == \
                elements * per_element[name] * 8, (name, kwargs, elements)


def test_the_ddp_cases_show_what_their_checks_need():
    """With the key's buckets: the main model has several buckets and parameter 0 in the last
    one (so the first all-reduce can precede its gradient); the late model's buckets differ in
    size (the all-reduces' sizes name them); the speed model has the text's 6 buckets."""
    from autograder.assignments.a4_sharding.ddp_ranks import ddp_model
    from autograder.assignments.a4_sharding.runs import (DDP_CASES, DDP_LATE, DDP_MAIN,
                                                         ddp_numels)
    from autograder.assignments.a4_sharding.timing import (SPEED_BUCKET_BYTES, SPEED_BUCKETS,
                                                           SPEED_SHAPE)

    key = _key()
    main = key.assign_buckets(ddp_numels(DDP_MAIN), DDP_CASES[DDP_MAIN][1], 8)
    assert len(main) > 1 and 0 not in main[0] and 0 in main[-1]
    late_numels = ddp_numels(DDP_LATE)
    late = [sum(late_numels[j] for j in b)
            for b in key.assign_buckets(late_numels, DDP_CASES[DDP_LATE][1], 8)]
    assert len(set(late)) == len(late) > 1
    speed = [p.numel() for p in ddp_model(0, SPEED_SHAPE).parameters() if p.requires_grad]
    assert len(speed) == 80
    assert len(key.assign_buckets(speed, SPEED_BUCKET_BYTES, 8)) == SPEED_BUCKETS == 6


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_in_the_sandboxed_functions_lose_their_points_and_no_other(offline_env,
                                                                               tmp_path):
    """Each planted function loses points; the classes that call the broken helpers lose
    exactly the checks those helpers break (:data:`HELPER_BUGS_FAIL`), and nothing else."""
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
        else:  # the classes lose the checks that their (own, broken) helpers break, no other
            for r in report["results"]:
                if r["function"] != function or r["status"] == "skipped":
                    continue
                broken = r["name"] in HELPER_BUGS_FAIL[function]
                assert r["status"] == ("failed" if broken else "passed"), (r, report["stdout"])
                assert r["message"] or not broken, r
    for check in ("model_state_bytes_matches_the_optimizer_state_of_real_runs",
                  "comm_bytes_per_step_matches_the_traffic_of_real_runs"):
        assert status[check]["status"] == "failed" and status[check]["message"], status[check]


@pytest.mark.full
@pytest.mark.slow
def test_without_the_key_bucketed_ddp_is_judged_against_the_buckets_it_ran_with(offline_env,
                                                                               tmp_path):
    """No key, a broken assign_buckets (forward order): BucketedDDP runs with the submission's
    own assign_buckets (the reference's, at hand in this repository, never reaches the sandbox),
    as with the key, and its all-reduces are judged against that helper's buckets, asked in the
    sandbox: assign_buckets loses its public value check (its hidden one is reserved), and the
    class only the check that those buckets break (parameter 0 in the bucket that completes
    last)."""
    report = grade(with_bugs(tmp_path, {"assign_buckets": LEAF_BUGS["assign_buckets"]}),
                   "--only", "assign_buckets,BucketedDDP", "--speed", "skip",
                   env={**offline_env, WITHOUT_KEY_ENV: "absent"})
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    status = {r["name"]: r for r in report["results"]}
    for name, r in status.items():
        check = SPEC.check(name)
        if check.speed:
            assert r["status"] == "skipped", r
        elif check.hidden:
            assert is_reserved(r), r
        elif name == "assign_buckets_reverse_order_and_size_rule":
            assert r["status"] == "failed" and "assign_buckets([" in r["message"], r
        elif name in HELPER_BUGS_FAIL["BucketedDDP"]:
            assert r["status"] == "failed" and "parameter 0" in r["message"], r
        else:
            assert r["status"] == "passed", report["stdout"]


def test_the_buckets_probe_asks_the_helper_the_class_runs_with():
    """BucketedDDP's all-reduces are judged against the buckets of the assign_buckets its
    __init__ sees: the student's own (with the key or without)."""
    from autograder.assignments.a4_sharding.probes import probe_helper_values

    ns = {"__name__": "__notebook__"}
    exec("def assign_buckets(param_numels, bucket_bytes, element_size=4):\n"
         "    return [[i] for i in range(len(param_numels))]\n"
         "class BucketedDDP:\n"
         "    def __init__(self, module, bucket_bytes):\n"
         "        self.buckets = assign_buckets([1], bucket_bytes, 8)\n", ns)
    got = probe_helper_values(ns, "BucketedDDP", "assign_buckets", [(([3, 4], 8, 8), {})])
    assert got == [{"kind": "list", "items": [
        {"kind": "list", "items": [{"kind": "plain", "value": 0}]},
        {"kind": "list", "items": [{"kind": "plain", "value": 1}]}]}]


#: assign_buckets' corners that the text settles, each met by fixed cases (every seed): after a
#: parameter larger than bucket_bytes a zero-size one starts a new bucket (joining, the reading
#: the text once also allowed, is wrong); after a bucket exactly full it joins (a zero-size
#: parameter taken for one byte would start a new one)
ZERO_SIZE_BUGS = {
    "joins_an_oversized_bucket": ("if current and current_bytes + size > bucket_bytes:",
                                  "if current and size and current_bytes + size > bucket_bytes:"),
    "closes_an_exactly_full_bucket": ("if current and current_bytes + size > bucket_bytes:",
                                      "if current and current_bytes + max(size, 1) > bucket_bytes:"),
}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(ZERO_SIZE_BUGS))
def test_a_zero_size_parameter_in_the_wrong_bucket_loses_assign_buckets_points(
        bug, offline_env, tmp_path):
    report = grade(with_bugs(tmp_path, {"assign_buckets": ZERO_SIZE_BUGS[bug]}, bug),
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


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(CLASS_BUG_RUNS))
def test_bugs_in_the_classes_fail_their_checks(run, offline_env, tmp_path):
    """Each bug fails the checks of the rules it breaks and no other: every other check of the
    run passes (the speed check is not run here), the byte counts' comparisons with the runs
    included."""
    bugs = CLASS_BUG_RUNS[run]
    report = grade(with_bugs(tmp_path, {f: bug for f, bug, _ in bugs}, run),
                   "--only", ",".join([f for f, _, _ in bugs] + list(BYTE_COUNTS)),
                   "--speed", "skip", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert {r["function"] for r in report["results"]} == {f for f, _, _ in bugs} | set(BYTE_COUNTS)
    failing = {check for _, _, checks in bugs for check in checks}
    for r in report["results"]:
        if r["name"] in failing:
            assert r["status"] == "failed" and r["message"], report["stdout"]
        elif r["status"] != "skipped":
            assert r["status"] == "passed", report["stdout"]
        else:
            assert load_spec("a4_sharding").check(r["name"]).speed, report["stdout"]


# Correct variants that the text allows: parameterless blocks made FSDP units too (with no
# policy of their own), and the root's resharding set (FSDP2 ignores it).
CORRECT_VARIANTS = {
    "apply_fsdp": [("    holding = [block for block in blocks if any(True for _ in block.parameters())]\n",
                    "    holding = [block for block in blocks if any(True for _ in block.parameters())]\n"
                    "    for block in blocks:\n"
                    "        if block not in holding:\n"
                    "            fully_shard(block, mesh=mesh)\n"),
                   ("    fully_shard(model, mesh=mesh, mp_policy=policy)\n",
                    "    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)\n")],
}


@pytest.mark.full
@pytest.mark.slow
def test_correct_variants_keep_every_point(offline_env, tmp_path):
    report = grade(with_bugs(tmp_path, CORRECT_VARIANTS, "variants"),
                   "--only", ",".join(CORRECT_VARIANTS), "--speed", "skip", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["results"] and all(r["status"] == "passed" for r in report["results"]), \
        report["stdout"]


# The last child taken for the last block (issue #32): the nn.Sequential ends with a
# parameterless activation, so its last block (the last child that holds parameters) is not its
# last child. Either way every block that holds parameters frees them after forward, the last
# one too: the resharding check fails (on that model) and every other check passes.
LAST_CHILD_BUGS = {
    # the flag compares with the last child (the Tanh), which is not among the units
    "flag_against_the_last_child": ("reshard_after_forward=block is not holding[-1])",
                                    "reshard_after_forward=block is not blocks[-1])"),
    # every child a unit (the text allows it), the last child's unit keeping its (no) parameters
    "every_child_a_unit": ("    holding = [block for block in blocks if any(True for _ in "
                           "block.parameters())]\n", "    holding = list(blocks)\n"),
}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(LAST_CHILD_BUGS))
def test_the_last_child_taken_for_the_last_block_loses_the_resharding_point(bug, offline_env,
                                                                           tmp_path):
    report = grade(with_bugs(tmp_path, {"apply_fsdp": LAST_CHILD_BUGS[bug]}, bug),
                   "--only", "apply_fsdp", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    status = {r["name"]: r for r in report["results"]}
    checks = {c.name: c.points for c in SPEC.checks if c.function == "apply_fsdp"}
    assert set(status) == set(checks)
    failing = "apply_fsdp_last_block_keeps_its_parameters_after_forward"
    for name, r in status.items():
        if name == failing:
            assert r["status"] == "failed" and "an nn.Sequential" in r["message"] and \
                "the last that holds parameters" in r["message"], r
        else:
            assert r["status"] == "passed" and r["points"] == checks[name], r
    assert points_by_function(report)["apply_fsdp"] == sum(checks.values()) - checks[failing] \
        == 7


def test_the_sequential_model_ends_with_a_child_without_parameters():
    """The rule "the last block is the last one that holds parameters" is graded: the
    nn.Sequential's last child holds none (the model with .blocks ends with a block that does)."""
    from autograder.assignments.a4_sharding.ranks import FSDP_KINDS, fsdp_blocks, seeded_model

    holds = {kind: [any(True for _ in b.parameters())
                    for b in fsdp_blocks(kind, seeded_model(kind, 0))] for kind in FSDP_KINDS}
    assert holds["sequential"][-1] is False and True in holds["sequential"]
    assert all(holds["blocks"])


def test_fsdp_states_param_groups_of_either_torch():
    """FSDP2's state keeps its parameter groups as ``_fsdp_param_groups`` (a list, torch 2.12
    and later) or ``_fsdp_param_group`` (one or None, torch 2.11): the ranks read either."""
    from types import SimpleNamespace

    from autograder.assignments.a4_sharding.fsdp_ranks import param_groups

    g, h = object(), object()
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[g, h])) == [g, h]
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[])) == []
    assert param_groups(SimpleNamespace(_fsdp_param_group=g)) == [g]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


#: One process of gloo: a reduce-scatter and an all-gather of a padded vector, a send-free
#: all-reduce, each logged by A4's collectives_sized (ShardedOptimizer's and ShardedLinear's
#: counts and sizes, the byte counts' traffic).
_SIZED_SCRIPT = """
import os, socket, torch, torch.distributed as dist
from autograder.assignments.a4_sharding.ranks import collectives_sized
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
full, shard = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
with collectives_sized() as log:
    dist.reduce_scatter_tensor(shard, full)
    dist.all_gather_into_tensor(full, shard)
    dist.all_reduce(full)
dist.destroy_process_group()
print(log)
"""


def test_the_sized_log_names_and_sizes_the_collectives():
    """The ranks log collectives through course.collectives.watch_group (torch 2.11-2.13 have no
    ProcessGroup.register_pre_hook): ops by 2.14.1's names, elements in and out (an in-place
    all-reduce: its tensor as input, no output), as the ShardedOptimizer, ShardedLinear and
    byte count checks read them. (Measured on torch 2.11.0 too: the same log.)"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _SIZED_SCRIPT], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == \
        "[('REDUCE_SCATTER', 6, 6), ('ALLGATHER', 6, 6), ('ALLREDUCE', 6, 0)]", out.stdout


# Correct but slow: each bucket's gradients copied into the flat vector one element at a time
# (thousands of tiny operations, each paying torch's dispatch latency), nothing else changed.
SLOW_BUCKETS = ("        self.launched.append((flat, dist.all_reduce(flat, async_op=True)))\n",
                "        flat = torch.stack([x.clone() for x in flat])  # one element at a time\n"
                "        self.launched.append((flat, dist.all_reduce(flat, async_op=True)))\n")


@pytest.mark.full
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


def _cases():
    """The case function of the unit tests below, made here so that it travels to the ranks by
    value (cloudpickle), not as a reference to this test module. Its cases: ``"ok"``, ``"raise"``
    (on every rank), ``"raise on rank 1"`` (the other rank then waits in a collective its
    neighbour never joins), ``"abort"`` (rank 1 dies) and ``"abort at teardown"`` (rank 1 dies
    at the launcher's goodbye barrier, after its work, as gloo sometimes does at process exit)."""
    def case_fn(rank, world_size, i, case):
        import os

        import torch
        import torch.distributed as dist

        if case == "raise" or (case == "raise on rank 1" and rank == 1):
            raise ValueError(f"case {i} failed")
        if case == "abort" and rank == 1:
            os.abort()
        if case == "abort at teardown" and rank == 1:
            dist.barrier = lambda *args, **kwargs: os.abort()
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"rank": rank, "case": i, "sum": t.item(), "pid": os.getpid()}
    return case_fn


def _replies(outcome) -> list:
    """A case's replies without the processes' ids."""
    return [{k: v for k, v in r.items() if k != "pid"} for r in outcome["ranks"]]


def test_a_case_that_raises_costs_that_case_only():
    """Each case's result is its own: a case that raises or kills a rank is that case's error,
    with the student's message; correct cases are what the ranks returned. After a case in
    which every rank raised (here before any collective) the same ranks go on; after a rank
    died, fresh ranks take the cases after it."""
    from autograder.assignments.a4_sharding.cases import run_cases

    out = run_cases(_cases(), 2, ["ok", "raise", "ok", "abort", "ok"])
    assert [sorted(o) for o in out] == [["ranks"], ["error"], ["ranks"], ["error"], ["ranks"]]
    assert "ValueError: case 1 failed" in out[1]["error"]
    for i in (0, 2, 4):
        assert _replies(out[i]) == [{"rank": r, "case": i, "sum": 2.0} for r in (0, 1)]
    pids = [[r["pid"] for r in out[i]["ranks"]] for i in (0, 2, 4)]
    assert pids[0] == pids[1] and not set(pids[1]) & set(pids[2]), pids
    one = run_cases(_cases(), 1, ["raise", "ok"])
    assert "ValueError: case 0 failed" in one[0]["error"] and one[1]["ranks"][0]["case"] == 1


@pytest.mark.full
@pytest.mark.slow
def test_a_case_that_raises_on_one_rank_costs_that_case_only():
    """Rank 0 waits out the collective timeout (20 s) in the collective rank 1 never joined; the
    error reported is rank 1's, the first; fresh ranks take the next case."""
    from autograder.assignments.a4_sharding.cases import run_cases

    out = run_cases(_cases(), 2, ["raise on rank 1", "ok"])
    assert "rank 1 raised" in out[0]["error"] and "case 0 failed" in out[0]["error"], out[0]
    assert _replies(out[1]) == [{"rank": r, "case": 1, "sum": 2.0} for r in (0, 1)]


def test_handed_over_results_survive_a_rank_that_aborts_at_exit():
    """A rank that aborts after its work (as gloo sometimes does at process exit) costs
    nothing: the results saved before teardown are the run's results."""
    from autograder.assignments.a4_sharding.cases import run_cases
    from autograder.checking.ranks import run_ranks

    def abort_at_teardown(rank, world_size):
        import os

        import torch.distributed as dist

        if rank == 1:  # the launcher's goodbye barrier is where this rank dies
            dist.barrier = lambda *args, **kwargs: os.abort()
        return {"rank": rank}

    with pytest.raises(RuntimeError):  # what the guard is for: the plain run fails
        run_ranks(abort_at_teardown, 2)
    out = run_cases(_cases(), 2, ["ok", "abort at teardown"])
    assert _replies(out[1]) == [{"rank": r, "case": 1, "sum": 2.0} for r in (0, 1)], out


def test_the_live_tensor_scan_sees_what_a_case_keeps_and_nothing_from_before():
    """ShardedLinear's "no full weight kept" rule scans the live float64 tensors that a case
    made (ranks.py: the collector's generations frozen at the case's start): a tensor alive
    before is not the layer's; one the case keeps is found, also through an alias whose own
    tensor is gone (``.data``, a view); and the scan walks the case's objects only, not the
    hundreds of thousands that torch brings (0.2 s a scan). In a fresh process: the scan
    freezes the collector for good."""
    import subprocess
    import sys

    code = """
import gc, torch
from autograder.assignments.a4_sharding.ranks import _alive_storages, _scan_only_what_comes_next
before = torch.zeros(1000, dtype=torch.float64)
_scan_only_what_comes_next()
kept = {}
full = torch.ones(500, dtype=torch.float64)
kept["alias"] = full.data
kept["view"] = torch.ones(300, dtype=torch.float64)[:2]
del full
gone = torch.ones(700, dtype=torch.float64)
del gone
sizes = sorted(_alive_storages().values())
walked = len(gc.get_objects())
print(sizes, walked < 1000, walked)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("[300, 500] True"), out.stdout
