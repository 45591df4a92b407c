"""Assignment 8, composing parallelisms (3-D parallelism and its cost model): the contract with
the grader.

``per_rank_memory``, ``step_time`` and ``best_config`` run in the sandbox's own process;
``best_config`` with the student's own ``per_rank_memory`` and ``step_time`` (as in the
student's self-check), so that a bug in those can also cost its checks. Each is checked
publicly on fixed cases whose values are stored as data (public_cases.json) and, with the
instructor's answer key, on hidden and random cases (``hidden=True``: reserved for the
instructor's grading). ``train_3d`` runs once on 8 fresh processes that train every mesh of the
checks in turn (:mod:`.ranks`): that one run is shared by all of its checks, each judging one
thing (the states, the losses, the groups). A8 has no speed check. Per-call timeouts are several
times what the reference takes on a busy 2-core machine (process start-up included).
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a8_composition",
    functions=(
        Function("per_rank_memory", ("model_cfg", "par_cfg")),
        Function("step_time", ("model_cfg", "par_cfg", "hw_cfg")),
        Function("best_config", ("model_cfg", "hw_cfg", "world_size")),
        Function("train_3d", ("model_fn", "data")),
    ),
    checks=(
        Check("per_rank_memory_exact_bytes_on_public_cases", "per_rank_memory", 1, timeout=60),
        Check("per_rank_memory_exact_bytes_on_hidden_and_random_cases", "per_rank_memory", 1,
              timeout=60, hidden=True),
        Check("per_rank_memory_value_errors", "per_rank_memory", 1, timeout=60),
        Check("step_time_matches_the_cost_model_on_public_cases", "step_time", 1, timeout=60),
        Check("step_time_matches_the_cost_model_on_hidden_and_random_cases", "step_time", 1,
              timeout=60, hidden=True),
        Check("step_time_value_errors", "step_time", 1, timeout=60),
        Check("best_config_public_cases", "best_config", 1, timeout=120),
        Check("best_config_hidden_cases", "best_config", 2, timeout=120, hidden=True),
        Check("train_3d_state_on_pp2_dp2_tp2_8_ranks_matches_one_process", "train_3d", 2,
              timeout=150),
        Check("train_3d_state_on_three_meshes_of_4_ranks_matches_one_process", "train_3d", 2,
              timeout=150),
        Check("train_3d_losses_match_one_process", "train_3d", 2, timeout=150),
        Check("train_3d_each_mode_on_its_own_group", "train_3d", 2, timeout=150),
    ),
    # what students' ranks may use beyond torch.distributed (DTensor, FSDP2, pipelining, and
    # torch._dynamo, which DTensor's first operation and pipelining import): imported once in
    # the fork server, not in each of the 8 ranks (seconds each)
    rank_modules=("torch.distributed.tensor", "torch.distributed.fsdp",
                  "torch.distributed.pipelining", "torch._dynamo"),
)
