"""Assignment 3, model parallel and pipelines: the contract with the grader."""
from autograder.checking.spec import Check, Function, Spec

#: The graded functions, in notebook order. Each is graded with the student's own versions of
#: the others it calls (as in the student's self-check).
NAMES = ("split_into_stages", "model_parallel_forward", "pipelined_forward", "gpipe_schedule",
         "one_f_one_b_schedule", "bubble_fraction", "pipeline_train_step")
_PARAMS = {
    "split_into_stages": ("model", "devices"),
    "model_parallel_forward": ("stages", "x"),
    "pipelined_forward": ("stages", "x", "num_microbatches"),
    "gpipe_schedule": ("num_stages", "num_microbatches"),
    "one_f_one_b_schedule": ("num_stages", "num_microbatches"),
    "bubble_fraction": ("schedule",),
    "pipeline_train_step": ("stage", "X", "y", "num_microbatches", "lr"),
}

SPEC = Spec(
    assignment="a3_model_pipeline",
    functions=tuple(Function(name, _PARAMS[name]) for name in NAMES),
    checks=(
        Check("split_into_stages_balanced", "split_into_stages", 1),
        Check("split_into_stages_ties_and_parameter_free_layers", "split_into_stages", 1),
        Check("split_into_stages_one_layer_per_stage_and_too_few_layers", "split_into_stages", 1),
        Check("model_parallel_forward_matches_unsplit_model", "model_parallel_forward", 1),
        Check("model_parallel_forward_gradients_reach_every_stage", "model_parallel_forward", 1),
        Check("pipelined_forward_even_microbatches", "pipelined_forward", 1),
        Check("pipelined_forward_uneven_and_tiny_batches", "pipelined_forward", 1),
        Check("pipelined_forward_clock_cycle_order", "pipelined_forward", 1),
        Check("gpipe_schedule_valid_and_shortest", "gpipe_schedule", 1),
        Check("gpipe_schedule_all_forwards_first", "gpipe_schedule", 1),
        Check("one_f_one_b_schedule_valid_and_shortest", "one_f_one_b_schedule", 1),
        Check("one_f_one_b_schedule_holds_at_most_p_microbatches", "one_f_one_b_schedule", 1),
        Check("bubble_fraction_idle_slots_and_invalid_schedules", "bubble_fraction", 1),
        Check("pipeline_train_step_two_ranks_match_one_process_sgd", "pipeline_train_step", 2,
              timeout=120),
        Check("pipeline_train_step_three_ranks_and_tiny_batches", "pipeline_train_step", 1,
              timeout=120),
        Check("pipelined_forward_speedup_two_gpus", "pipelined_forward_speedup", 2, timeout=180,
              calls="pipelined_forward", speed=True),
        Check("pipeline_train_step_speedup_two_cpu_processes", "pipeline_train_step_speedup", 2,
              timeout=240, calls="pipeline_train_step", speed=True),
    ),
    cores_for_speed=2,
    gpus_for_speed=2,
    rank_modules=(),
)
