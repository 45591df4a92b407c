"""BucketedDDP's speed check, in the grader: the time of one training step (forward, backward,
``finish_gradient_synchronization()``) on 2 CPU processes, the student's against the
reference's, measured side by side in interleaved rounds
(:func:`~autograder.checking.speed.timed_rounds`; ranks: :func:`~.ddp_ranks.ddp_server`).

The model is latency-bound: many small parameters, so that a step's time goes to the fixed cost
of each message and of each small operation, not to bytes. A trusted baseline, one blocking
all-reduce per parameter after backward, is timed in the reference's sandbox only (never beside
student code). Each side's figure is its speedup over that baseline; the student passes at 80%
of the reference's, which is the reference's step time over the student's. Where the reference
itself does not beat the baseline by :data:`REFERENCE_MINIMUM` in the same run, this machine
cannot show what bucketing buys and the check SKIPs; before that, the timed ranks must have run
every step the grader asked for, the last with the right gradients.
"""
from __future__ import annotations


from autograder.checking.expect import assert_close, fresh_generator, sequence, tensor
from autograder.checking.harness import skip_unless
from autograder.checking.ranks import probe_server_run
from autograder.checking.speed import (against_trusted_baseline, check_work_done, timed,
                                       timed_rounds, usable_cores)

from . import expected
from .ddp_ranks import ddp_server
from .spec import SPEC

#: (width, depth, unused parameter): 80 parameters of 256 or 16 float64 elements; with
#: SPEED_BUCKET_BYTES, 6 buckets. Each rank's share of the fixed batch; steps per timed call.
SPEED_SHAPE, SPEED_BUCKET_BYTES, SPEED_PER_RANK, SPEED_STEPS = (16, 40, False), 16384, 4, 3
#: How many buckets assign_buckets makes of them, as the text says (for the check's messages;
#: a test of the grader's compares it with the answer key's).
SPEED_BUCKETS = 6
#: The reference's speedup over the baseline below which the machine cannot judge (SKIP), and
#: the student edition's fixed bar (80% of that minimum: no reference to compare with there).
REFERENCE_MINIMUM, FIXED_THRESHOLD = 1.5, 1.2


def step_seconds(call) -> float:
    """Seconds of SPEED_STEPS steps with the sandbox's BucketedDDP, timed here."""
    return timed(call, probe_server_run, "ddp", "step", SPEED_STEPS)


def per_parameter_seconds(call) -> float:
    """Seconds of as many steps with one all-reduce per parameter (the trusted baseline)."""
    return timed(call, probe_server_run, "ddp", "per_parameter", SPEED_STEPS)


def judge_step_time(student) -> None:
    """Pass, fail or SKIP the student's step time against the reference's; the timed ranks'
    gradients must equal the full-batch gradient in one process (a speed counts only for
    correct code)."""
    cores = usable_cores()
    skip_unless(cores >= 2, "the timed step runs on 2 processes, which need 2 or more CPU cores "
                            f"to run at once; this machine gives the grader {cores}")
    _, seed = fresh_generator()
    args = (seed, SPEED_SHAPE, SPEED_PER_RANK, SPEED_BUCKET_BYTES)
    servers = [("ddp", "BucketedDDP", ddp_server, 2, args, "gloo", ["step", "per_parameter"])]
    (want, *_), numels = expected.one_process_ddp(seed, SPEED_SHAPE, 1, SPEED_PER_RANK, 2, 0.0)

    def verify(results, sent):  # every timed step ran, and the last one's gradients are right
        ranks = results["ddp"]
        assert isinstance(ranks, list) and len(ranks) == 2 and all(
            isinstance(r, dict) for r in ranks), "the timed ranks' reply was tampered with"
        check_work_done([r.get("steps") for r in ranks], sent("ddp", "step"),
                        "the timed BucketedDDP")
        for rank, r in enumerate(ranks):
            where = f"the timed BucketedDDP, rank {rank}"
            grads = sequence(r.get("grads") if isinstance(r, dict) else None,
                             f"{where}: the gradients", len(want))
            for j, (d, w) in enumerate(zip(grads, want)):
                assert_close(tensor(d, f"{where}: gradient {j}")["value"], w,
                             f"{where}: gradient {j} after its last timed step (vs the full-batch "
                             "gradient in one process)", rtol=1e-9, atol=1e-12, seed=seed)

    timed_rounds(student, SPEC.assignment, servers,
                 lambda i, mine, ref: against_trusted_baseline(i, per_parameter_seconds,
                                                               step_seconds, mine, ref),
                 verify,
                 what=f"BucketedDDP step time on a latency-bound model ({len(numels)} float64 "
                      f"parameters in {SPEED_BUCKETS} buckets, 2 CPU processes), as a speedup "
                      "over one all-reduce per parameter",
                 fixed_threshold=FIXED_THRESHOLD, reference_minimum=REFERENCE_MINIMUM,
                 processes=2, max_rounds=9)
