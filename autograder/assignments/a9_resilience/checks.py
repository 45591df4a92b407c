"""Checks for Assignment 9: when things go wrong.

``diagnose``: public fixed cases (their expected values are data, public_cases.json), the
ValueError cases, the grader's own planted faults recorded from real gloo runs (:mod:`.faults`:
the expected diagnosis follows from the fault it planted) and, with the instructor's answer key
(``hidden=True``), random traces compared with the key's reference. The recording starts in a
background thread as this module is collected, in the grader's process, and is awaited by the
check that needs it.

``save_checkpoint``/``load_latest`` (probes: :mod:`.saving`; judgements: :mod:`.judging`): a
round trip; saves killed with SIGKILL before and after each file-system call (one of which
must be the commit; the unkilled save must have flushed every file it leaves), after seeded
random delays, and cut off mid-write by a file-size limit: every kill must leave the latest
complete checkpoint loadable (step 1 or step 2, with exactly that step's values), and the next
save must work; five saves with keep=2 (less than 3 checkpoints' bytes left), then the files of
the newest saves damaged: never a crash, never other values than a step saved.

``train_resumable``: three jobs (uninterrupted; killed and restarted on as many ranks; killed,
restarted on another number and killed again) run once and shared by its three checks: bitwise
against the uninterrupted job, float64 against one process, and the samples each step read.
``async_save``: its state changed right after the call while its writer is held, and two saves
pending at once (the first one's writer held); its speed counts only when that check passes, and is timed here, from round trips into the sandbox
(how long async_save blocks, how long until wait() returns), for saves that must all be made,
the last of them loaded back exactly. ``train_resumable`` and ``async_save`` run with the
student's own ``save_checkpoint`` and ``load_latest`` (as in the student's self-check), and the
saved state is read back with that ``load_latest``. Points: spec.py.
"""
from __future__ import annotations

import contextlib
import random
import time

import torch

from autograder.checking.expect import fresh_generator
from autograder.checking.harness import skip_unless
from autograder.checking.speed import check_work_done
from autograder.keys import answer_key

from . import expected as E
from . import faults
from .judging import (judge_commit, judge_flushes, judge_keep, judge_load, judge_overlap,
                      judge_trials, value)
from .probes import (probe_async, probe_async_begin, probe_async_end, probe_async_overlap,
                     probe_async_start, probe_async_wait, probe_diagnose, probe_diagnose_errors,
                     probe_resumable)
from .saving import probe_commit_kills, probe_keep, probe_random_kills, probe_round_trip
from .spec import SPEC

graded = SPEC.graded
faults.start_in_background()
#: floats in the big tensor of the randomly killed saves (1 MB: a save takes milliseconds)
RANDOM_NUMEL = 250_000


def _key():
    key = answer_key(SPEC.assignment)
    assert key is not None, "the answer key is absent: this check should have been skipped"
    return key


def _seed() -> int:
    _, seed = fresh_generator()
    return seed


def _show(per_rank) -> str:
    """Each rank's calls on one line (for a failure's message)."""
    lines = []
    for rank, trace in enumerate(per_rank):
        calls = ", ".join(f"group {e['group']} {e['members']}#{e['seq']} {e['op']}{e['shapes']}"
                          + (f" peer {e['peer']}" if e["peer"] is not None else "")
                          + ("" if e["state"] == "completed" else " (started)") for e in trace)
        lines.append(f"  rank {rank}: {calls or '(no calls)'}")
    return "\n".join(lines)


def _judge_diagnoses(replies, cases, wants, where):
    assert isinstance(replies, list) and len(replies) == len(cases), "the reply was tampered with"
    for (what, traces), reply, want in zip(cases, replies, wants):
        assert isinstance(reply, dict), "the reply was tampered with"
        if "error" in reply:
            raise AssertionError(f"diagnose raised {reply['error']} for {what} ({where}):\n"
                                 + _show(traces))
        got = reply["result"]
        if want is None:
            assert got.get("t") == "None", (
                f"diagnose should return None for {what} ({where}); got {value(got)}:\n"
                + _show(traces))
            continue
        assert got.get("t") == "dict" and list(got.get("keys", [])) == ["str"] * len(got["v"]) \
            and set(got["v"]) == set(want), (
                f"diagnose should return a dict with exactly the keys {sorted(want)} for {what}; "
                f"got {value(got)}")
        found = value(got)
        assert found == want, (f"diagnose is {found} for {what}; expected {want} ({where}):\n"
                               + _show(traces))


