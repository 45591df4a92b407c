"""Assignment 2, DDP and collectives: the contract with the grader.

Per-call timeouts: each is several times what the reference takes on a busy 2-core machine
(process start-up included), so that a hung call fails in a minute or two, not ten.
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a2_ddp",
    functions=(
        Function("average_gradients", ("model",)),
        Function("ring_allreduce", ("tensor",)),
        Function("make_dataloader", ("dataset", "batch_size", "rank", "world_size", "seed")),
        Function("train_ddp", ("rank", "world_size", "model_fn", "dataset", "epochs",
                               "batch_size", "lr", "seed"),
                 helpers=("make_dataloader", "average_gradients")),
    ),
    checks=(
        Check("average_gradients_training_matches_one_process", "average_gradients", 2,
              timeout=90),
        Check("average_gradients_averages_and_skips_missing_grads", "average_gradients", 1,
              timeout=90),
        Check("ring_allreduce_two_processes", "ring_allreduce", 2, timeout=60),
        Check("ring_allreduce_one_three_four_processes_awkward_sizes", "ring_allreduce", 2,
              timeout=90),
        Check("ring_allreduce_bandwidth", "ring_allreduce", 2, timeout=60, speed=True),
        Check("make_dataloader_disjoint_shards_cover_the_data", "make_dataloader", 2),
        Check("make_dataloader_new_order_each_epoch", "make_dataloader", 1),
        Check("train_ddp_two_processes_match_one", "train_ddp", 2, timeout=120),
        Check("train_ddp_three_processes_match_one", "train_ddp", 1, timeout=90),
        Check("train_ddp_weak_scaling_two_processes", "train_ddp", 2, timeout=90, speed=True),
    ),
    # the speed checks run on NCCL, one GPU a rank, where 2 GPUs are visible (checks.py,
    # scaling_backend), else on 2 gloo processes: a job gets both, so that a notebook graded
    # beside others runs them as it would alone
    cores_for_speed=2,
    gpus_for_speed=2,
    # imported by the ranks' fork server before the submission loads: the ring's counting binds
    # torch's own functions there (ranks.py), out of reach of anything the submission unpickles
    rank_modules=("autograder.assignments.a2_ddp.ranks",),
)
