"""Assignment 7, mixture of experts and expert parallelism: the contract with the grader.

``route``, ``expert_capacity`` (with ``keep_mask``, in the same answer cell),
``load_balancing_loss`` and ``MoELayer`` run in the sandbox's own process; ``ExpertParallelMoE``
and ``train_ep`` each run once on 4 fresh processes, where every rank tries them on each group
it belongs to (the world, two pairs, a group of 1): that one run is shared by all of the
function's checks. Per-call timeouts are several times what the reference takes on a busy
2-core machine (process start-up included).
"""
from autograder.checking.spec import Check, Function, Spec

_PARTS = ("route", "expert_capacity", "keep_mask", "load_balancing_loss")

SPEC = Spec(
    assignment="a7_expert_parallel",
    functions=(
        Function("route", ("logits", "k")),
        Function("expert_capacity", ("num_tokens", "num_experts", "k", "capacity_factor")),
        Function("keep_mask", ("experts", "capacity")),
        Function("load_balancing_loss", ("logits", "experts", "num_experts")),
        Function("MoELayer", ("d_model", "hidden", "num_experts", "k", "capacity_factor"),
                 helpers=_PARTS),
        Function("ExpertParallelMoE", ("router", "experts", "num_experts", "k",
                                       "capacity_factor", "group"), helpers=(*_PARTS, "MoELayer")),
        Function("train_ep", ("model_fn", "data"),
                 helpers=(*_PARTS, "MoELayer", "ExpertParallelMoE")),
    ),
    checks=(
        Check("route_values_ties_and_value_error", "route", 1, timeout=60),
        Check("route_renormalised_weights_gradient", "route", 1, timeout=60),
        Check("expert_capacity_exact_values_and_value_errors", "expert_capacity", 1,
              timeout=60),
        Check("keep_mask_hand_made_cases", "expert_capacity", 1,
              timeout=60),
        Check("keep_mask_random_cases_against_the_fill_order", "expert_capacity", 1,
              timeout=60),
        Check("load_balancing_loss_matches_the_formula", "load_balancing_loss", 1, timeout=60),
        Check("load_balancing_loss_gradient", "load_balancing_loss", 1, timeout=60),
        Check("MoELayer_outputs_with_and_without_drops", "MoELayer", 1, timeout=60),
        Check("MoELayer_gradients_of_x_and_the_router", "MoELayer", 1, timeout=60),
        Check("MoELayer_gradients_of_the_experts", "MoELayer", 1, timeout=60),
        Check("ExpertParallelMoE_from_moe_attributes_and_value_error", "ExpertParallelMoE", 1,
              timeout=120),
        Check("ExpertParallelMoE_forward_equals_the_dense_layer", "ExpertParallelMoE", 1,
              timeout=120),
        Check("ExpertParallelMoE_gradients", "ExpertParallelMoE", 2, timeout=120),
        Check("ExpertParallelMoE_all_to_alls_only", "ExpertParallelMoE", 1, timeout=120),
        Check("train_ep_losses_match_one_process_training", "train_ep", 1, timeout=120),
        Check("train_ep_state_matches_one_process_training", "train_ep", 2, timeout=120),
    ),
    # all_to_all_single_autograd (torch.distributed._functional_collectives) imports
    # torch._dynamo on its first call: seconds in every rank of the expert-parallel and
    # training runs, unless the fork server has it already
    rank_modules=("torch._dynamo",),
)
