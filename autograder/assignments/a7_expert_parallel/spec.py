"""Assignment 7, mixture of experts and expert parallelism: the contract with the grader.

``route``, ``expert_capacity`` (with ``keep_mask``, in the same answer cell),
``load_balancing_loss`` and ``MoELayer`` run in the sandbox's own process; ``ExpertParallelMoE``
and ``train_ep`` each run once on 4 fresh processes, where every rank tries them on each group
it belongs to (the world, two pairs, a group of 1): that one run is shared by all of the
function's checks. Per-call timeouts are several times what the reference takes on a busy
2-core machine (process start-up included). Checks marked ``hidden`` compare with the
instructor's answer key (``solutions/a7_expert_parallel/answer_key.py``): reserved where it is
absent (the student edition).
"""
from autograder.checking.spec import Check, Function, Spec

#: The parts that MoELayer, ExpertParallelMoE and train_ep build on (the probes' per-token truth
#: calls the student's own, as the graded code does)
_PARTS = ("route", "expert_capacity", "keep_mask", "load_balancing_loss")

SPEC = Spec(
    assignment="a7_expert_parallel",
    functions=(
        Function("route", ("logits", "k")),
        Function("expert_capacity", ("num_tokens", "num_experts", "k", "capacity_factor")),
        Function("keep_mask", ("experts", "capacity")),
        Function("load_balancing_loss", ("logits", "experts", "num_experts")),
        Function("MoELayer", ("d_model", "hidden", "num_experts", "k", "capacity_factor")),
        Function("ExpertParallelMoE", ("router", "experts", "num_experts", "k",
                                       "capacity_factor", "group")),
        Function("train_ep", ("model_fn", "data")),
    ),
    checks=(
        Check("route_fixed_cases_invariants_and_value_error", "route", 1, timeout=60),
        Check("route_random_cases_and_gradient_against_the_key", "route", 1, timeout=60,
              hidden=True),
        Check("expert_capacity_fixed_cases_and_value_errors", "expert_capacity", 1,
              timeout=60),
        Check("keep_mask_fixed_cases_and_the_fill_order", "expert_capacity", 1, timeout=60),
        Check("expert_capacity_and_keep_mask_random_cases_against_the_key", "expert_capacity",
              1, timeout=60, hidden=True),
        Check("load_balancing_loss_fixed_cases_and_finite_differences", "load_balancing_loss",
              1, timeout=60),
        Check("load_balancing_loss_random_cases_against_the_key", "load_balancing_loss", 1,
              timeout=60, hidden=True),
        Check("MoELayer_outputs_against_a_per_token_loop", "MoELayer", 1, timeout=60),
        Check("MoELayer_gradients_against_a_per_token_loop", "MoELayer", 1, timeout=60),
        Check("MoELayer_against_the_answer_key", "MoELayer", 1, timeout=60, hidden=True),
        Check("ExpertParallelMoE_from_moe_attributes_and_value_error", "ExpertParallelMoE", 1,
              timeout=120),
        Check("ExpertParallelMoE_forward_against_a_per_token_loop", "ExpertParallelMoE", 1,
              timeout=120),
        Check("ExpertParallelMoE_gradients_against_a_per_token_loop", "ExpertParallelMoE", 1,
              timeout=120),
        Check("ExpertParallelMoE_all_to_alls_only", "ExpertParallelMoE", 1, timeout=120),
        Check("ExpertParallelMoE_against_the_answer_key", "ExpertParallelMoE", 1, timeout=120,
              hidden=True),
        Check("train_ep_losses_match_one_process_training", "train_ep", 1, timeout=120),
        Check("train_ep_state_matches_one_process_training", "train_ep", 1, timeout=120),
        Check("train_ep_against_the_answer_key", "train_ep", 1, timeout=120, hidden=True),
    ),
    # all_to_all_single_autograd (torch.distributed._functional_collectives) imports
    # torch._dynamo on its first call: seconds in every rank of the expert-parallel and
    # training runs, unless the fork server has it already
    rank_modules=("torch._dynamo",),
)
