"""Assignment 3 through the CLI: the reference scores full, the stubs zero, each planted bug
loses exactly the points of the function it breaks (and of that function's speedup, which
counts only for correct code).

Tier: both: reference full marks and stub zero are quick (one grading each); planted bugs are
full.
"""
from __future__ import annotations

import re
import time

import nbformat
import pytest

from conftest import (REPO, assert_full_marks, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, grade_id, plant_bugs)

SOURCE = REPO / "solutions" / "a3_model_pipeline" / "model_pipeline.ipynb"
RELEASE = REPO / "assignments" / "a3_model_pipeline" / "model_pipeline.ipynb"

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # the stages come out in reverse order
    "split_into_stages": ("for (a, b), d in zip(bounds, devices)]",
                          "for (a, b), d in zip(bounds[::-1], devices)]"),
    # the micro-batches are concatenated in the wrong order
    "pipelined_forward": ("    return torch.cat(micro)\n", "    return torch.cat(micro[::-1])\n"),
    # a backward may run on the last stage before its forward
    "one_f_one_b_schedule": ('if i < m and ran("F", i, s) and (s == p - 1',
                             "if i < m and (s == p - 1"),
    # idle steps after the last busy step counted in the makespan
    "bubble_fraction": ("    makespan = busy[-1] + 1\n", "    makespan = len(schedule)\n"),
    # a mean per micro-batch instead of the mean over the whole batch
    "pipeline_train_step": ("loss(out, y_mbs[i].to(device)).sum() / X.shape[0]",
                            "loss(out, y_mbs[i].to(device)).mean()"),
}


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env, timeout=540)
    seconds = time.monotonic() - start
    assert_full_marks(report)
    for r in report["results"]:  # a measured speedup is shown with the reference's, in the same run
        if r["function"].endswith("_speedup") and r["status"] == "passed":
            assert re.search(r": \d+\.\d\dx \(reference \d+\.\d\dx; median of \d+ interleaved "
                             r"rounds\)$", r["message"]), r
    assert seconds < 90, f"grading took {seconds:.1f} s"


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    assert_stubs_score_zero(grade(RELEASE, env=offline_env, timeout=540))


# A function is graded with the submission's own versions of the others it calls (as in the
# student's self-check), and no reference answer calls another graded function, so a grading run
# with several bugs planted is, for each function, the run with its bug alone. Two runs with
# disjoint sets: a check that leaked another function's bug would cost points in the run where
# its own function is correct (model_parallel_forward and gpipe_schedule are correct in both).
BUG_GROUPS = [("split_into_stages", "one_f_one_b_schedule", "pipeline_train_step"),
              ("pipelined_forward", "bubble_fraction")]


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("functions", BUG_GROUPS, ids=["+".join(g) for g in BUG_GROUPS])
def test_planted_bugs_lose_exactly_their_functions_points(functions, offline_env, tmp_path):
    assert sorted(BUGS) == sorted(f for g in BUG_GROUPS for f in g)
    path = tmp_path / "submission.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4),
                              {f: BUGS[f] for f in functions}), path)
    assert_only_these_lose_points(grade(path, env=offline_env, timeout=540), functions)


# ---------------------------------------------------------------- bubble_fraction(schedule)

def reference_functions(*grade_ids: str) -> dict:
    """The reference's answer cells ``grade_ids``, run in one namespace."""
    ns: dict = {}
    for cell in nbformat.read(SOURCE, as_version=4).cells:
        if grade_id(cell) in grade_ids:
            exec(cell.source, ns)
    return ns