@graded
def test_diagnose_fixed_cases(student):
    cases = E.public_cases()["diagnose"]
    pairs = [(c["what"], c["traces"]) for c in cases]
    replies = student.call(probe_diagnose, [t for _, t in pairs])
    _judge_diagnoses(replies, pairs, [c["expected"] for c in cases],
                     "a public case: public_cases.json")


@graded
def test_diagnose_value_errors(student):
    errors = student.call(probe_diagnose_errors, [t for _, t in E.BAD_TRACES])
    assert isinstance(errors, list) and len(errors) == len(E.BAD_TRACES), \
        "the reply was tampered with"
    for (why, _), error in zip(E.BAD_TRACES, errors):
        assert error == "ValueError", f"diagnose with {why} should raise ValueError; got {error}"


@graded
def test_diagnose_hidden_random_traces(student):
    key, seed = _key(), _seed()
    cases = [(f"a random trace (case {i}, seed {seed})", t)
             for i, t in enumerate(key.hidden_traces(random.Random(seed)))]
    replies = student.call(probe_diagnose, [t for _, t in cases])
    _judge_diagnoses(replies, cases, [key.diagnose(t) for _, t in cases], "hidden")


# ---------------------------------------------------------------------------- checkpoints

@graded
def test_checkpoint_round_trip(student):
    seed = _seed()
    reply = student.call(probe_round_trip, seed)
    assert isinstance(reply, dict), "the reply was tampered with"
    for where in ("missing", "empty"):
        judge_load(reply[where], seed, [], f"({where} folder)", or_none=True)
    judge_load(reply["latest"], seed, [3], "after saving steps 1, 2 and 3")


@graded
def test_checkpoint_survives_kills_at_each_file_system_call(student):
    seed = _seed()
    trials = student.call(probe_commit_kills, seed)
    judge_trials(trials, seed, 1000)
    judge_commit(trials)
    judge_flushes(trials[0])


@graded
def test_checkpoint_survives_kills_at_random_moments(student):
    seed = _seed()
    judge_trials(student.call(probe_random_kills, seed, RANDOM_NUMEL), seed, RANDOM_NUMEL)


@graded
def test_checkpoint_keeps_the_last_k_and_skips_a_damaged_one(student):
    seed = _seed()
    judge_keep(student.call(probe_keep, seed, RANDOM_NUMEL), seed, RANDOM_NUMEL)


# ---------------------------------------------------------------------------- train_resumable

EPS = torch.finfo(torch.float64).eps
#: Across world sizes, float64 (derived in the text): a step's loss and each gradient entry sum
#: B = 6 terms, grouped otherwise by W ranks; two groupings differ by at most (B - 1) eps
#: sum|terms| <= 15 ulps a step here (sum|terms| <= 2.9 over 1000 seeds); made at every step with
#: one sign, carried through 10 steps of momentum SGD: <= 39 ulps (the same seeds; the sums as
#: 2, 3 or 6 ranks group them stray by 4). The bugs caught move a loss by 1e-4 or more.
ULPS = 4096
ONE_PROCESS = ("one float64 process computing the text's steps on the whole global batch "
               "(global_batch, noise from torch.Generator().manual_seed(seed), momentum SGD)")


def _kill_plan(seed):
    """Three jobs: uninterrupted on 2 ranks; on 2 ranks killed once (a random rank, at step 4
    or 5) and restarted on 2; killed on 2, restarted on 3 and killed again (at step 7 or 8),
    restarted on 2."""
    g = random.Random(seed)
    first, second = g.choice([4, 5]), g.choice([7, 8])
    return [[(2, None)],
            [(2, (g.randrange(2), first)), (2, None)],
            [(2, (g.randrange(2), first)), (3, (g.randrange(3), second)), (2, None)]]


def _jobs(student):
    def run():
        seed = _seed()
        jobs = _kill_plan(seed)
        reply = student.call(probe_resumable, seed, jobs)
        assert isinstance(reply, list) and len(reply) == len(jobs), "the reply was tampered with"
        return seed, jobs, reply
    return student.shared("train_resumable", run)


def _label(job) -> str:
    parts = []
    for world, kill in job:
        parts.append(f"{world} ranks" + (f" (rank {kill[0]} killed after step {kill[1]})"
                                         if kill else ""))
    return " -> ".join(parts)


