"""Assignment 6, context parallelism: the contract with the grader.

``merge_attention`` runs in the sandbox's own process; each other function runs once on 4
fresh processes, where every rank tries it on each group it belongs to (the world, a group of
3 without global rank 0, pairs, a group of 1): that one run is shared by all of the
function's checks. A group where the function raised fails its checks with that error, named
by group; the groups before it are still judged. Per-call timeouts are several times what the reference takes on a busy
2-core machine (process start-up included).
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a6_context_parallel",
    functions=(
        Function("merge_attention", ("out_a", "lse_a", "out_b", "lse_b")),
        Function("zigzag_shard", ("x", "dim", "group")),
        Function("zigzag_unshard", ("x_local", "dim", "group")),
        Function("ring_attention", ("q", "k", "v", "causal", "group", "layout")),
        Function("ulysses_attention", ("q", "k", "v", "causal", "group")),
        Function("train_cp", ("model_fn", "tokens")),
    ),
    checks=(
        Check("merge_attention_matches_attention_over_all_keys", "merge_attention", 1,
              timeout=60),
        Check("merge_attention_hidden_cases", "merge_attention", 1, timeout=60, hidden=True),
        Check("zigzag_shard_and_unshard", "zigzag_shard", 3, timeout=120),
        Check("ring_attention_contiguous_outputs_and_gradients", "ring_attention", 2,
              timeout=150),
        Check("ring_attention_zigzag_outputs_and_gradients", "ring_attention", 1, timeout=150),
        Check("ring_attention_point_to_point_within_bounds", "ring_attention", 1, timeout=150),
        Check("ring_attention_memory_and_causal_skipping", "ring_attention", 1, timeout=150),
        Check("ulysses_attention_outputs_and_gradients", "ulysses_attention", 2, timeout=120),
        Check("ulysses_attention_all_to_alls_and_value_error", "ulysses_attention", 1,
              timeout=120),
        Check("train_cp_ring_both_layouts_match_one_process_training", "train_cp", 1,
              timeout=150),
        Check("train_cp_ulysses_matches_one_process_training", "train_cp", 1, timeout=150),
        Check("train_cp_unknown_mode_raises_value_error", "train_cp", 1, timeout=150),
    ),
    # the differentiable all-to-alls that Ulysses uses (torch.distributed.nn.functional's and
    # the functional collectives') import torch._dynamo on their first call: seconds in every
    # rank of the Ulysses and training runs, unless the fork server has it already
    rank_modules=("torch._dynamo",),
)
