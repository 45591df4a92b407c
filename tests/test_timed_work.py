"""Timed runs must have done the work the grader timed.

A speed check times round trips of probe calls into the student's sandbox, whose Python the
submission controls: a cell can replace a probe (they are looked up by module and name on each
call) with one that returns at once. Each speed check therefore compares the work its timed
ranks report (A3: the state after its steps; A2, A4: the commands completed, which redo the
same work; A9: the async_save calls made, the last save loaded back; A10: the steps run, the last
one's gradients, on inputs that change every step) with what the grader sent,
and fails "the timed run did N ... where the grader asked for M: a timed call returned without
doing its work" otherwise, before it decides to SKIP: on a busy machine, where even the
reference cannot show a speedup, a wrong count still fails (the timed code is then not verified
correct).

Tier: the counting is quick; each grading of a submission that skips its timed work is full.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import nbformat
import pytest

from conftest import REPO, grade, grade_id

#: Each command of ranks that stay up runs once (its untimed first call); every later call
#: returns at once: the timed calls do nothing (A2, A3, A4).
SKIP_REPEATED_COMMANDS = '''

import autograder.checking.ranks as _ranks

_real_run, _ran = _ranks.probe_server_run, set()


def _once_each(ns, key, command, count=1):
    if (key, command) not in _ran:
        _ran.add((key, command))
        _real_run(ns, key, command, count)


_once_each.timed = True
_ranks.probe_server_run = _once_each
'''

#: async_save is never called in the timed runs; wait() only takes the time a save would (A9).
SKIP_TIMED_SAVES = '''

import time as _time

import autograder.assignments.a9_resilience.probes as _probes


class _NothingSaved:
    def wait(self):
        _time.sleep(0.2)


def _start_nothing(ns):
    _probes._TIMED["handle"] = _NothingSaved()


_start_nothing.timed = True
_probes.probe_async_start = _start_nothing
'''

SKIPPED_WORK = "a timed call returned without doing its work"


def cheating(source, tmp_path, cell: str, code: str):
    """The reference ``source`` with ``code`` appended to the answer cell ``cell``."""
    nb = nbformat.read(source, as_version=4)
    answer = next(c for c in nb.cells if c.cell_type == "code" and grade_id(c) == cell)
    answer.source += code
    path = tmp_path / "cheat.ipynb"
    nbformat.write(nb, path)
    return path


def assert_fails_for_skipped_work(report, check: str, did: str, unit: str = "steps"):
    """``check`` FAILED (not skipped, not passed), naming the work done and asked for."""
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    result = next(r for r in report["results"] if r["name"] == check)
    message = result["message"]
    assert result["status"] == "failed" and result["points"] == 0, result
    assert f"the timed run did {did} {unit} where the grader asked for" in message, result
    assert SKIPPED_WORK in message, result


# ---------------------------------------------------------------- the counting, quick

def test_counting_calls_count_the_commands_sent_to_ranks():
    from autograder.checking.ranks import probe_server_run, probe_server_stop
    from autograder.checking.speed import CountingCalls

    seen = []
    call = CountingCalls(lambda probe, *args: seen.append((probe, args)) or "reply")
    assert call(probe_server_run, "k", "pipe") == "reply"
    call(probe_server_run, "k", "step", 3)
    call(probe_server_run, "k", "step", 3)
    call(probe_server_run, "other", "pipe")
    call(probe_server_stop, "k")
    assert len(seen) == 5
    assert (call.sent("k", "pipe"), call.sent("k", "step"), call.sent("other", "pipe"),
            call.sent("k", "base")) == (1, 6, 1, 0)

    def fails(probe, *args):
        raise AssertionError("timed out")
    failing = CountingCalls(fails)
    with pytest.raises(AssertionError):
        failing(probe_server_run, "k", "pipe")
    assert failing.sent("k", "pipe") == 0  # a call that did not return asked for nothing done


def test_check_work_done_names_the_work_done_and_asked_for():
    from autograder.checking.speed import check_work_done

    check_work_done([4, 4], 4, "the timed thing")
    with pytest.raises(AssertionError, match=r"^the timed thing: the timed run did 1 steps where "
                                             r"the grader asked for 4 \(rank 1\): " + SKIPPED_WORK):
        check_work_done([4, 1], 4, "the timed thing")
    with pytest.raises(AssertionError, match="did 0 saves where the grader asked for 3: "):
        check_work_done([0], 3, "the timed async_save", "saves")
    for forged in ([], None, [4.0, 4], ["4"], [True]):
        with pytest.raises(AssertionError, match="tampered"):
            check_work_done(forged, 4, "the timed thing")


def test_a3_timed_run_checks_the_count_before_the_state():
    from autograder.assignments.a3_model_pipeline.expected import check_timed_run

    final = [{"steps": 1, "params": []}, {"steps": 1, "params": []}]
    with pytest.raises(AssertionError, match="did 1 steps where the grader asked for 5"):
        check_timed_run(final, None, 0, 5)


class FakeSandbox:
    """A sandbox's ``call`` that runs nothing: each probe returns ``replies[its name]``."""

    def __init__(self, **replies):
        self.replies = replies
        self.sandbox = SimpleNamespace(alive=lambda: True)

    def call(self, probe, *args):
        return self.replies.get(probe.__name__)