def _history(job, reply):
    """``{step: (loss, ids of every rank)}``: each step from the last run in which every rank
    logged it; a failure if a run without a planned kill failed, or any run hung."""
    where = f"train_resumable on {_label(job)}"
    assert "not_run" not in reply, f"{where}: {reply.get('not_run')}"
    for run, (spec, got) in enumerate(zip(job, reply["runs"])):
        if got["error"] and (spec[1] is None or got.get("timed_out")):
            raise AssertionError(f"{where}: run {run + 1} failed: {got['error']}")
    assert len(reply["runs"]) == len(job) and reply["state"] is not None, \
        f"{where}: the last run did not finish"
    history = {}
    for run, (world, _) in enumerate(job):
        logs = reply["logs"].get(run, {})
        steps = [{line["step"]: line for line in logs.get(r, [])} for r in range(world)]
        for step in set().union(*steps):
            if all(step in s for s in steps):
                lines = [s[step] for s in steps]
                losses = {repr(line["loss"]) for line in lines}
                assert len(losses) == 1, (f"{where}, run {run + 1}: the ranks logged different "
                                          f"losses for step {step}: {sorted(losses)}")
                history[step] = (lines[0]["loss"], sorted(i for line in lines for i in line["ids"]))
    from . import ranks as R
    assert sorted(history) == list(range(R.STEPS)), (
        f"{where}: log(step, loss) was called for the steps {sorted(history)} by every rank; "
        f"expected 0 to {R.STEPS - 1}")
    return history


def _judge_state(state, want, where, exact):
    assert isinstance(state, dict) and "error" not in state and set(state) == set(want), (
        f"{where}: train_resumable should return the model's state_dict; got "
        f"{state.get('error') if isinstance(state, dict) and 'error' in state else sorted(state)}")
    for name, w in want.items():
        got = state[name]
        assert isinstance(got, torch.Tensor) and got.shape == w.shape and got.dtype == w.dtype, \
            f"{where}: {name} is not a {w.dtype} tensor of shape {tuple(w.shape)}"
        if exact:
            assert torch.equal(got, w), (f"{where}: the final {name} differs from the "
                                         "uninterrupted run's (bitwise, same world size)")
        else:
            err, tol = (got - w).abs().max().item(), ULPS * EPS * max(1.0, w.abs().max().item())
            assert err <= tol, (f"{where}: the final {name} differs by {err:.3g} from that of "
                                f"{ONE_PROCESS} (allowed: {tol:.3g}, {ULPS} ulps)")


def _judge_losses(history, want, where, exact):
    for step, w in enumerate(want):
        v = history[step][0]
        assert type(v) is float, f"{where}: the loss logged for step {step} is not a float: {v}"
        ok = v == w if exact else abs(v - w) <= ULPS * EPS * max(1.0, abs(w))
        assert ok, (f"{where}: the loss of step {step} is {v!r}; "
                    + ("the uninterrupted run on as many ranks had " if exact else
                       f"{ONE_PROCESS} had ") + f"{w!r}"
                    + ("" if exact else f" ({ULPS} ulps of max(1, |loss|) allowed)"))


@graded
def test_train_resumable_matches_an_uninterrupted_run_on_one_world_size_bitwise(student):
    seed, jobs, reply = _jobs(student)
    plain_run = _history(jobs[0], reply[0])
    where = f"train_resumable on {_label(jobs[1])}"
    killed = _history(jobs[1], reply[1])
    _judge_losses(killed, [plain_run[s][0] for s in sorted(plain_run)], where, exact=True)
    _judge_state(reply[1]["state"], reply[0]["state"], where, exact=True)


@graded
def test_train_resumable_across_world_sizes_matches_one_process(student):
    seed, jobs, reply = _jobs(student)
    want_losses, want_state = E.one_process_training(seed)
    for job, got in ((jobs[0], reply[0]), (jobs[2], reply[2])):
        where = f"train_resumable on {_label(job)}"
        _judge_losses(_history(job, got), want_losses, where, exact=False)
        _judge_state(got["state"], want_state, where, exact=False)


@graded
def test_train_resumable_reads_each_sample_once_in_the_stated_order(student):
    from . import ranks as R

    seed, jobs, reply = _jobs(student)
    for job, got in zip(jobs, reply):
        history = _history(job, got)
        for step, (_, ids) in sorted(history.items()):
            want = sorted(E.batch_ids(seed, step))
            assert ids == want, (
                f"train_resumable on {_label(job)}: step {step} read the samples {ids} (all "
                f"ranks, sorted); global_batch({seed}, {step}, {R.SAMPLES}, {R.BATCH}) holds "
                f"{want}, each to be read once, by one rank, before log({step}, ...)")


