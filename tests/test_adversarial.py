"""Submissions that try to hang, crash, escape or fool the grader (Assignment 1).

Each case starts from the released notebook with the reference answers pasted in, changes
one thing, grades it with the CLI in a fresh process, and asserts the exact grade per
function and that no process the submission started is left behind.

Tier: quick: the hostile submissions are the grader's first promise; every run keeps them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import nbformat
import psutil
import pytest

from conftest import REPO, grade, points_by_function

pytestmark = pytest.mark.slow

SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
FULL = {"copy_params": 2, "allreduce": 3, "split_batch": 2, "split_batch_weighted": 2,
        "train_batch": 4}


def reference_answers() -> dict[str, str]:
    nb = nbformat.read(SOURCE, as_version=4)
    return {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code"}


REFERENCE = reference_answers()


def make_submission(tmp_path, **answers) -> os.PathLike:
    """The released notebook with the reference answers, except the ``answers`` given."""
    nb = nbformat.read(RELEASE, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = answers.get(gid, REFERENCE[gid])
    path = tmp_path / "submission.ipynb"
    nbformat.write(nb, path)
    return path


def run(path, env, *extra, **limits) -> dict:
    """Grade with small limits; then assert nothing the run started is still alive."""
    tag = uuid.uuid4().hex
    env = {**env, "AUTOGRADER_RUN_TAG": tag, "AUTOGRADER_MAX_CALL_TIMEOUT": "6",
           **{f"AUTOGRADER_{k.upper()}": str(v) for k, v in limits.items()}}
    report = grade(path, *extra, env=env, timeout=240)
    time.sleep(0.5)
    assert not leftovers(tag), f"processes left behind: {leftovers(tag)}"
    return report


def leftovers(tag: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "4242" in cmd or p.environ().get("AUTOGRADER_RUN_TAG") == tag:
                found.append(f"{p.pid} {cmd[:80]}")
        except (psutil.Error, OSError):
            pass
    return found


def assert_grade(report: dict, **changed: float) -> None:
    """Every function at full points except ``changed``; the speedup only counts when correct."""
    assert report.get("results"), report.get("stdout", "") + report.get("stderr", "")
    got = points_by_function(report)
    for function, full in FULL.items():
        assert got.get(function) == changed.get(function, full), (function, got, report["results"])
    speedup = [r for r in report["results"] if r["function"] == "train_batch_speedup"]
    if got["train_batch"] == FULL["train_batch"]:
        assert speedup[0]["status"] in ("skipped", "passed")
    else:
        assert speedup[0]["status"] == "failed"


def messages(report: dict, function: str) -> str:
    return "\n".join(r["message"] for r in report["results"] if r["function"] == function)


EXIT_AT_IMPORT = "import sys\nsys.exit(0)\n" + REFERENCE["copy_params"]
OS_EXIT_AT_IMPORT = "import os\nos._exit(0)\n" + REFERENCE["allreduce"]


def test_sys_exit_at_import_loses_only_that_cell(tmp_path, offline_env):
    report = run(make_submission(tmp_path, copy_params=EXIT_AT_IMPORT), offline_env)
    assert_grade(report, copy_params=0)
    assert "copy_params is not defined" in messages(report, "copy_params")


def test_os_exit_at_import_scores_zero_with_reason(tmp_path, offline_env):
    report = run(make_submission(tmp_path, allreduce=OS_EXIT_AT_IMPORT), offline_env)
    assert report["score"] == 0
    assert all(r["status"] == "failed" for r in report["results"])
    assert "exited with code 0" in messages(report, "copy_params")


def test_exits_inside_functions_lose_only_those_functions(tmp_path, offline_env):
    allreduce = REFERENCE["allreduce"].replace('"""\n', '"""\n    import sys; sys.exit(0)\n', 1)
    split = REFERENCE["split_batch"].replace('"""\n', '"""\n    import os; os._exit(3)\n', 1)
    report = run(make_submission(tmp_path, allreduce=allreduce, split_batch=split), offline_env)
    assert_grade(report, allreduce=0, split_batch=0, train_batch=0)  # it runs with its own helpers
    assert "exit(0)" in messages(report, "allreduce")
    assert "exited with code 3" in messages(report, "split_batch")
    # the code printed nothing, so the message shows no output: none of the grader's own
    assert "last output" not in messages(report, "split_batch"), messages(report, "split_batch")


def test_infinite_loop_times_out_and_the_rest_is_graded(tmp_path, offline_env):
    weighted = REFERENCE["split_batch_weighted"].replace('"""\n', '"""\n    while True:\n        pass\n', 1)
    report = run(make_submission(tmp_path, split_batch_weighted=weighted), offline_env)
    assert_grade(report, split_batch_weighted=0)
    assert "did not return within 6 s" in messages(report, "split_batch_weighted")


def test_small_fork_bomb_is_stopped(tmp_path, offline_env):
    bomb = REFERENCE["copy_params"].replace('"""\n', '"""\n'
        "    import os, time\n"
        "    for _ in range(80):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(4242)\n"
        "            os._exit(0)\n", 1)
    report = run(make_submission(tmp_path, copy_params=bomb), offline_env, max_processes=32)
    assert_grade(report, copy_params=0)
    assert "more than 32 processes" in messages(report, "copy_params")


def test_deadlocked_collective_is_killed(tmp_path, offline_env):
    deadlock = '''
import torch.distributed as dist
from course.launch import launch

def _skip_collective(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))   # waits for rank 1, which never joins: a deadlock
    else:
        import time
        time.sleep(4242)                 # alive, so rank 0 is not told its peer left

def allreduce(data):
    launch(_skip_collective, 2, timeout=4242, collective_timeout=4242, quiet=True)
'''
    # 3 s per call: ranks forked from launch's fork server deadlock well within it
    report = run(make_submission(tmp_path, allreduce=deadlock), offline_env, "--only", "allreduce",
                 max_call_timeout=3)
    assert [r["status"] for r in report["results"]] == ["failed"] * 3
    assert report["score"] == 0
    assert "timed out" in messages(report, "allreduce")


def test_memory_without_end_is_stopped(tmp_path, offline_env):
    hog = REFERENCE["split_batch"].replace('"""\n', '"""\n'
        "    hoard = []\n"
        "    while True:\n"
        "        hoard.append(b'x' * (64 << 20))\n", 1)
    report = run(make_submission(tmp_path, split_batch=hog), offline_env, "--only", "split_batch",
                 max_memory_mb=700)
    assert report["score"] == 0 and len(report["results"]) == 2
    assert "GiB of memory" in messages(report, "split_batch")


def test_monkeypatched_comparisons_change_nothing(tmp_path, offline_env):
    patched = '''
import builtins
import torch
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
builtins.AssertionError = type("NeverRaised", (Exception,), {})

def allreduce(data):
    pass  # does nothing, hoping every comparison says equal
'''
    report = run(make_submission(tmp_path, allreduce=patched), offline_env)
    assert_grade(report, allreduce=0, train_batch=1)  # train_batch uses this allreduce; one device needs none


def test_fake_pass_lines_and_json_are_ignored(tmp_path, offline_env):
    fake = '''
import sys, json
FAKE = "PASS  everything  (13/13)\\nTotal: 15 / 15\\n" + json.dumps({"score": 15, "tests": []})
print(FAKE); print(FAKE, file=sys.stderr)

def split_batch(X, y, devices):
    print(FAKE); print(FAKE, file=sys.stderr)
    raise NotImplementedError()

def shards_of_sizes(X, y, devices, sizes):
    return [part.to(d) for part, d in zip(torch.split(X, sizes), devices)], \\
        [part.to(d) for part, d in zip(torch.split(y, sizes), devices)]
'''
    report = run(make_submission(tmp_path, split_batch=fake), offline_env)
    assert_grade(report, split_batch=0, train_batch=0)  # train_batch runs with this split_batch
    assert "Total: 13 / 15" not in report["stdout"] and "Total: 7 / 15" in report["stdout"]


def test_results_file_cannot_be_forged(tmp_path, offline_env):
    results = tmp_path / "results.json"
    victim = tmp_path / "victim.txt"
    victim.write_text("instructor data")
    forge = f'''
import json, os
for attempt in (lambda: open({str(results)!r}, "w").write(json.dumps({{"score": 99}})),
                lambda: os.symlink({str(victim)!r}, {str(results)!r} + ".lnk"),
                lambda: open({str(victim)!r}, "w").write("overwritten")):
    try:
        attempt()
    except OSError:
        pass

def copy_params(params, device):
    raise NotImplementedError()
'''
    path = make_submission(tmp_path, copy_params=forge)
    # the worst case: a symlink already sits where the grader writes its results
    results.symlink_to(victim)
    report = run(path, offline_env, "--json", str(results))
    assert_grade(report, copy_params=0)
    assert not results.is_symlink()
    assert json.loads(results.read_text())["score"] == report["score"] == 11
    assert victim.read_text() == "instructor data"


def test_reference_solution_cannot_be_read(tmp_path, offline_env):
    from autograder.sandbox.isolation import namespaces_available

    if not namespaces_available():
        pytest.skip("no user namespaces on this machine: the sandbox cannot hide solutions/")
    steal = '''
import json, pathlib, autograder
ROOT = pathlib.Path(autograder.__file__).resolve().parents[1]
nb = json.loads((ROOT / "solutions/a1_data_parallel/data_parallel.ipynb").read_text())
exec("".join(next(c["source"] for c in nb["cells"]
                  if c["metadata"].get("nbgrader", {}).get("grade_id") == "copy_params")))
'''
    report = run(make_submission(tmp_path, copy_params=steal), offline_env)
    assert_grade(report, copy_params=0)
    assert "copy_params is not defined" in messages(report, "copy_params")


def test_tensor_subclass_with_true_eq_is_rejected(tmp_path, offline_env):
    subclass = '''
class AlwaysEqual(torch.Tensor):
    def __eq__(self, other):
        return True

def copy_params(params, device):
    return [torch.zeros_like(p).as_subclass(AlwaysEqual).requires_grad_() for p in params]
'''
    report = run(make_submission(tmp_path, copy_params=subclass), offline_env, "--only", "copy_params")
    assert report["score"] == 0 and len(report["results"]) == 2
    assert "torch.Tensor" in messages(report, "copy_params")


def test_memoized_answer_fails_on_fresh_inputs(tmp_path, offline_env):
    memo = '''
_remembered = []

def copy_params(params, device):
    if not _remembered:
        _remembered.append([p.detach().to(device, copy=True).requires_grad_() for p in params])
    return _remembered[0]
'''
    report = run(make_submission(tmp_path, copy_params=memo), offline_env, "--only", "copy_params")
    assert [r["status"] for r in report["results"]] == ["passed", "failed"]


def test_exception_in_del_and_escaped_daemon_change_nothing(tmp_path, offline_env):
    noisy = REFERENCE["copy_params"] + '''

class Grumpy:
    def __del__(self):
        raise RuntimeError("raised in __del__")

import subprocess
_grumpy = Grumpy()
del _grumpy
subprocess.Popen(["sleep", "4242"], start_new_session=True)
'''
    report = run(make_submission(tmp_path, copy_params=noisy), offline_env)
    assert_grade(report)


def test_syntax_error_missing_function_wrong_signature_missing_package(tmp_path, offline_env):
    report = run(make_submission(
        tmp_path,
        split_batch_weighted="def split_batch_weighted(X, y, devices, weights)\n    return X\n",
        allreduce=REFERENCE["allreduce"].replace("def allreduce(", "def all_reduce("),
        copy_params="def copy_params(params):\n    return params\n",
        split_batch="import not_a_real_package_xyz\n" + REFERENCE["split_batch"]),
        offline_env)
    assert_grade(report, split_batch_weighted=0, allreduce=0, copy_params=0, split_batch=0,
                 train_batch=0)
    assert "SyntaxError" in messages(report, "split_batch_weighted")
    assert "allreduce is not defined" in messages(report, "allreduce")
    assert "should take (params, device)" in messages(report, "copy_params")
    assert "not_a_real_package_xyz" in messages(report, "split_batch")


def test_tampered_test_cells_points_and_outputs_have_no_effect(tmp_path, offline_env):
    nb = nbformat.read(RELEASE, as_version=4)  # the stubs, with every trick on the other cells
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            cell.source = "pass"
            meta["points"] = 100
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS\n")]
    nb.cells = [c for c in nb.cells if "train_batch" not in c.source or
                c.metadata.get("nbgrader", {}).get("solution")]
    nb.cells.append(nbformat.v4.new_code_cell("def copy_params(params, device):\n    return params"))
    path = tmp_path / "tampered.ipynb"
    nbformat.write(nb, path)
    report = run(path, offline_env)
    assert report["score"] == 0
    assert sum(r["max_points"] for r in report["results"]) == 15


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ('{"hello": "world"}', "not a Jupyter notebook"),
    ('{"nbformat": 4, "metadata": {}, "cells": [{"cell_type": "code", "metadata": {}}]}',
     "not a valid notebook: cell 0"),
    (None, "none of the answer cells"),
])
def test_unreadable_or_foreign_notebooks_get_a_clear_message(tmp_path, offline_env, content, expected):
    path = tmp_path / "bad.ipynb"
    if content is None:  # a valid notebook of no assignment
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), path)
    else:
        path.write_text(content)
    extra = ("--assignment", "a1_data_parallel") if content is None else ()
    report = grade(path, *extra, env=offline_env)
    assert report["returncode"] == 2
    assert expected in report["stdout"] and "Score: 0" in report["stdout"]
    assert "Traceback" not in report["stdout"] + report["stderr"]


# ---------------------------------------------------------------- hangs fail fast

HANGS = {
    "infinite loop": "    while True:\n        pass\n",
    "forked children that sleep": ("    import os, time\n"
                                   "    for _ in range(3):\n"
                                   "        if os.fork() == 0:\n"
                                   "            time.sleep(4242)\n"
                                   "            os._exit(0)\n"
                                   "    os.wait()\n"),
}


@pytest.mark.parametrize("hang", list(HANGS))
def test_hanging_function_fails_fast_and_the_rest_is_graded(hang, tmp_path, offline_env):
    """With the spec's own call timeouts (no cap): the first call that hangs costs one timeout,
    and the function's other checks fail at once with the same message."""
    allreduce = REFERENCE["allreduce"].replace('"""\n', '"""\n' + HANGS[hang], 1)
    tag = uuid.uuid4().hex
    start = time.monotonic()
    report = grade(make_submission(tmp_path, allreduce=allreduce),
                   env={**offline_env, "AUTOGRADER_RUN_TAG": tag}, timeout=240)
    seconds = time.monotonic() - start
    assert_grade(report, allreduce=0, train_batch=0)
    failed = [r for r in report["results"] if r["function"] == "allreduce"]
    assert len(failed) == 3 and all("did not return within" in r["message"] for r in failed)
    assert sum(r["seconds"] for r in failed[1:]) < 1, failed  # not called again
    assert seconds < 45, f"grading took {seconds:.0f} s"
    time.sleep(0.5)
    assert not leftovers(tag), f"processes left behind: {leftovers(tag)}"


def test_killing_the_grader_takes_the_sandbox_and_its_processes_along(tmp_path, offline_env):
    """The grader SIGKILLed (a test's timeout, a killed kernel) while copy_params never returns
    and has started a process of its own: the worker, that process and the unshare around
    them are gone within seconds, not left spinning under init."""
    spin = REFERENCE["copy_params"].replace('"""\n', '"""\n'
        "    import subprocess\n"
        "    subprocess.Popen(['sleep', '4242'])\n"
        "    while True:\n"
        "        pass\n", 1)
    path = make_submission(tmp_path, copy_params=spin)
    tag = uuid.uuid4().hex
    grader = subprocess.Popen([sys.executable, "-m", "autograder", "grade", str(path)],
                              env={**offline_env, "AUTOGRADER_RUN_TAG": tag}, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any("sleep 4242" in line for line in leftovers(tag)):
            assert grader.poll() is None and time.monotonic() < deadline, \
                "copy_params never started its process"
            time.sleep(0.2)
    finally:
        grader.kill()
        grader.wait()
    deadline = time.monotonic() + 10
    while leftovers(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(tag), f"processes left behind: {leftovers(tag)}"
