"""Checks for Assignment 2: DDP and collectives.

Graded functions (see the notebook for their specifications): ``average_gradients``,
``ring_allreduce`` (with its bandwidth), ``make_dataloader`` and ``train_ddp`` (with its
weak-scaling speedup). Each ``test_*`` runs here, in the grader: a probe (``probes.py``) starts
the student's function on N fresh processes (what each runs is in ``ranks.py``) and describes
what came back; the check computes the expectation itself (one-process SGD in float64, sums)
from the same seeds, and judges. Points and call timeouts: ``spec.py``.

``train_ddp`` runs with the student's own ``make_dataloader`` (and ``average_gradients``, if it
calls it): nothing of the reference solution enters a sandbox that runs student code. A failure
says when ``make_dataloader`` is wrong too.

The speed checks keep ranks up (:class:`~autograder.checking.ranks.RankServer`) on both sides
(:func:`~autograder.checking.speed.timed_rounds`):
the student's, in the student's sandbox, and the reference solution's, in a sandbox of its own
(:func:`~autograder.checking.speed.reference_sandbox`) whose processes never ran student code.
The grader times each command from its own process, in rounds that alternate between the two
(:func:`~autograder.checking.speed.judge_rounds`), then checks that the timed code ran as
often as the grader asked (its ranks count the commands they completed) and that its results
were right. Each speedup's baseline (``dist.all_reduce``; one process training) is timed in the
reference's ranks only (:func:`~autograder.checking.speed.against_trusted_baseline`): student
code cannot slow it to inflate its own speedup.
"""
from __future__ import annotations


import torch

from autograder.checking.expect import (assert_close, assert_close_float32, fresh_generator,
                                        float32_tolerance_of_all, sequence, tensor)
from autograder.checking.harness import skip_unless
from autograder.checking.ranks import probe_server_run
from autograder.checking.speed import (against_trusted_baseline, check_work_done, timed,
                                       timed_rounds, usable_cores)
from course import FULL_RUN
from course.devices import gpu_count

from .expected import judge_training, one_process_sgd
from .loaders import check_loaders
from .probes import probe_average_gradients, probe_ring, probe_train_ddp
from .ranks import WithUnusedParameter, make_data, ring_input, ring_server, seeded_model, train_server
from .spec import SPEC

graded = SPEC.graded
ASSIGNMENT = SPEC.assignment


def can_show_speedup() -> tuple[bool, str]:
    """Two processes can only be faster than one with a core (or a GPU) each."""
    gpus = gpu_count()
    cores = usable_cores()
    return gpus >= 2 or cores >= 2, (
        f"needs 2 GPUs or 2 CPU cores, this machine gives the grader {gpus} GPU(s) and {cores} "
        "core(s): two processes would take turns on one core")



# ---------------------------------------------------------------------------- average_gradients

AVG_WORLD, AVG_STEPS, AVG_BATCH, AVG_LR = 3, 3, 12, 0.5


def _average_gradients_run(student):
    """(the ranks' replies, seed, the expectation) of one 3-process run, shared by both checks."""
    def run():
        _, seed = fresh_generator()
        ranks = student.call(probe_average_gradients, AVG_WORLD, seed, AVG_STEPS, AVG_BATCH,
                             AVG_LR)
        X, y = make_data("mlp", seed + 1, AVG_STEPS * AVG_BATCH)
        batches = [(X[s * AVG_BATCH:(s + 1) * AVG_BATCH], y[s * AVG_BATCH:(s + 1) * AVG_BATCH])
                   for s in range(AVG_STEPS)]
        model = WithUnusedParameter(seeded_model("mlp", seed, rank=0))
        return ranks, seed, one_process_sgd(model, batches, AVG_LR, AVG_WORLD)
    return student.shared("average_gradients", run)


@graded
def test_average_gradients_training_matches_one_process(student):
    ranks, seed, ((want, _), (want32, _)) = _average_gradients_run(student)
    tol = float32_tolerance_of_all(want, want32)  # one training run: one tolerance
    for rank, r in enumerate(ranks):
        params = sequence(r["params"], f"rank {rank}'s parameters", len(want))
        for i, (desc, w, w32) in enumerate(zip(params, want, want32)):
            assert_close_float32(tensor(desc, "parameter")["value"], w, w32,
                                 f"rank {rank}'s parameter {i} after {AVG_STEPS} SGD steps on "
                                 f"{AVG_WORLD} processes with your average_gradients (vs one "
                                 "process on the global batches)", seed=seed, tol=tol)


