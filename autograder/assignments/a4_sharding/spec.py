"""Assignment 4, memory and sharding: the contract with the grader.

BucketedDDP's speed check needs 2 cores to itself (``cores_for_speed``) and SKIPs, with the
reason, where even the reference cannot show its speedup (:mod:`.timing`).

Per-call timeouts: several times what the reference takes on a busy 2-core machine (process
start-up included), so that a hung call fails in a minute or two, not ten.
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a4_sharding",
    functions=(
        Function("assign_buckets", ("param_numels", "bucket_bytes")),
        Function("BucketedDDP", ("module", "bucket_bytes")),
        Function("shard_bounds", ("numel", "world_size", "rank")),
        Function("model_state_bytes", ("num_params", "world_size")),
        Function("comm_bytes_per_step", ("num_params", "world_size")),
        Function("ShardedOptimizer", ("params", "optimizer_cls")),
        Function("ShardedLinear", ("in_features", "out_features")),
        Function("apply_fsdp", ("model", "mesh")),
    ),
    checks=(
        # each value check in two: public fixed cases (expected values as data,
        # public_cases.json) and hidden fresh random cases against the answer key
        Check("assign_buckets_reverse_order_and_size_rule", "assign_buckets", 1),
        Check("assign_buckets_hidden_random_cases", "assign_buckets", 1, hidden=True),
        Check("assign_buckets_rejects_non_positive_bucket_bytes", "assign_buckets", 1),
        Check("bucketed_ddp_gradients_match_one_process", "BucketedDDP", 3, timeout=150),
        Check("bucketed_ddp_one_all_reduce_per_bucket_in_bucket_order", "BucketedDDP", 2,
              timeout=150),
        Check("bucketed_ddp_first_all_reduce_before_parameter_0_gradient", "BucketedDDP", 1,
              timeout=150),
        Check("bucketed_ddp_a_bucket_that_completes_early_waits_for_those_before_it",
              "BucketedDDP", 1, timeout=150),
        Check("bucketed_ddp_unused_parameter_counts_as_zeros", "BucketedDDP", 1, timeout=150),
        Check("bucketed_ddp_step_time_against_the_reference", "BucketedDDP", 2, timeout=150,
              speed=True),
        Check("shard_bounds_ceil_chunks_and_empty_shards", "shard_bounds", 1),
        Check("shard_bounds_hidden_random_cases", "shard_bounds", 1, hidden=True),
        Check("shard_bounds_rejects_invalid_arguments", "shard_bounds", 1),
        Check("model_state_bytes_every_stage_and_precision", "model_state_bytes", 1),
        Check("model_state_bytes_hidden_random_sizes", "model_state_bytes", 1, hidden=True),
        Check("model_state_bytes_rejects_invalid_arguments", "model_state_bytes", 1),
        Check("comm_bytes_per_step_every_stage", "comm_bytes_per_step", 1),
        Check("comm_bytes_per_step_hidden_random_sizes", "comm_bytes_per_step", 1, hidden=True),
        Check("comm_bytes_per_step_rejects_invalid_arguments", "comm_bytes_per_step", 1),
        Check("sharded_optimizer_matches_one_process", "ShardedOptimizer", 3, timeout=150),
        Check("sharded_optimizer_state_bytes_per_rank", "ShardedOptimizer", 1, timeout=150),
        Check("sharded_optimizer_one_reduce_scatter_one_all_gather_per_step", "ShardedOptimizer",
              2, timeout=150),
        Check("sharded_optimizer_parameters_view_one_padded_flat_buffer", "ShardedOptimizer", 1,
              timeout=150),
        Check("sharded_linear_outputs_and_gradients_match_dense", "ShardedLinear", 3,
              timeout=150),
        Check("sharded_linear_stores_its_shard_initialised_like_nn_linear", "ShardedLinear", 1,
              timeout=150),
        Check("sharded_linear_two_all_gathers_one_reduce_scatter", "ShardedLinear", 2,
              timeout=150),
        Check("sharded_linear_keeps_no_full_weight_between_forward_and_backward",
              "ShardedLinear", 2, timeout=150),
        # the byte counts against the classes' runs (after the classes: they reuse those runs)
        Check("model_state_bytes_matches_the_optimizer_state_of_real_runs", "model_state_bytes",
              1, timeout=150),
        Check("comm_bytes_per_step_matches_the_traffic_of_real_runs", "comm_bytes_per_step", 1,
              timeout=150),
        Check("apply_fsdp_each_block_and_the_root_its_own_unit", "apply_fsdp", 2, timeout=150),
        Check("apply_fsdp_bf16_parameters_fp32_reductions", "apply_fsdp", 1, timeout=150),
        Check("apply_fsdp_last_block_keeps_its_parameters_after_forward", "apply_fsdp", 1,
              timeout=150),
        Check("apply_fsdp_shards_dim_0_and_matches_the_dense_model", "apply_fsdp", 2,
              timeout=150),
        Check("apply_fsdp_hsdp_on_a_2d_mesh", "apply_fsdp", 2, timeout=150),
    ),
    cores_for_speed=2,  # BucketedDDP's step time: two processes, a core each
    # apply_fsdp's ranks: FSDP2 and DTensor, whose first operation imports torch._dynamo
    rank_modules=("torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo"),
)
