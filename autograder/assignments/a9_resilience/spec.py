"""Assignment 9, when things go wrong (diagnosing a hang from collective traces, checkpoints
that cannot be half-written): the contract with the grader.

``diagnose`` runs in the sandbox's own process on traces the grader sends: the traces of its own
planted faults, recorded from real gloo runs in the grader's process tree (:mod:`.faults`), and
fixed cases stored as data (public_cases.json); with the instructor's answer key, on hidden
random traces too (``hidden=True``). ``save_checkpoint``/``load_latest`` save in a scratch
folder of the sandbox; the saves that are killed run in children forked from the sandbox's
worker (:mod:`.saving`); ``train_resumable``'s runs on gloo ranks killed and restarted
(:mod:`.ranks`). The one speed check (``async_save`` returns before its save is written) is
timed by the grader, from round trips into the student's sandbox, and counts only if every
timed save completed and the last one loads back exactly. Per-call timeouts are several times
what the reference takes on a busy 2-core machine.
"""
from autograder.checking.spec import Check, Function, Spec

SPEC = Spec(
    assignment="a9_resilience",
    functions=(
        Function("diagnose", ("traces",)),
        Function("save_checkpoint", ("directory", "state", "step", "keep")),
        Function("load_latest", ("directory", "state")),
        Function("train_resumable", ("model_fn", "dataset")),
        Function("async_save", ("directory", "state", "step")),
    ),
    checks=(
        Check("diagnose_fixed_cases", "diagnose", 2, timeout=30),
        Check("diagnose_value_errors", "diagnose", 1, timeout=30),
        Check("diagnose_hidden_random_traces", "diagnose", 2, timeout=30, hidden=True),
        Check("checkpoint_round_trip", "load_latest", 1, timeout=15, calls="save_checkpoint"),
        Check("checkpoint_survives_kills_at_each_file_system_call", "save_checkpoint", 2,
              timeout=60),
        Check("checkpoint_survives_kills_at_random_moments", "save_checkpoint", 1, timeout=60),
        Check("checkpoint_keeps_the_last_k_and_skips_a_damaged_one", "save_checkpoint", 1,
              timeout=60),
        Check("train_resumable_matches_an_uninterrupted_run_on_one_world_size_bitwise",
              "train_resumable", 2, timeout=150),
        Check("train_resumable_across_world_sizes_matches_one_process",
              "train_resumable", 2, timeout=150),
        Check("train_resumable_reads_each_sample_once_in_the_stated_order",
              "train_resumable", 2, timeout=150),
        Check("async_save_holds_the_state_of_its_step", "async_save", 2, timeout=60),
        Check("async_save_returns_before_the_save_is_written", "async_save_speedup", 1,
              timeout=120, calls="async_save", speed=True),
        # last: the grader records its planted faults while the checks above run
        Check("diagnose_planted_faults_recorded_on_gloo", "diagnose", 3, timeout=30),
    ),
    # torch.optim's first step imports torch._dynamo (seconds a rank): once, in the fork server
    rank_modules=("torch._dynamo",),
)