@graded
def test_average_gradients_averages_and_skips_missing_grads(student):
    ranks, seed, ((_, want), (_, want32)) = _average_gradients_run(student)
    tol = float32_tolerance_of_all(want, want32)  # one backward: one tolerance
    for rank, r in enumerate(ranks):
        grads = sequence(r["grads"], f"rank {rank}'s gradients", len(want))
        for i, (desc, w, w32) in enumerate(zip(grads, want, want32)):
            if w is None:
                assert desc.get("kind") == "plain" and desc.get("value") is None, (
                    f"rank {rank}: a parameter without a gradient (.grad is None) got one; "
                    "skip parameters whose .grad is None")
                continue
            assert_close_float32(tensor(desc, f"rank {rank}'s gradient {i}")["value"], w, w32,
                                 f"rank {rank}'s gradient {i} after average_gradients (vs the "
                                 "gradient of the mean loss over the global batch)", seed=seed,
                                 tol=tol)


# ---------------------------------------------------------------------------- ring_allreduce

F32, F64 = torch.float32, torch.float64
RING_TWO_CASES = [((8,), F32), ((5,), F32), ((3, 7), F32), ((1,), F32), ((1000,), F64),
                  ((100003,), F32)]
# empty, one element, fewer elements than ranks, primes, not divisible, large
RING_AWKWARD_CASES = [((0,), F32), ((1,), F32), ((2,), F64), ((3,), F32), ((13,), F32),
                      ((97,), F64), ((4, 5), F32), ((65537,), F32)]
#: The timed tensor (float32 elements) and the calls of each timed command.
RING_TIMED_NUMEL = (16 << 20) if FULL_RUN else (4 << 20)
RING_CALLS = 3


def _judge_ring_result(r, world_size, seed, shape, dtype, what):
    assert isinstance(r, dict) and isinstance(r.get("collectives"), dict), \
        f"{what}: the probe's reply was tampered with"
    used = {k: v for k, v in r["collectives"].items() if v}
    assert not used, (
        f"{what}: your ring_allreduce called collective operations ({', '.join(sorted(used))}); "
        "use only point-to-point operations (send, recv, isend, irecv, batch_isend_irecv), on "
        "the default process group or any other (they are counted on every group)")
    t = tensor(r["tensor"], f"{what}: the tensor after ring_allreduce")
    expected = sum(ring_input(seed, rank, shape, dtype) for rank in range(world_size))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=1e-12, atol=1e-12)
    assert_close(t["value"], expected, f"{what}: the tensor after ring_allreduce (vs the sum "
                 f"over the {world_size} ranks)", seed=seed, **tol)


def _judge_ring_cases(reply, world_size, seed, cases):
    for rank, r in enumerate(reply["ranks"]):
        for i, ((shape, dtype), case) in enumerate(zip(cases, r["cases"])):
            what = (f"{world_size} process(es), rank {rank}, tensor of shape {tuple(shape)} "
                    f"({str(dtype).removeprefix('torch.')})")
            _judge_ring_result(case, world_size, seed + i, shape, dtype, what)
            assert case["returned_none"], \
                f"{what}: ring_allreduce should work in place and return None"


def _ring_two_processes(student):
    """The 2-process run of the correctness cases (shared by two checks)."""
    def run():
        _, seed = fresh_generator()
        _judge_ring_cases(student.call(probe_ring, 2, seed, RING_TWO_CASES), 2, seed,
                          RING_TWO_CASES)
    return student.shared("ring2", run)


@graded
def test_ring_allreduce_two_processes(student):
    _ring_two_processes(student)


@graded
def test_ring_allreduce_one_three_four_processes_awkward_sizes(student):
    for world_size in (1, 3, 4):
        _, seed = fresh_generator()
        reply = student.call(probe_ring, world_size, seed, RING_AWKWARD_CASES)
        _judge_ring_cases(reply, world_size, seed, RING_AWKWARD_CASES)


def all_reduce_seconds(call) -> float:
    """Seconds of dist.all_reduce on the timed tensor (:data:`RING_CALLS` calls), timed here."""
    return timed(call, probe_server_run, "ring", f"all_reduce-{RING_TIMED_NUMEL}", RING_CALLS)


def ring_seconds(call) -> float:
    """Seconds of the ring on the same tensor in the same kind of ranks, timed here."""
    return timed(call, probe_server_run, "ring", f"ring-{RING_TIMED_NUMEL}", RING_CALLS)


def ring_fraction(i, student_call, reference_call):
    """One round: dist.all_reduce's seconds (in the reference's ranks) over each ring's."""
    return against_trusted_baseline(i, all_reduce_seconds, ring_seconds, student_call,
                                    reference_call)


