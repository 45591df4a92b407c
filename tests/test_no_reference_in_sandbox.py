"""No text of ``solutions/`` (the reference notebooks, the answer keys) reaches a sandbox that
runs student code (issue 39: a submission once sent the reference's cells, which the grader had
put into its sandbox, back out in an error message).

For A3-A10, each assignment's reference notebook is graded with ``--only`` functions that call
other graded functions (where the grader once sent the reference's versions of those along),
in one process whose student sandboxes record everything sent to them: the cells they load,
the pickled objects, and every probe's arguments. The cells must be the submission's own
(trusted set-up cells and its answer cells, nothing added); the objects and the probes'
arguments must hold no line of a reference answer cell that the released notebook does not
also have, no line of an answer key, and nothing compiled from the reference
(``<reference ...>`` code) or loaded from a key (``autograder_answer_keys``). A speed check's
reference sandbox (which never runs student code) is not recorded: it is not the harness's.

Tier: full (eight gradings of one or two functions each in one process: 15-30 s on 2 cores,
over the quick tier's 20 s budget per test when the machine is busy).
"""
from __future__ import annotations

import pytest

from sandbox_records import leaks, record_gradings, solution_lines

#: (assignment, the functions graded: each calls other graded functions)
GRADED = [
    ("a3_model_pipeline", "bubble_fraction,split_into_stages"),
    ("a4_sharding", "ShardedLinear,BucketedDDP"),
    ("a5_tensor_parallel", "ParallelMLP"),
    ("a6_context_parallel", "ring_attention"),
    ("a7_expert_parallel", "MoELayer"),
    ("a8_composition", "best_config"),
    ("a9_resilience", "async_save"),
    ("a10_pipeline_schedules", "run_schedule"),  # it runs the student's own generators
]

@pytest.mark.full
@pytest.mark.slow
def test_no_solution_text_reaches_a_student_sandbox(offline_env, tmp_path):
    from autograder.registry import ASSIGNMENTS, get

    lines = solution_lines(ASSIGNMENTS)
    assert len(lines) > 500, len(lines)  # the reference answers and keys were read
    jobs = {a: [str(get(a).source), only, "skip", a] for a, only in GRADED}
    got = record_gradings(jobs, offline_env, tmp_path, timeout=600)
    for assignment, only in GRADED:  # each grading ran its checks and passed them
        report = got["reports"][assignment]
        assert report["code"] == 0 and report["results"], (assignment, report)
        assert {r["function"].removesuffix("_speedup") for r in report["results"]} == \
            set(only.split(",")), (assignment, report["results"])
        assert all(r["status"] != "failed" for r in report["results"]), report["results"]
    found = leaks(got, lines)
    assert not found, f"{len(found)} line(s) of solutions/ sent to a student sandbox: {found[:5]}"
