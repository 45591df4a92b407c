"""Assignment 9 through the CLI: the reference scores full (with the answer key, and without it
every public point with the hidden check reserved), the stubs zero, each planted bug loses
exactly the checks that judge what it breaks, and a hang costs one timeout (the grader's own
parts, without a grading: tests/test_a9_parts.py).

Planted bugs (one grading, with the key; different functions): a diagnosis that ignores the waits
(the smallest seq across groups, the rule the text had before) (diagnose's fixed, hidden and
recorded checks; its ValueError point kept), a save
that removes the older checkpoints before it writes the new one (both kill checks, which save
with keep=1; the round trip and the check of keep kept), a restart that does not restore the noise
generator's state (train_resumable's bitwise and across-world-size checks; the samples read are
right), and an async save that aliases the live
tensors instead of staging a copy (its correctness check; its speed check is not run with
``--speed skip``); train_resumable and async_save run with the submission's own
save_checkpoint, whose bug costs them nothing more here. Two more gradings: a save_checkpoint
that hangs (``--only`` the checkpoint functions: train_resumable and async_save would hang on
it too), then, speed measured, a restart of train_resumable that deadlocks (one timeout each,
no process left, diagnose keeps its points) and an async save that waits for its own writer
(the speed point). A third,
``--only train_resumable``: a sampler that restarts at the epoch's start after a restart (all
three of its checks); two more: what the text leaves free (a strided split of the batches,
torch's global generator seeded before and after ``model_fn()``) keeps 6/6, and the noise drawn
from torch's global generator instead of the text's loses exactly the across-world-size check.
A fourth, ``--only save_checkpoint,load_latest``: a save that never
commits (every checkpoint check, each naming what it expected). Three more of Part 2 and Part 4
alone: lesson 17's atomic write pasted as save_checkpoint with a glob loader (only the check of
keep and damage: what the lesson does not show), a save without fsync (only the kills at each
file-system call, naming the file), an async save whose saves share one temporary name (its
correctness check, with two saves pending). (A commit through a ``Path.touch()`` marker earns
full marks in tests/independent/a9_resilience.py.)

Tier: both: reference full marks (speed measured, and without the key) and stub zero are quick;
the planted bugs and the hang are full.
"""
from __future__ import annotations

import time

import nbformat
import pytest

from conftest import (REPO, assert_full_marks, assert_only_these_checks_fail,
                      assert_public_points_without_the_key, assert_stubs_score_zero, grade,
                      grade_id, grade_leaving_nothing, planted_copy, points_by_function)

from autograder.assignments.a9_resilience.spec import SPEC

SOURCE = REPO / "solutions" / "a9_resilience" / "resilience.ipynb"
RELEASE = REPO / "assignments" / "a9_resilience" / "resilience.ipynb"
#: The budget of one grading of the reference on 2 cores with --speed skip.
GRADING_SECONDS = 30

BUGS = {
    # the waits ignored: the smallest seq across groups, which blames a victim
    "diagnose": ("    roots = [g for g in firsts if not waits(g)] or list(firsts)\n",
                 "    roots = list(firsts)\n"),
    # the older checkpoints removed before the new one is written: a kill leaves none
    "save_checkpoint": ("    directory.mkdir(parents=True, exist_ok=True)\n", """\
    directory.mkdir(parents=True, exist_ok=True)
    for old in sorted(directory.glob("checkpoint-*.pt"))[:1 - keep or None]:
        old.unlink()
"""),
}
BUGS_FAIL = {"diagnose_fixed_cases", "diagnose_hidden_random_traces",
             "diagnose_planted_faults_recorded_on_gloo",
             "checkpoint_survives_kills_at_each_file_system_call",
             "checkpoint_survives_kills_at_random_moments",
             "train_resumable_matches_an_uninterrupted_run_on_one_world_size_bitwise",
             "train_resumable_across_world_sizes_matches_one_process",
             "async_save_holds_the_state_of_its_step"}
#: the background writer saves the live tensors, which training changes meanwhile
ALIAS_BUG = {"async_save": ("""    staged = {key: value.detach().clone() if isinstance(value, torch.Tensor)
              else copy.deepcopy(value) for key, value in state.items()}""",
                            "    staged = state  # the live tensors, not a copy")}
#: an "asynchronous" save that waits for its own writer
BLOCKING_BUG = {"async_save": ("    thread.start()\n    return pending",
                               "    thread.start()\n    thread.join()\n    return pending")}
#: a restart without the noise generator's state: it starts again from the seed
RNG_BUG = {"train_resumable": ('        noise_rng.set_state(state["noise_rng"])\n',
                               "        pass  # the noise generator starts again\n")}