@graded
def test_ring_allreduce_bandwidth(student):
    _ring_two_processes(student)  # a speed counts only for correct code
    skip_unless(*can_show_speedup())
    _, seed = fresh_generator()
    sizes = [RING_TIMED_NUMEL]
    warmup = [f"ring-{RING_TIMED_NUMEL}", f"all_reduce-{RING_TIMED_NUMEL}"]

    def verify(results, sent):  # the ring that was timed ran every time it was asked to,
        ranks = results["ring"]    # summed right, with point-to-point only
        assert isinstance(ranks, list) and len(ranks) == 2 and all(
            isinstance(r, dict) and isinstance(r.get("calls"), list) and len(r["calls"]) == 1
            for r in ranks), "the timed ranks' reply was tampered with"
        check_work_done([r["calls"][0] for r in ranks], sent("ring", f"ring-{RING_TIMED_NUMEL}"),
                        "the timed ring_allreduce", "ring_allreduce calls")
        for rank, r in enumerate(ranks):
            tensors = r.get("tensors")
            assert isinstance(tensors, list) and len(tensors) == 1, \
                "the timed ranks' reply was tampered with"
            _judge_ring_result({"tensor": tensors[0], "collectives": r.get("collectives")}, 2,
                               seed, (RING_TIMED_NUMEL,), F32,
                               f"the timed ring_allreduce, rank {rank}")

    # The reference ring follows the text's steps plainly (one message per chunk and step, a
    # new receive buffer and a new copy of the chunk it sends at every step), in ranks where
    # every large block comes fresh from the system (ranks.fresh_large_blocks): per round,
    # 0.17x to 0.56x of all_reduce's speed (median 0.39x) on a 2-core machine at load 2 to 4,
    # 0.10x to 0.37x (median 0.17x) at load 9 to 12. The student edition, with no reference,
    # asks for 0.1x; a reference ring below 0.1x itself means the machine's timings cannot tell
    # a good ring from a poor one (SKIP).
    timed_rounds(student, ASSIGNMENT,
                 [("ring", "ring_allreduce", ring_server, 2, (seed, sizes), None, warmup)],
                 ring_fraction, verify,
                 what=f"ring_allreduce speed as a fraction of dist.all_reduce's "
                      f"({RING_TIMED_NUMEL >> 20}M float32 on 2 processes)",
                 fixed_threshold=0.1, reference_minimum=0.1,
                 processes=None if gpu_count() >= 2 else 2)


# ---------------------------------------------------------------------------- make_dataloader

@graded
def test_make_dataloader_disjoint_shards_cover_the_data(student):
    _, seed = fresh_generator()
    cases = [(24, 2, 5, seed, [0]), (24, 3, 4, seed, [0]), (10, 3, 2, seed, [0]),
             (7, 4, 3, seed, [0]), (13, 1, 4, seed, [0]), (3, 4, 2, seed, [0])]
    check_loaders(student, cases)


@graded
def test_make_dataloader_new_order_each_epoch(student):
    _, seed = fresh_generator()
    other = (seed + 12345) % (2 ** 31)
    cases = [(40, 2, 8, seed, [0, 1, 0, 2]), (40, 2, 8, other, [0]), (25, 3, 4, seed, [0, 1])]
    orders = check_loaders(student, cases)
    e0, e1, e0_again, e2 = orders[0]
    case = "make_dataloader(dataset of 40, batch_size=8, rank, world_size=2, seed)"
    assert e0 != e1 and e1 != e2 and e0 != e2, (
        f"{case}: two of set_epoch(0), set_epoch(1) and set_epoch(2) gave the same order; "
        "every epoch should shuffle anew")
    assert e0 == e0_again, (f"{case}: set_epoch(0) twice gave two different orders; the order "
                            "must depend only on the seed and the epoch, so that every rank "
                            "computes the same shuffle")
    assert e0 != orders[1][0], f"{case}: two different seeds gave the same order"
    assert any(o != sorted(o) for o in e0), f"{case}: the examples are not shuffled"
    assert orders[2][0] != orders[2][1], \
        "make_dataloader(dataset of 25, ..., world_size=3, ...): epochs 0 and 1 gave the same order"


# ---------------------------------------------------------------------------- train_ddp

#: The runs on 2 processes and 1 (the speedup): every process trains SCALING_EPOCHS x
#: SCALING_STEPS steps of SCALING_BATCH examples of a small CNN per call.
SCALING_BATCH, SCALING_STEPS, SCALING_EPOCHS, SCALING_LR = 256, 2, 2, 0.05
#: The run on 3 processes: a small MLP, 2 epochs of 2 steps of 8 examples per process.
TRAIN_BATCH, TRAIN_STEPS, TRAIN_EPOCHS, TRAIN_LR = 8, 2, 2, 0.2


def scaling_backend() -> str:
    return "nccl" if gpu_count() >= 2 else "gloo"