def test_bubble_schedules_hold_what_they_say():
    """The bubble_fraction check's schedules: the fixed tables are what they are called (the
    reference's GPipe and 1F1B schedules), the idle slots and makespan stated with each table
    and built into each random schedule are right (recounted here, and the reference agrees),
    and the invalid ones make the reference raise ValueError."""
    import torch

    from autograder.assignments.a3_model_pipeline.schedules import (
        INVALID_SCHEDULES, bubble_tables, random_bubble_case)

    ref = reference_functions("gpipe_schedule", "one_f_one_b_schedule", "bubble_fraction")
    tables = {what: schedule for what, schedule, _, _ in bubble_tables()}
    assert tables["gpipe_schedule(2, 2), Part 4's example"] == ref["gpipe_schedule"](2, 2)
    assert tables["a GPipe schedule of 4 stages and 3 micro-batches"] == ref["gpipe_schedule"](4, 3)
    assert tables["a 1F1B schedule of 3 stages and 5 micro-batches"] == \
        ref["one_f_one_b_schedule"](3, 5)
    cases = bubble_tables() + [random_bubble_case(torch.Generator().manual_seed(seed))
                               for seed in range(300)]
    for what, schedule, idle, makespan in cases:
        p = len(schedule[0])
        assert all(len(step) == p for step in schedule), what
        assert any(e is not None for e in schedule[makespan - 1]), what
        assert all(e is None for step in schedule[makespan:] for e in step), what
        assert sum(e is None for step in schedule[:makespan] for e in step) == idle, what
        assert ref["bubble_fraction"](schedule) == idle / (p * makespan), what
    for what, schedule in INVALID_SCHEDULES:
        with pytest.raises(ValueError):
            ref["bubble_fraction"](schedule)


@pytest.mark.slow
def test_without_a_key_the_reference_earns_every_point_here(offline_env):
    """The student's view (``AUTOGRADER_ANSWER_KEY=absent``): A3 has no hidden checks, so the
    reference earns every point this machine grades, bubble_fraction's included, and nothing
    is reserved for the instructor."""
    from autograder.keys import is_reserved

    report = grade(SOURCE, "--speed", "skip",
                   env={**offline_env, "AUTOGRADER_ANSWER_KEY": "absent"})
    assert_full_marks(report)
    assert not [r for r in report["results"] if is_reserved(r)]
    bubble = [r for r in report["results"] if r["function"] == "bubble_fraction"]
    assert [(r["name"], r["status"], r["points"]) for r in bubble] == [
        ("bubble_fraction_idle_slots_and_invalid_schedules", "passed", 1)]


# answers that follow Part 5's text in other ways (full marks), and ones that do not (zero)
BUBBLE_VARIANTS = {
    "mean_over_stages": (True, "    return idle / (p * makespan)\n",
                         "    return sum(sum(step[s] is None for step in schedule[:makespan]) / "
                         "makespan\n               for s in range(p)) / p\n"),
    "float32_tensor": (True, "    return idle / (p * makespan)\n",
                       "    return torch.tensor([[e is None for e in step] for step in "
                       "schedule[:makespan]],\n                        dtype=torch.float32)"
                       ".mean().item()\n"),
    "leading_idle_steps_dropped": (False, "    makespan = busy[-1] + 1\n    idle = sum(entry "
                                   "is None for step in schedule[:makespan] for entry in step)\n",
                                   "    makespan = busy[-1] + 1 - busy[0]\n    idle = sum(entry "
                                   "is None for step in schedule[busy[0]:busy[-1] + 1] for "
                                   "entry in step)\n"),
    "ragged_steps_accepted": (False, "    if any(len(step) != p for step in schedule):\n",
                              "    if False:\n"),
    "all_idle_returns_one": (False, "    if not busy:\n        raise",
                             "    if not busy:\n        return 1.0\n        raise"),
}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(BUBBLE_VARIANTS))
def test_bubble_fraction_variants(variant, offline_env, tmp_path):
    right, old, new = BUBBLE_VARIANTS[variant]
    path = tmp_path / "submission.ipynb"
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4),
                              {"bubble_fraction": (old, new)}), path)
    report = grade(path, "--speed", "skip", "--only", "bubble_fraction", env=offline_env)
    [result] = [r for r in report["results"] if r["function"] == "bubble_fraction"]
    assert (result["status"], result["points"]) == (("passed", 1) if right else ("failed", 0)), \
        result
