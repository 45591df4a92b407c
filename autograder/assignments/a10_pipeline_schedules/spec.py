"""Assignment 10, pipeline schedules of today (interleaved 1F1B, zero bubble, ZB-V): the contract
with the grader.

The generators run in the sandbox's own process, with torch's schedule classes refused; their
lists are validated and measured here, in the grader, by :mod:`.judging` (placement, every
action once, order on each rank, no deadlock; bubble and peak in flight against the text's
bounds, with :mod:`course.schedules`' model). The split backward runs in the sandbox against
autograd, with what it leaves alive counted there (:mod:`.probes`). ``run_schedule`` runs on 2, 3
and 4 gloo ranks started by a probe (:mod:`.ranks`), on schedules the grader writes and on the
student's own valid lists; its gradients, refusals and timelines are judged here. The one speed
check times steps from the grader's process against one process and against the reference's
speedup in the same run. Nothing needs the answer key: every check is public.
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a10_pipeline_schedules",
    functions=(
        Function("interleaved_1f1b", ("p", "v", "m")),
        Function("zero_bubble_h1", ("p", "m")),
        Function("zero_bubble_v", ("p", "m")),
        Function("backward_input", ("stage", "x", "grad_output")),
        Function("backward_weight", ("stage", "saved")),
        Function("run_schedule", ("schedule", "stages", "inputs", "targets", "loss_fn")),
    ),
    checks=(
        Check("interleaved_1f1b_fixed_cases_are_valid", "interleaved_1f1b", 1),
        Check("interleaved_1f1b_within_the_bubble_and_memory_bounds", "interleaved_1f1b", 1),
        Check("interleaved_1f1b_random_cases_and_value_errors", "interleaved_1f1b", 1),
        Check("zero_bubble_h1_valid_and_within_bounds", "zero_bubble_h1", 1),
        Check("zero_bubble_h1_random_cases_and_value_errors", "zero_bubble_h1", 1),
        Check("zero_bubble_v_placed_in_a_v_and_valid", "zero_bubble_v", 1),
        Check("zero_bubble_v_within_bounds_on_random_cases_and_value_errors", "zero_bubble_v", 1),
        Check("backward_input_matches_autograd", "backward_input", 1),
        Check("backward_input_keeps_only_what_the_weights_need", "backward_input", 1),
        Check("backward_weight_delayed_and_reordered_matches_autograd", "backward_weight", 1,
              calls="backward_input"),
        Check("run_schedule_gradients_match_one_process", "run_schedule", 2, timeout=150),
        Check("run_schedule_random_valid_schedules", "run_schedule", 1, timeout=150),
        Check("run_schedule_refuses_bad_schedules_before_sending", "run_schedule", 1,
              timeout=150),
        Check("run_schedule_timelines", "run_schedule", 1, timeout=150),
        Check("run_schedule_speedup_two_cpu_processes", "run_schedule_speedup", 1, timeout=180,
              calls="run_schedule", speed=True),
    ),
    cores_for_speed=2,
    rank_modules=(),
)