def judge_skipping(one_round, **judging):
    """judge_rounds where even the reference cannot show a speedup: three rounds, then SKIP."""
    from autograder.checking.harness import skip_unless

    for i in range(3):
        one_round(i)
    skip_unless(False, "even the reference solution cannot show a speedup here")


def fake_reference(reference):
    @contextlib.contextmanager
    def reference_sandbox(assignment):
        yield reference.call
    return reference_sandbox


def test_timed_rounds_verify_the_count_before_a_skip(monkeypatch):
    """A2's and A4's speed checks (timed_rounds): the timed calls did nothing, the reference
    cannot show a speedup: FAIL with the counts, not SKIP."""
    from autograder.checking import speed
    from autograder.checking.ranks import probe_server_run

    monkeypatch.setattr(speed, "judge_rounds", judge_skipping)
    monkeypatch.setattr(speed, "reference_sandbox", fake_reference(FakeSandbox()))
    student = FakeSandbox(probe_server_stop=[{"steps": 1}, {"steps": 1}])
    verified = []

    def verify(results, sent):
        verified.append(sent("ddp", "step"))
        speed.check_work_done([r["steps"] for r in results["ddp"]], sent("ddp", "step"),
                              "the timed BucketedDDP")

    with pytest.raises(AssertionError, match="did 1 steps where the grader asked for 10 "):
        speed.timed_rounds(student, "a4_sharding",
                           [("ddp", "BucketedDDP", None, 2, (), "gloo", ["step"])],
                           lambda i, mine, ref: (speed.timed(mine, probe_server_run, "ddp",
                                                             "step", 3), 1.0),
                           verify, what="x", fixed_threshold=1.0, reference_minimum=1.0)
    assert verified == [10]  # the warm-up step and 3 rounds of 3


def test_a3_verifies_the_count_before_a_skip(monkeypatch):
    """A3's speed check: the timed pipe steps did nothing (one step done, the untimed first),
    the reference cannot show a speedup: FAIL with the counts, not SKIP."""
    from autograder.assignments.a3_model_pipeline import checks

    reference = FakeSandbox(probe_server_stop=[{"steps": 4, "params": []}] * 2)
    student = FakeSandbox(probe_server_stop=[{"steps": 1, "params": []}] * 2)
    monkeypatch.setattr(checks, "usable_cores", lambda: 2)
    monkeypatch.setattr(checks, "judge_rounds", judge_skipping)
    monkeypatch.setattr(checks, "reference_sandbox", fake_reference(reference))
    with pytest.raises(AssertionError, match="did 1 steps where the grader asked for 4 "):
        checks.test_pipeline_train_step_speedup_two_cpu_processes(student)


# ---------------------------------------------------------------- gradings, full

