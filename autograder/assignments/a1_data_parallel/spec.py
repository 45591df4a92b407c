"""Assignment 1, data parallel from scratch: the contract with the grader."""
from autograder.checking.spec import Check, Function, Spec

#: Seconds per call for functions that take milliseconds (uncalibrated): a hang costs little.
QUICK = 10.0

SPEC = Spec(
    assignment="a1_data_parallel",
    functions=(
        Function("copy_params", ("params", "device")),
        Function("allreduce", ("data",)),
        Function("split_batch", ("X", "y", "devices")),
        Function("split_batch_weighted", ("X", "y", "devices", "weights")),
        Function("train_batch", ("X", "y", "device_params", "devices", "lr"),
                 helpers=("split_batch", "allreduce")),
    ),
    checks=(
        Check("copy_params_values_device_grad", "copy_params", 1, timeout=QUICK),
        Check("copy_params_new_tensors_inputs_untouched", "copy_params", 1, timeout=QUICK),
        Check("allreduce_two_devices", "allreduce", 1, timeout=QUICK),
        Check("allreduce_one_and_many_devices", "allreduce", 1, timeout=QUICK),
        Check("allreduce_dtypes_and_shapes", "allreduce", 1, timeout=QUICK),
        Check("split_batch_even", "split_batch", 1, timeout=QUICK),
        Check("split_batch_uneven", "split_batch", 1, timeout=QUICK),
        Check("split_batch_weighted_proportional", "split_batch_weighted", 1, timeout=QUICK),
        Check("split_batch_weighted_rounding", "split_batch_weighted", 1, timeout=QUICK),
        Check("train_batch_matches_single_device_sgd", "train_batch", 2),
        Check("train_batch_one_device", "train_batch", 1),
        Check("train_batch_three_devices_uneven_batch", "train_batch", 1),
        Check("train_batch_speedup_two_gpus", "train_batch_speedup", 2, timeout=120,
              calls="train_batch", speed=True),
    ),
    cores_for_speed=1,
    gpus_for_speed=2,
)