#: after a restart, the data starts again at the epoch's first batch
SAMPLER_BUG = {"train_resumable": (
    "        epoch, k = divmod(step, per_epoch)",
    "        epoch, k = step // per_epoch, (step - start) % per_epoch")}
#: the noise drawn from torch's global generator, seeded before model_fn() (which draws from
#: it): other noise than the text's generator gives, restored exactly after a restart
GLOBAL_NOISE = {"train_resumable": ("    noise_rng = torch.Generator().manual_seed(seed)\n",
                                    "    noise_rng = torch.manual_seed(seed)  # the global one\n")}
#: what the text leaves free: a strided split of each batch among the ranks, and torch's global
#: generator seeded before and after model_fn()
STRIDED = {"train_resumable": ("    mine = slice(rank * share, (rank + 1) * share)",
                               "    mine = slice(rank, batch_size, world)")}
SEEDED_AROUND = {"train_resumable": ("    model = model_fn()\n", "    torch.manual_seed(seed + 1)\n"
                                     "    model = model_fn()\n    torch.manual_seed(12345)\n")}
#: a restart that deadlocks: every rank waits for a mark nobody writes, deaf to SIGTERM (no
#: collective is pending, so no group timeout ends it: only the launcher's)
DEADLOCK = {"train_resumable": ('        noise_rng.set_state(state["noise_rng"])\n', """\
        noise_rng.set_state(state["noise_rng"])
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while not os.path.exists(os.path.join(directory, f"checked-{start}")):
            time.sleep(0.05)
""")}
#: written, flushed, never committed: nothing ever looks complete
NEVER_COMMITS = {"save_checkpoint": (
    '    os.replace(temporary, directory / f"checkpoint-{step:012d}-{digest}.pt")   # the commit\n',
    "    pass  # the commit forgotten\n")}
#: written and committed, never flushed
NO_FSYNC = {"save_checkpoint": ("        f.flush()\n        os.fsync(f.fileno())\n",
                                "        f.flush()\n")}
#: every save writes to the same temporary name: two pending saves write into one file
SHARED_TEMPORARY = {"save_checkpoint": (
    'temporary = directory / f"incomplete-{step}-{uuid.uuid4().hex}.tmp"',
    'temporary = directory / "incomplete.tmp"')}
#: lesson 17 cell 17's write_both, its atomic half, pasted as save_checkpoint (files named by
#: step), with a glob loader: what the lesson shows earns less than Part 2's 5 points
LESSON_SAVE = """\
import io


def save_checkpoint(directory, state, step, keep=2):
    path = Path(directory) / f"step-{step:09d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"step": step, "state": state}, buffer)
    data, chunk = buffer.getvalue(), 64 * 1024
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as atomic:
        for start in range(0, len(data), chunk):
            atomic.write(data[start:start + chunk])
            atomic.flush()
        atomic.flush()
        os.fsync(atomic.fileno())                            # the bytes are on the disk ...
    os.replace(temporary, path)                              # ... before the name points at them
    directory = os.open(path.parent, os.O_RDONLY)
    os.fsync(directory)                                      # and the rename itself is durable
    os.close(directory)
"""
GLOB_LOAD = """\
def load_latest(directory, state):
    done = sorted(Path(directory).glob("step-*.pt"))
    if not done:
        return None
    saved = torch.load(done[-1], weights_only=False)
    state.update(saved["state"])
    return saved["step"]
"""
#: a save that never returns, and leaves a process that ignores SIGTERM behind
HANG = {"save_checkpoint": ("    directory = Path(directory)\n    directory.mkdir", """\
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c",
                      "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(3600)"])
    while True:
        time.sleep(0.1)
    directory = Path(directory)
    directory.mkdir""")}


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    """Speed measured: the reference's async save blocks well under half of a 64 MB save (42
    of 369 ms measured; skipped with the reason where a whole save takes under 30 ms)."""
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    took = time.monotonic() - start
    print(report["stdout"])
    assert_full_marks(report)
    assert took < GRADING_SECONDS, f"grading took {took:.1f} s"


@pytest.mark.slow
def test_reference_earns_every_public_point_without_the_key(offline_env):
    report = assert_public_points_without_the_key(SOURCE, offline_env)
    assert report["score"] == 19
    assert {c.name for c in SPEC.checks if c.hidden} == {"diagnose_hidden_random_traces"}


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    assert_stubs_score_zero(grade(RELEASE, "--speed", "skip", env=offline_env))


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_checks(offline_env, tmp_path):
    # run seed 1: the hidden check's traces (seed 288545018, the run's first draw) include 7
    # cases where the waits decide (some are at each of the first 500 seeds, measured)
    report = grade(planted_copy(SOURCE, tmp_path, "bugs", BUGS, RNG_BUG, ALIAS_BUG), "--speed",
                   "skip",
                   "--seed", "1", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, BUGS_FAIL,
                                  skipped_with_reason={c.name for c in SPEC.checks if c.speed})
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "'seq': 2, 'kind': 'missing', 'ranks': [3]} (recorded" in failed[
        "diagnose_planted_faults_recorded_on_gloo"], failed  # lesson 17's hang
    for name in ("each_file_system_call", "random_moments"):
        assert "load_latest" in failed[f"checkpoint_survives_kills_at_{name}"], failed
    assert "the uninterrupted run on as many ranks had" in failed[
        "train_resumable_matches_an_uninterrupted_run_on_one_world_size_bitwise"], failed


