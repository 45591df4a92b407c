"""Assignment 8 through the CLI: the reference scores full, the stubs zero, each planted bug loses
exactly the points of the function it breaks, with a message that names what is wrong; and,
without processes, the grader's own parts: best_config's hidden cases are decided by more than
float rounding, and the grader trains the notebook's model.

Each function is graded with the reference versions of the parts it calls, so bugs that break
different functions are planted together: one grading run holds a bug in each of the four
functions (train_3d's: the mesh's dimensions in the wrong order). train_3d's other bugs (the
gradients averaged over the world, losses returned on every stage, micro-batch losses not
scaled) are one grading each, ``--only train_3d`` (about 5 s each: the 8 processes start from
the fork server in milliseconds). A pipeline that deadlocks (a gradient never sent back) costs
one launch timeout (60 s: gloo's receives wait for ever), fails train_3d's three checks together,
keeps the cost model's points and leaves no process behind.

Tier: both: reference full marks, stub zero and the grader's parts are quick (one grading
each, or none); planted bugs are full.
"""
from __future__ import annotations

import ast
import inspect
import time
import uuid
from fractions import Fraction

import psutil
import pytest

from conftest import (REPO, assert_grades_full_marks_within, assert_only_these_lose_points,
                      assert_stubs_score_zero, grade, planted_copy, points_by_function)

from autograder.assignments.a8_composition import expected as E
from autograder.assignments.a8_composition import ranks as R

SOURCE = REPO / "solutions" / "a8_composition" / "composition.ipynb"
RELEASE = REPO / "assignments" / "a8_composition" / "composition.ipynb"
#: The budget of one grading of the reference on 2 cores with --speed skip (8 processes).
GRADING_SECONDS = 30

# function -> (text in the reference answer cell, replacement that breaks it)
BUGS = {
    # activations of one micro-batch only, whatever the schedule keeps in flight
    "per_rank_memory": ('        in_flight = m if sched == "gpipe" else min(pp - i, m)\n',
                        "        in_flight = 1\n"),
    # the bubble one stage too long
    "step_time": ("bubble=(pp - 1) * (c + tp_mb)", "bubble=pp * (c + tp_mb)"),
    # a configuration that needs exactly the memory there is does not fit
    "best_config": ('if memory <= hw_cfg["memory"]', 'if memory < hw_cfg["memory"]'),
    # the mesh's dimensions in the wrong order (the coordinates still (pp, dp, tp)'s)
    "train_3d": ('init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))',
                 'init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))'),
}
#: train_3d's other bugs: (the bug(s), each applied in turn; text its failures must hold)
TRAIN_BUGS = {
    "gradients averaged over the world": ([{"train_3d": (
        "            dist.all_reduce(flat, group=dp_group)\n            flat /= dp\n",
        "            dist.all_reduce(flat)\n            flat /= dist.get_world_size()\n")}],
        "an ALLREDUCE on the world group"),
    "losses returned on every stage": ([
        {"train_3d": ("    losses = [] if last else None\n", "    losses = []\n")},
        {"train_3d": ("        if last:\n            if dp > 1:\n"
                      "                dist.all_reduce(total, group=dp_group)\n"
                      "            losses.append(total.item() / dp)\n",
                      "        if dp > 1:\n            dist.all_reduce(total, group=dp_group)\n"
                      "        losses.append(total.item() / dp)\n")}],
        "losses should be None on every stage but the last"),
    "micro-batch losses not scaled": ([{"train_3d": (
        "tgt.reshape(-1)) / micro_batches\n", "tgt.reshape(-1))\n")}],
        "is each micro-batch's loss scaled by 1/micro_batches?"),
}


def write(tmp_path, name, *bugs):
    return planted_copy(SOURCE, tmp_path, name, *bugs)


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    """A8 has no speed check: --speed skip grades every check there is."""
    assert_grades_full_marks_within(SOURCE, GRADING_SECONDS, offline_env)