# ---------------------------------------------------------------------------- async_save

#: float32s of the state the speed check saves (64 MB): a write long enough to see
ASYNC_NUMEL = 16_000_000
#: the speed check SKIPs where one whole save takes less than this (nothing to tell apart)
ASYNC_MINIMUM = 0.03


def _async_correct(student):
    """The correctness run, shared by both checks (a speed counts only for a correct save)."""
    def run():
        seed = _seed()
        reply = student.call(probe_async, seed, RANDOM_NUMEL)
        assert isinstance(reply, dict), "the reply was tampered with"
        if "error" in reply:
            raise AssertionError(reply["error"])
        judge_load(reply["loaded"], seed, [2], "after async_save of step 2, the state "
                   "changed in place right after it returned (the writer held until then), "
                   "and wait()", RANDOM_NUMEL)
        judge_overlap(student.call(probe_async_overlap, seed, RANDOM_NUMEL), seed, RANDOM_NUMEL)
    return student.shared("async_save", run)



@graded
def test_async_save_holds_the_state_of_its_step(student):
    _async_correct(student)


#: timed saves (steps 1, 2, 3 into one folder): their medians are judged
ASYNC_ROUNDS = 3


def _timed_saves(student) -> list[tuple[float, float]]:
    """``[(seconds async_save blocked, seconds until wait() returned)]`` of each timed save,
    measured here (round trips into the sandbox), after checking that the sandbox did the work
    timed: every timed call made its save, and the last one loads back exactly (a timed call
    that returned without its save fails here, before any SKIP)."""
    seed, times, reply = _seed(), [], None
    try:
        for step in range(1, ASYNC_ROUNDS + 1):
            student.call(probe_async_begin, seed, step, ASYNC_NUMEL)
            start = time.perf_counter()
            problem = student.call(probe_async_start)
            blocked = time.perf_counter() - start
            if problem is not None:
                raise AssertionError(problem if isinstance(problem, str)
                                     else "the reply was tampered with")
            student.call(probe_async_wait)
            times.append((blocked, time.perf_counter() - start))
        reply = student.call(probe_async_end, ASYNC_NUMEL)
    finally:
        if reply is None and student.sandbox.alive():  # a failure left its folder behind
            with contextlib.suppress(AssertionError):
                student.call(probe_async_end)
    assert isinstance(reply, dict) and "loaded" in reply, "the reply was tampered with"
    check_work_done([reply.get("saves")], ASYNC_ROUNDS, "the timed async_save", "saves")
    judge_load(reply["loaded"], seed, [ASYNC_ROUNDS], f"after the {ASYNC_ROUNDS} timed saves",
                ASYNC_NUMEL)
    return times


@graded
def test_async_save_returns_before_the_save_is_written(student):
    try:
        _async_correct(student)
    except AssertionError as exc:
        raise AssertionError(f"not counted: async_save is not correct ({exc})") from None
    times = _timed_saves(student)
    blocked = sorted(b for b, _ in times)[1]
    total = sorted(t for _, t in times)[1]
    skip_unless(total >= ASYNC_MINIMUM,
                f"a whole save of 64 MB took {1000 * total:.0f} ms here: too short to tell the "
                "time async_save blocks from the time it writes")
    assert blocked <= 0.5 * total, (
        f"async_save blocked for {1000 * blocked:.0f} ms of a {1000 * total:.0f} ms save "
        "(median of 3): it should return once the state is staged, at most half of it")
    print(f"async_save blocked {1000 * blocked:.0f} ms of a {1000 * total:.0f} ms save")


# ---------------------------------------------------------------------------- last: its
# recording (started as this module was collected) ran meanwhile

@graded
def test_diagnose_planted_faults_recorded_on_gloo(student):
    recorded = faults.recorded()
    cases = [(what, recorded[name]) for name, what, _ in faults.SCENARIOS]
    replies = student.call(probe_diagnose, [t for _, t in cases])
    _judge_diagnoses(replies, cases, [faults.expected(want, recorded[name])
                                      for name, _, want in faults.SCENARIOS],
                     f"recorded from {faults.WORLD} gloo processes")
