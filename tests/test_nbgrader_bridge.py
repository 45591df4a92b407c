"""The notebook bridge: check() as a self-check in a kernel. (nbgrader autograde taking its
verdicts from an isolated grading run, so that redefining check() gains nothing, is tested
with the whole instructor flow in test_instructor_flow.py.)

Tier: full: kernels running check() end to end.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.full]

SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"


def execute(nb: nbformat.NotebookNode, env: dict, monkeypatch) -> nbformat.NotebookNode:
    for key in ("COURSE_DATA", "COURSE_OFFLINE", "COURSE_FULL", "MPLBACKEND", "PATH"):
        monkeypatch.setenv(key, env[key])
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(RELEASE.parent)}}).execute()
    return nb


def errors(nb) -> dict:
    return {c.source: o for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"}


def test_reference_notebook_runs_with_its_self_checks_passing(offline_env, monkeypatch):
    solved = execute(nbformat.read(SOURCE, as_version=4), offline_env, monkeypatch)
    assert not errors(solved), errors(solved)  # the experiments ran too, with the reference
    outputs = "".join(o.get("text", "") for c in solved.cells if c.source.startswith("check(")
                      for o in c.outputs)
    assert "copy_params: 2 of 2 checks passed (2/2 points)" in outputs
    assert "SKIP" in outputs  # the speedup, on a machine without 2 GPUs


def test_self_check_fails_a_stub_with_a_readable_message(offline_env, monkeypatch):
    nb = nbformat.read(RELEASE, as_version=4)
    wanted = {"setup", "copy_params", "check_copy_params"}
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") in wanted]
    solved = execute(nb, offline_env, monkeypatch)
    failed = errors(solved)
    assert list(failed) == ['check("copy_params")']
    error = failed['check("copy_params")']
    assert error.ename == "CheckFailed" and error.evalue.startswith(
        "copy_params: 0 of 2 checks passed, 2 failed (0/2 points; inputs from seed ")
    assert error.traceback == [f"CheckFailed: {error.evalue}"]  # no grader frames shown
    shown = "".join(o.get("text", "") for c in solved.cells for o in c.outputs)
    assert shown.count("copy_params is not written yet (it raises NotImplementedError)") == 1


def test_a_skipped_speed_check_earns_nothing_in_nbgrader(monkeypatch):
    """A SKIP earns nothing, whatever its reason: the hardware could not show a speedup, or the
    run was told not to time anything (``--speed skip``); the cell is no error either (its
    result is 0 points). A1's whole release through the bridge and nbgrader's own scoring:
    tests/test_skips_earn_nothing.py."""
    from autograder.integrations.nbgrader_plugin import cell_outputs, skipped_points
    from autograder.results import SKIPPED, SPEED_NOT_MEASURED

    monkeypatch.setenv("AUTOGRADER_SKIPPED", "award")   # the old switch: no longer read
    hardware = {"function": "f", "status": SKIPPED, "max_points": 2.0, "points": 0.0,
                "name": "f_speed", "seconds": 0.0, "message": "needs 2 cores"}
    unrun = dict(hardware, message=SPEED_NOT_MEASURED)
    for skipped in (hardware, unrun):
        assert skipped_points(skipped) == 0.0
        outputs = cell_outputs({"results": [skipped]}, "f", 2.0)
        assert [o.output_type for o in outputs] == ["stream", "execute_result"]
        assert outputs[-1].data["text/plain"] == "0"
        assert skipped["message"] in outputs[0].text and "not given" in outputs[0].text


def test_self_check_sends_cached_helpers_and_torch_ops(offline_env, monkeypatch):
    """check() serialises the kernel's definitions with the launcher's pickler: a
    ``functools.cache`` helper in ``__main__`` and a function that calls ``torch.ops`` reach the
    grader (plain cloudpickle named the first by reference to ``__main__`` and could not pickle
    the second: "cannot pickle '_Ops' object"; issue #32 A and B)."""
    nb = nbformat.read(SOURCE, as_version=4)
    wanted = {"setup", "copy_params", "check_copy_params"}
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") in wanted]
    answer = next(c for c in nb.cells if c.metadata["nbgrader"].get("grade_id") == "copy_params")
    answer.source += ("\n\nimport functools\n\n@functools.cache\ndef cached_helper(n):\n"
                      "    return n + 1\n\ndef ops_helper(x):\n"
                      "    return torch.ops.aten.index_select(x, 0, torch.tensor([0]))\n\n"
                      "_copy_params = copy_params\n\n"
                      "def copy_params(*args, **kwargs):\n"
                      "    assert cached_helper(1) == 2 and ops_helper(torch.arange(3.0)).item() == 0\n"
                      "    return _copy_params(*args, **kwargs)\n")
    solved = execute(nb, offline_env, monkeypatch)
    assert not errors(solved), errors(solved)
    outputs = "".join(o.get("text", "") for c in solved.cells if c.source.startswith("check(")
                      for o in c.outputs)
    assert "copy_params: 2 of 2 checks passed (2/2 points)" in outputs


def test_self_check_without_the_key_says_what_the_instructor_checks(offline_env, monkeypatch):
    """In a student's copy (no answer key; AUTOGRADER_ANSWER_KEY=absent stands in for it) the
    reference's per_rank_memory passes its public checks, and check() says how many points
    were checked here and how many more the instructor's grading checks, without failing."""
    source = REPO / "solutions" / "a8_composition" / "composition.ipynb"
    nb = nbformat.read(source, as_version=4)
    wanted = {"setup", "per_rank_memory", "check_per_rank_memory"}
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") in wanted]
    monkeypatch.setenv("AUTOGRADER_ANSWER_KEY", "absent")
    solved = execute(nb, offline_env, monkeypatch)
    assert not errors(solved), errors(solved)
    outputs = "".join(o.get("text", "") for c in solved.cells if c.source.startswith("check(")
                      for o in c.outputs)
    assert "SKIP" in outputs and "checked when your instructor grades" in outputs, outputs
    assert "more when your instructor grades" in outputs, outputs
    assert "per_rank_memory: 2 of 3 checks passed, 1 hidden (2/2 points here; 1 more when " \
           "your instructor grades)" in outputs, outputs