@pytest.mark.full
@pytest.mark.slow
def test_a_hang_a_deadlocked_restart_and_a_blocking_async_save(offline_env, tmp_path):
    """Two gradings (train_resumable and async_save run with the submission's own
    save_checkpoint, so a save that hangs would hang them too: confirmed by a grading of the
    three bugs together). First, ``--only save_checkpoint,load_latest``: save_checkpoint never
    returns and starts a process that ignores SIGTERM (the round trip times out once, 15 s, the
    kill checks fail at once with it). Then, speed measured, beside a correct save: every rank
    of train_resumable's first restart waits forever, deaf to SIGTERM (that run is stopped after
    60 s, the job after it is not started: its three checks fail, naming the hang); an async
    save that waits for its own writer (its correctness points kept, the speed point lost, or
    skipped with the reason where a save is too short to tell). diagnose and the checkpoint
    functions keep their points, and neither grading leaves a process or a file behind."""
    report = grade_leaving_nothing(planted_copy(SOURCE, tmp_path, "hang", HANG), "--only",
                                    "save_checkpoint,load_latest", env=offline_env,
                                    seconds=15 + GRADING_SECONDS, prefix="a9-")
    assert points_by_function(report) == {"load_latest": 0, "save_checkpoint": 0}, \
        report["stdout"]
    assert all("timed out" in r["message"] for r in report["results"]), report["stdout"]

    report = grade_leaving_nothing(planted_copy(SOURCE, tmp_path, "deadlock", DEADLOCK,
                                                 BLOCKING_BUG), env=offline_env,
                                    seconds=60 + 2 * GRADING_SECONDS, prefix="a9-")
    results = {r["name"]: r for r in report["results"]}
    speed = results.pop("async_save_returns_before_the_save_is_written")
    assert speed["status"] == "failed" or "too short to tell" in speed["message"], speed
    assert points_by_function(report) == {"diagnose": 8, "load_latest": 1,
                                          "save_checkpoint": 4, "train_resumable": 0,
                                          "async_save": 2, "async_save_speedup": 0}, \
        report["stdout"]
    for r in results.values():
        if r["function"] == "train_resumable":
            assert "still running after 60 s" in r["message"] or "not run: run 2" in r[
                "message"], r
    assert "not run: run 2" in results[
        "train_resumable_across_world_sizes_matches_one_process"]["message"]