def scaling_args(world_size: int, seed: int) -> tuple:
    """``(kind, seed, n, epochs, batch, lr)`` of the CNN runs: weak scaling, every process
    trains on as many examples whatever their count."""
    return ("cnn", seed, world_size * SCALING_BATCH * SCALING_STEPS, SCALING_EPOCHS,
            SCALING_BATCH, SCALING_LR)


def _with_helpers_named(student, run):
    """``run()``; where it fails, the message adds that train_ddp ran with the student's own
    make_dataloader and average_gradients, and what is wrong with make_dataloader if anything
    is (checked on a small case: one call, no processes)."""
    return student.with_own_helpers("train_ddp", ("make_dataloader",), run,
                                    lambda: _helpers_note(student), uses="reads its data with your")


def _helpers_note(student) -> str:
    _, seed = fresh_generator()
    try:
        check_loaders(student, [(24, 3, 4, seed, [0, 1])])
    except AssertionError as exc:
        return ("train_ddp runs with your own make_dataloader, and it is wrong: "
                f"{str(exc).splitlines()[0].rstrip(': ')} (fix it first; its checks say more)")
    return ("(train_ddp runs with your own make_dataloader and average_gradients, if it "
            "calls it; your make_dataloader passed a small case here)")


def _train_two_processes(student) -> int:
    """train_ddp on 2 processes, judged (shared by two checks); returns its seed."""
    def run():
        _, seed = fresh_generator()
        args = scaling_args(2, seed)
        reply = student.call(probe_train_ddp, 2, *args, scaling_backend())
        judge_training(reply["ranks"], 2, *args, "train_ddp on 2 processes")
        return seed
    return student.shared("train2", lambda: _with_helpers_named(student, run))


@graded
def test_train_ddp_two_processes_match_one(student):
    _train_two_processes(student)


@graded
def test_train_ddp_three_processes_match_one(student):
    def run():
        _, seed = fresh_generator()
        args = ("mlp", seed, 3 * TRAIN_BATCH * TRAIN_STEPS, TRAIN_EPOCHS, TRAIN_BATCH, TRAIN_LR)
        reply = student.call(probe_train_ddp, 3, *args)
        judge_training(reply["ranks"], 3, *args, "train_ddp on 3 processes")
    _with_helpers_named(student, run)


def one_process_seconds(call) -> float:
    """Seconds of train_ddp on 1 process (the reference's, in its own sandbox), timed here."""
    return timed(call, probe_server_run, "train1", "train")


def seconds_per_process(call) -> float:
    """Seconds of train_ddp on 2 processes, each training as many examples as the one process
    above, per process: examples per second on 1 over this is the weak-scaling speedup."""
    return timed(call, probe_server_run, "train2", "train") / 2


def weak_scaling(i, student_call, reference_call):
    """One round: the reference's one-process time (timed in its sandbox, which never ran
    student code) over each side's two-process time per process. A student's speedup is never
    measured against their own one-process run, which they could pad; in the student edition,
    with no reference, it is (a self-check against a fixed threshold)."""
    return against_trusted_baseline(i, one_process_seconds, seconds_per_process, student_call,
                                    reference_call)


@graded
def test_train_ddp_weak_scaling_two_processes(student):
    # a speedup counts only for correct code; the timed runs use the same inputs as the
    # check on 2 processes, so that the same expectation serves both
    seed = _train_two_processes(student)
    skip_unless(*can_show_speedup())
    servers = [(f"train{w}", "train_ddp", train_server, w, scaling_args(w, seed),
                scaling_backend(), ["warmup"]) for w in (1, 2)]

    def verify(results, sent):  # the timed runs ran every time they were asked to and trained
        for w in (1, 2):           # right (the one process: in the student edition)
            key, what = f"train{w}", f"the timed train_ddp on {w} process(es)"
            if key in results:
                ranks = results[key]
                assert isinstance(ranks, list) and len(ranks) == w and all(
                    isinstance(r, dict) for r in ranks), f"{what}: reply tampered with"
                check_work_done([r.get("trained") for r in ranks], sent(key, "train"), what,
                                "train_ddp calls")
                judge_training(ranks, w, *scaling_args(w, seed), what)

    where = "2 GPUs" if gpu_count() >= 2 else "2 CPU processes, one thread each,"
    # below 1.25x for the reference, 80% of it would not even ask 2 processes to beat 1: the
    # machine (cores taken by other work) cannot show weak scaling (SKIP)
    timed_rounds(student, ASSIGNMENT, servers, weak_scaling, verify, reference_only=("train1",),
                 what=f"train_ddp weak scaling: examples per second on {where} vs the "
                      f"reference solution's on 1 ({SCALING_BATCH} examples per process per "
                      "step)",
                 fixed_threshold=1.25, reference_minimum=1.25,
                 processes=None if gpu_count() >= 2 else 2, max_rounds=9)
