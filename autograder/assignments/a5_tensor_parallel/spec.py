"""Assignment 5, tensor parallelism and 2-D meshes: the contract with the grader.

Each function runs on 4 fresh processes (plus a world of one in the sandbox's own process);
one such run per function is shared by all of its checks. Per-call timeouts are several times
what the reference takes on a busy 2-core machine (process start-up included).
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a5_tensor_parallel",
    functions=(
        Function("ColumnParallelLinear", ("in_features", "out_features", "bias", "gather_output",
                                          "group")),
        Function("RowParallelLinear", ("in_features", "out_features", "bias",
                                       "input_is_parallel", "group")),
        Function("ParallelMLP", ("mlp", "group")),
        Function("vocab_parallel_cross_entropy", ("local_logits", "targets", "group")),
        Function("train_2d", ("model_fn", "data")),
        Function("cross_check", ("mlp", "group")),
    ),
    checks=(
        Check("column_parallel_slices_shapes_and_errors", "ColumnParallelLinear", 1, timeout=120),
        Check("column_parallel_outputs_and_gradients", "ColumnParallelLinear", 2, timeout=120),
        Check("row_parallel_slices_shapes_and_errors", "RowParallelLinear", 1, timeout=120),
        Check("row_parallel_outputs_and_gradients", "RowParallelLinear", 2, timeout=120),
        Check("parallel_mlp_matches_dense_block", "ParallelMLP", 2, timeout=120),
        Check("parallel_mlp_one_all_reduce_each_way", "ParallelMLP", 1, timeout=120),
        Check("vocab_parallel_cross_entropy_matches_dense", "vocab_parallel_cross_entropy", 2,
              timeout=120),
        Check("vocab_parallel_cross_entropy_stable_at_large_logits",
              "vocab_parallel_cross_entropy", 1, timeout=120),
        Check("vocab_parallel_cross_entropy_communication_bound", "vocab_parallel_cross_entropy",
              1, timeout=120),
        Check("train_2d_two_by_two_matches_dense_training", "train_2d", 2, timeout=150),
        Check("train_2d_one_by_two_and_two_by_one", "train_2d", 2, timeout=150),
        Check("train_2d_uses_the_tp_groups", "train_2d", 1, timeout=150),
        Check("cross_check_ours_and_torch_equal_the_dense_block", "cross_check", 1,
              timeout=120),
        Check("cross_check_sequence_parallel_block", "cross_check", 1, timeout=120),
    ),
    # DTensor's first operation imports torch._dynamo (seconds in every rank of every run)
    rank_modules=("torch.distributed.tensor", "torch.distributed.tensor.parallel",
                  "torch._dynamo"),
)