@pytest.mark.full
@pytest.mark.slow
def test_a_long_tmpdir_changes_no_grade(offline_env, tmp_path):
    """Below a long TMPDIR (a cluster's scratch folder, and folder grading's job folders inside
    it) the fork server's Unix socket would pass the kernel's 107-byte limit: the sandbox's
    worker died loading the notebook and every rank-based check scored 0 (train_3d's 8 points
    here). Its ranks now start by exec there (course.launch.start_method)."""
    deep = tmp_path / ("t" * 70)
    deep.mkdir()
    report = grade(SOURCE, "--speed", "skip", env={**offline_env, "TMPDIR": str(deep)})
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == report["max_score"] == 17, report["stdout"]


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    report = grade(RELEASE, "--speed", "skip", env=offline_env)
    assert_stubs_score_zero(report)


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_functions_points(offline_env, tmp_path):
    """Four bugs in four functions, in one grading run: each loses all of its function's
    points, every other function keeps all of its own, and each failure says what is wrong."""
    report = grade(write(tmp_path, "bugs", BUGS), "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert_only_these_lose_points(report, BUGS)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    assert "['activations']" in failed["per_rank_memory_exact_bytes_of_every_stage"], failed
    assert "['bubble']" in failed["step_time_matches_the_cost_model"], failed
    assert "the best needs exactly that" in failed["best_config_hidden_cases"], failed
    for name in ("pp2_dp2_tp2_on_8_ranks_matches_one_process", "each_mode_on_its_own_group"):
        assert "made a SEND with rank" in failed[f"train_3d_{name}"], failed  # not its neighbour


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("bug", list(TRAIN_BUGS))
def test_train_3d_bugs_lose_its_points_and_are_named(bug, offline_env, tmp_path):
    bugs, named = TRAIN_BUGS[bug]
    report = grade(write(tmp_path, bug, *bugs), "--only", "train_3d", "--speed", "skip",
                   env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert points_by_function(report) == {"train_3d": 0}, report["stdout"]
    assert all(r["status"] == "failed" and named in r["message"] for r in report["results"]), \
        report["results"]


#: stage 1 never sends the gradient of its input back: stage 0 waits in recv for ever
DEADLOCK = {"train_3d": ("dist.send(x.grad.contiguous(), group=pp_group, group_dst=p - 1)",
                         "pass  # the gradient never goes back")}


@pytest.mark.full
@pytest.mark.slow
def test_a_pipeline_deadlock_fails_train_3d_at_once_and_the_rest_is_graded(offline_env,
                                                                            tmp_path):
    """gloo's recv waits without a timeout: the launch's own timeout stops the 8 ranks, all of
    train_3d's checks fail with it (one wait, not three), the cost model keeps its 9 points, and
    no process is left behind."""
    tag = uuid.uuid4().hex
    start = time.monotonic()
    report = grade(write(tmp_path, "deadlock", DEADLOCK), "--speed", "skip",
                   env={**offline_env, "AUTOGRADER_RUN_TAG": tag}, timeout=300)
    seconds = time.monotonic() - start
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert points_by_function(report) == {"per_rank_memory": 3, "step_time": 3,
                                          "best_config": 3, "train_3d": 0}, report["stdout"]
    failed = [r for r in report["results"] if r["function"] == "train_3d"]
    assert len(failed) == 3 and all(r["status"] == "failed" and r["message"] for r in failed)
    assert seconds < 150, f"grading took {seconds:.0f} s"
    time.sleep(0.5)
    left = [p.pid for p in psutil.process_iter() if _tagged(p, tag)]
    assert not left, f"processes left behind: {left}"


def _tagged(process, tag: str) -> bool:
    try:
        return process.environ().get("AUTOGRADER_RUN_TAG") == tag
    except (psutil.Error, OSError):  # gone, or not ours to read
        return False


# ---------------------------------------------------------------------------- the grader's parts

def test_best_config_hidden_cases_are_decided_by_more_than_rounding():
    """In exact arithmetic every fitting configuration's time equals the best's or is at least
    1e-6 (relative) above it: float code in any summation order (within ~1e-15 of exact) and
    math.isclose(rel_tol=1e-9) tie exactly the configurations the grader ties. And the cases
    ask for what the text teaches: binding memory limits (ZeRO-3, checkpointing, pipelining
    and tensor parallelism in the answers), a limit the best meets exactly, one where nothing
    fits, world sizes 8, 16 and 64 on nodes of 2, 4 and 8."""
    seen = set()
    for label, model, hw, world in E.BEST_CASES:
        fits = E.fitting(model, hw, world)
        if not fits:
            assert E.best_config(model, hw, world) is None
            seen.add("nothing fits")
            continue
        best = min(t for t, _, _ in fits)
        close = [(float((t - best) / best), par) for t, _, par in fits
                 if t != best and t - best < Fraction(1, 10**6) * best]
        assert not close, (label, close[:3])
        answer = E.best_config(model, hw, world)
        memory = max(E.per_rank_memory(model, answer)["total"])
        seen |= {k for k, ok in (("zero 3", answer["zero"] == 3), ("checkpoint",
                 answer["checkpoint"]), ("pp", answer["pp"] > 1), ("tp", answer["tp"] > 1),
                 ("exact limit", memory == hw["memory"]),
                 ("binds", E.best_config(model, dict(hw, memory=1 << 62), world) != answer))
                 if ok}
        seen |= {f"world {world}", f"node {hw['node_size']}"}
    assert seen >= {"nothing fits", "zero 3", "checkpoint", "pp", "tp", "exact limit", "binds",
                    "world 8", "world 16", "world 64", "node 2", "node 4", "node 8"}, seen


def test_the_graders_model_is_the_notebooks():
    """ranks.py trains (and expected.py's truth uses) a copy of the release's set-up cell's
    TinyGPT: the same classes, statement for statement."""
    from autograder.notebook import runnable_cells

    ((_, setup),) = runnable_cells(RELEASE, ["setup"])
    theirs = {n.name: ast.dump(n) for n in ast.parse(setup).body if isinstance(n, ast.ClassDef)}
    ours = {n.name: ast.dump(n) for n in ast.parse(inspect.getsource(R)).body
            if isinstance(n, ast.ClassDef) and n.name in R.GRADER_CLASSES}
    assert set(R.GRADER_CLASSES) <= set(theirs)
    for name in R.GRADER_CLASSES:
        assert ours[name] == theirs[name], f"ranks.py's {name} differs from the notebook's"