@pytest.mark.full
@pytest.mark.slow
def test_a_sampler_that_restarts_at_the_epochs_start(offline_env, tmp_path):
    """After a restart the data start again at the epoch's first batch: every train_resumable
    check fails, and the sample check names the samples read and the text's global_batch."""
    report = grade(planted_copy(SOURCE, tmp_path, "sampler", SAMPLER_BUG), "--only",
                   "train_resumable", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    results = {r["name"]: r for r in report["results"]}
    assert {r["function"] for r in results.values()} == {"train_resumable"}, results
    assert len(results) == 3 and all(r["status"] == "failed" and r["points"] == 0
                                     for r in results.values()), report["stdout"]
    assert "global_batch(" in results[
        "train_resumable_reads_each_sample_once_in_the_stated_order"]["message"]


@pytest.mark.full
@pytest.mark.slow
def test_what_the_text_leaves_free_keeps_full_marks_and_the_global_generator_does_not(
        offline_env, tmp_path):
    """Two gradings ``--only train_resumable``. Each batch split among the ranks strided
    (rank r reads rows r, r + W, ...), with torch's global generator seeded before and after
    model_fn(): 6/6. The noise drawn from torch's global generator seeded before model_fn()
    (which seeds it again and draws the weights from it), its state saved and restored: the
    text says the noise comes from torch.Generator().manual_seed(seed), so the noise differs
    from one process's (that check fails, naming the generator), while a restart on as many
    ranks is still bitwise and every step still reads its batch (those 4 points kept)."""
    report = grade(planted_copy(SOURCE, tmp_path, "free", STRIDED, SEEDED_AROUND), "--only",
                   "train_resumable", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert points_by_function(report) == {"train_resumable": 6}, report["stdout"]
    report = grade(planted_copy(SOURCE, tmp_path, "global", GLOBAL_NOISE), "--only",
                   "train_resumable", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(
        report, {"train_resumable_across_world_sizes_matches_one_process"})
    assert len(report["results"]) == 3, report["stdout"]
    (failed,) = [r["message"] for r in report["results"] if r["status"] == "failed"]
    assert "torch.Generator().manual_seed(seed)" in failed, failed


@pytest.mark.full
@pytest.mark.slow
def test_a_save_that_never_commits(offline_env, tmp_path):
    """The temporary file written and flushed, never renamed: every checkpoint check fails
    (load_latest finds nothing to load), each saying what it expected."""
    report = grade(planted_copy(SOURCE, tmp_path, "commit", NEVER_COMMITS), "--only",
                   "save_checkpoint,load_latest", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert points_by_function(report) == {"load_latest": 0, "save_checkpoint": 0}, \
        report["stdout"]
    for r in report["results"]:
        assert r["status"] == "failed" and "None" in r["message"], r


@pytest.mark.full
@pytest.mark.slow
def test_the_lessons_atomic_write_earns_less_than_part_2(offline_env, tmp_path):
    """Lesson 17's write-then-rename, files named by step, a loader that takes the last by
    name: every kill survived, the commit found, every file flushed; it keeps every checkpoint
    and would load a damaged one, so the check of keep and damage fails (4 of 5 points)."""
    nb = nbformat.read(SOURCE, as_version=4)
    for cell in nb.cells:
        if grade_id(cell) in ("save_checkpoint", "load_latest") and cell.cell_type == "code":
            cell.source = LESSON_SAVE if grade_id(cell) == "save_checkpoint" else GLOB_LOAD
    report, failed = _only_the_keep_check_fails(nb, tmp_path / "lesson.ipynb", offline_env)
    assert report["score"] == 4, report["stdout"]
    assert "expected less than 3 times" in failed["message"], failed


def _only_the_keep_check_fails(nb, path, env):
    """``nb`` graded on Part 2 alone: only the check of keep and damage fails; the report and
    that check's result."""
    nbformat.write(nb, path)
    report = grade(path, "--only", "save_checkpoint,load_latest", "--speed", "skip", env=env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, {"checkpoint_keeps_the_last_k_and_skips_a_damaged_one"})
    return report, next(r for r in report["results"] if r["status"] == "failed")


@pytest.mark.full
@pytest.mark.slow
def test_a_loader_that_checks_only_its_manifest_loads_a_damaged_tensor_file(offline_env,
                                                                             tmp_path):
    """tests/independent's checkpoint folder (one file per tensor, a sealed manifest of their
    hashes) with its loader checking only the manifest's seal: damaging all of step 5's files
    at once breaks the seal and hides the bug; damaging the tensor's file alone does not (found
    by a held-out solution of this kind, whose bug lost nothing before)."""
    from test_independent_solutions import answers_of, paste_answers

    answers = answers_of("a9_resilience")
    check = ('                if _blake(data) != item["blake2b"]:\n'
             '                    return None\n')
    assert check in answers["load_latest"] + answers["save_checkpoint"]
    answers = {k: v.replace(check, "") for k, v in answers.items()}
    nb = nbformat.read(RELEASE, as_version=4)
    paste_answers(nb, answers)
    _, failed = _only_the_keep_check_fails(nb, tmp_path / "manifest_only.ipynb", offline_env)
    assert "alone (a file step 5's save created or changed)" in failed["message"], failed


@pytest.mark.full
@pytest.mark.slow
def test_a_save_without_fsync_and_saves_sharing_a_temporary_name(offline_env, tmp_path):
    """Two gradings. The reference without its file's fsync: only the kills at each
    file-system call fail, naming the file not flushed. Every save writing to one temporary
    name: Part 2's checks pass (one save at a time), async_save's correctness fails with two
    saves pending (the first save's rename finds its file gone: deterministic)."""
    report = grade(planted_copy(SOURCE, tmp_path, "fsync", NO_FSYNC), "--only",
                   "save_checkpoint,load_latest", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, {"checkpoint_survives_kills_at_each_file_system_call"})
    failed = next(r for r in report["results"] if r["status"] == "failed")
    assert "without flushing 'checkpoint-000000000002-" in failed["message"], failed

    report = grade(planted_copy(SOURCE, tmp_path, "shared", SHARED_TEMPORARY), "--only",
                   "save_checkpoint,load_latest,async_save", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, {"async_save_holds_the_state_of_its_step"})
    failed = next(r for r in report["results"] if r["status"] == "failed")
    assert "wait() of the first async_save (step 2) raised FileNotFoundError" in failed[
        "message"], failed