@pytest.mark.full
@pytest.mark.slow
def test_a2_timed_ring_and_training_that_skip_their_work_fail(offline_env, tmp_path):
    path = cheating(REPO / "solutions" / "a2_ddp" / "ddp.ipynb", tmp_path, "train_ddp",
                    SKIP_REPEATED_COMMANDS)
    report = grade(path, "--only", "ring_allreduce,train_ddp", env=offline_env, timeout=900)
    # the ring: its warm-up call ran, none of the timed ones did
    assert_fails_for_skipped_work(report, "ring_allreduce_bandwidth", "1", "ring_allreduce calls")
    # weak scaling: the first timed train_ddp ran, none after it
    assert_fails_for_skipped_work(report, "train_ddp_weak_scaling_two_processes", "1",
                                  "train_ddp calls")


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("notebook, function, only, check, timeout", [
    ("a3_model_pipeline/model_pipeline.ipynb", "pipeline_train_step", "pipeline_train_step_speedup",
     "pipeline_train_step_speedup_two_cpu_processes", 600),
    ("a4_sharding/sharding.ipynb", "BucketedDDP", "BucketedDDP",
     "bucketed_ddp_step_time_against_the_reference", 900),
    ("a10_pipeline_schedules/pipeline_schedules.ipynb", "run_schedule", "run_schedule_speedup",
     "run_schedule_speedup_two_cpu_processes", 600),
], ids=["a3", "a4", "a10"])
def test_timed_steps_that_skip_their_work_fail(offline_env, tmp_path, notebook, function, only,
                                               check, timeout):
    path = cheating(REPO / "solutions" / notebook, tmp_path, function, SKIP_REPEATED_COMMANDS)
    report = grade(path, "--only", only, env=offline_env, timeout=timeout)
    # the untimed first (warm-up) step ran, none of the timed ones did
    assert_fails_for_skipped_work(report, check, "1")


@pytest.mark.full
@pytest.mark.slow
def test_a9_timed_saves_that_skip_their_work_fail(offline_env, tmp_path):
    path = cheating(REPO / "solutions" / "a9_resilience" / "resilience.ipynb", tmp_path,
                    "async_save", SKIP_TIMED_SAVES)
    report = grade(path, "--only", "async_save_speedup", env=offline_env, timeout=600)
    assert_fails_for_skipped_work(report, "async_save_returns_before_the_save_is_written", "0",
                                  "saves")


#: run_schedule keeps the gradients of its first call and hands them back at once after it
#: (A10): the timed steps do no pipeline at all.
REPLAY_FIRST_GRADIENTS = '''

_first_run, _kept = run_schedule, {}


def run_schedule(schedule, stages, inputs, targets, loss_fn):
    key = tuple(sorted(stages))
    if key not in _kept:
        timeline = _first_run(schedule, stages, inputs, targets, loss_fn)
        _kept[key] = (timeline, {s: [p.grad.clone() for p in stages[s].parameters()] for s in stages})
    timeline, grads = _kept[key]
    for s, kept in grads.items():
        for p, g in zip(stages[s].parameters(), kept):
            p.grad = g.clone()
    return timeline
'''


@pytest.mark.full
@pytest.mark.slow
def test_a10_timed_steps_that_replay_their_first_gradients_fail(offline_env, tmp_path):
    """The timed run's inputs change every step, so a step replayed from the first one leaves
    wrong gradients, checked after the rounds (even where the speed is then SKIPPED)."""
    path = cheating(REPO / "solutions" / "a10_pipeline_schedules" / "pipeline_schedules.ipynb",
                    tmp_path, "run_schedule", REPLAY_FIRST_GRADIENTS)
    report = grade(path, "--only", "run_schedule_speedup", env=offline_env, timeout=600)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    result = next(r for r in report["results"]
                  if r["name"] == "run_schedule_speedup_two_cpu_processes")
    assert result["status"] == "failed" and result["points"] == 0, result
    assert "wrong gradients after the last step" in result["message"], result
