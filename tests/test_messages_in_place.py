"""What a student reads, read where it appears: the output area of a ``check(...)`` cell (one
nbclient run of A1's released notebook), the terminal grader's table, nbgrader's feedback cells.

One submission, built from A1's release as a student in the middle of it would have it:
``copy_params`` returns ``nn.Parameter`` objects (a Parameter is a tensor, but the grader takes
plain tensors), ``allreduce`` is still the released stub, ``split_batch`` is written (the
reference's answer), and the speedup check SKIPs (``AUTOGRADER_SPEED=skip``: nothing timed).
Each message must say what is wrong once, in a student's words:

- a stub: which function is not written yet, in the notebook (where the kernel's frames are not
  shown) and in the terminal, never a bare ``NotImplementedError:``;
- an ``nn.Parameter``: that the grader needs a plain tensor, and how to return one, never
  "should be a torch.Tensor, got torch.nn.parameter.Parameter";
- a failure: each reason once (the red ``CheckFailed`` line counts, it does not repeat them);
- a pass: what passed ("split_batch: 2 of 2 checks passed (2/2 points)");
- a SKIP: that it earned nothing;
- hidden checks: claimed only where the assignment has them and the key is absent (A1 has none).

Tier: both: the messages' wording from the grader's own replies is quick; rendered in place,
full (about 25 s on 2 cores: a kernel with four check() calls, three CLI gradings).
"""
from __future__ import annotations


import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO, grade, grade_id, paste_reference_answers

RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
CELLS = ("setup", "copy_params", "check_copy_params", "allreduce", "check_allreduce",
         "split_batch", "check_split_batch", "check_train_batch_speedup")
PARAMETER_ANSWER = '''def copy_params(params, device):
    """New tensors on `device`, equal to `params`, with requires_grad=True."""
    return [nn.Parameter(p.detach().to(device).clone()) for p in params]
'''
OLD = ("should be a torch.Tensor, got torch.nn.parameter.Parameter", "passed or skipped",
       "hidden checks are reserved")


def submission() -> nbformat.NotebookNode:
    nb = nbformat.read(RELEASE, as_version=4)
    nb.cells = [c for c in nb.cells if grade_id(c) in CELLS]
    stub = next(c.source for c in nb.cells if grade_id(c) == "allreduce")
    assert paste_reference_answers(nb, SOURCE) == 3  # written, then the student's state:
    for cell in nb.cells:
        if grade_id(cell) == "allreduce":
            cell.source = stub                       # still the released stub
        elif grade_id(cell) == "copy_params":
            cell.source = PARAMETER_ANSWER           # Parameters instead of plain tensors
    assert "raise NotImplementedError" in stub
    return nb


@pytest.fixture(scope="module")
def env(offline_env) -> dict:
    # nothing timed; grading as in a student's copy (A1 has no key in any copy)
    return dict(offline_env, AUTOGRADER_SPEED="skip")


@pytest.fixture(scope="module")
def notebook(env) -> dict[str, tuple[str, list]]:
    """``{check cell's grade_id: (everything its output area shows, its outputs)}``."""
    nb = submission()
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(RELEASE.parent)}}).execute(env=env)
    shown = {}
    for cell in nb.cells:
        if grade_id(cell) and grade_id(cell).startswith("check_"):
            text = "".join(o.get("text", "") if o.output_type == "stream" else
                           "\n".join(o.get("traceback", [])) if o.output_type == "error" else
                           o.get("data", {}).get("text/plain", "") for o in cell.outputs)
            shown[grade_id(cell)] = (text, cell.outputs)
    setup_errors = [o for c in nb.cells if grade_id(c) == "setup" for o in c.outputs
                    if o.output_type == "error"]
    assert not setup_errors, setup_errors
    return shown


@pytest.fixture(scope="module")
def terminal(env, tmp_path_factory) -> dict:
    """The same submission graded by ``python -m autograder grade`` (the full report)."""
    path = tmp_path_factory.mktemp("submission") / "data_parallel.ipynb"
    nbformat.write(submission(), path)
    report = grade(path, env=env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    return report


def _errors(outputs) -> list:
    return [o for o in outputs if o.output_type == "error"]


@pytest.mark.slow
@pytest.mark.full
def test_a_stub_says_which_function_is_not_written_yet(notebook, terminal):
    text, outputs = notebook["check_allreduce"]
    said = "allreduce is not written yet (it raises NotImplementedError"
    assert text.count(said) == 1, text  # three checks failed for it: said once
    assert "NotImplementedError: \n" not in text and not text.rstrip().endswith("NotImplementedError:")
    [error] = _errors(outputs)
    assert error.ename == "CheckFailed" and error.traceback == [f"CheckFailed: {error.evalue}"]
    assert error.evalue.startswith("allreduce: 0 of 3 checks passed, 3 failed (0/3 points"), error.evalue
    assert said not in error.evalue  # the summary counts; the FAIL lines above say why
    # the terminal's table, one line per check, says it with the cell and line of the stub
    rows = [line for line in terminal["stdout"].splitlines() if line.startswith("allreduce: ")]
    assert len(rows) == 3 and all(said + " in cell allreduce, line " in r for r in rows), rows
    # nbgrader's feedback for that test cell: the same words
    from autograder.integrations.nbgrader_plugin import cell_outputs

    feedback = cell_outputs(terminal, "allreduce", 3.0)
    assert feedback[0].text.count(said) == 1, feedback[0].text  # once, as in the notebook
    assert feedback[0].text.count("(the same as above)") == 2, feedback[0].text
    # what the grader stores is unchanged (tests and tools read the exception's name there)
    assert all(r["message"].startswith("NotImplementedError") for r in terminal["results"]
               if r["function"] == "allreduce")


@pytest.mark.slow
@pytest.mark.full
def test_a_parameter_is_told_to_be_a_plain_tensor(notebook, terminal):
    text, outputs = notebook["check_copy_params"]
    said = "copy_params(...)[0] is an nn.Parameter; the grader takes plain tensors only"
    assert text.count(said) == 1, text
    assert "p.detach()" in text and "requires_grad=True" in text, text
    assert not any(old in text for old in OLD), text
    [error] = _errors(outputs)
    assert error.evalue.startswith("copy_params: 0 of 2 checks passed, 2 failed (0/2 points"), error.evalue
    assert "nn.Parameter" not in error.evalue
    rows = [line for line in terminal["stdout"].splitlines() if line.startswith("copy_params: ")]
    assert len(rows) == 2 and all(said in r for r in rows), rows


@pytest.mark.slow
@pytest.mark.full
def test_a_pass_says_what_passed(notebook, terminal):
    text, outputs = notebook["check_split_batch"]
    assert not _errors(outputs), text
    assert "split_batch: 2 of 2 checks passed (2/2 points)" in text, text
    assert not any(old in text for old in OLD), text
    assert [r["status"] for r in terminal["results"] if r["function"] == "split_batch"] == \
        ["passed", "passed"]


@pytest.mark.slow
@pytest.mark.full
def test_a_skip_says_it_earned_nothing(notebook):
    text, outputs = notebook["check_train_batch_speedup"]
    assert not _errors(outputs) and "SKIP" in text, text
    assert "train_batch_speedup: 0 of 1 check passed, 1 skipped (0/2 points; a skipped check " \
           "earns no points)" in text, text
    assert not any(old in text for old in OLD), text


@pytest.mark.slow
@pytest.mark.full
def test_hidden_checks_are_claimed_only_where_there_are_some(notebook, terminal, env):
    """A1 has no hidden check: neither the notebook nor the terminal speaks of one, in the
    instructor's checkout as in the student edition (A1's key does not exist in either)."""
    for text, _ in notebook.values():
        assert not any(claim in text for claim in ("hidden", "answer key",
                                                   "when your instructor grades")), text
    assert not any("hidden" in n or "answer key" in n for n in terminal["notes"]), terminal["notes"]
    assert "hidden" not in terminal["stdout"], terminal["stdout"]
    # An assignment with hidden checks, graded without its key (the student edition): said,
    # with how many; graded with it (the instructor's checkout): not said.
    a8 = REPO / "assignments" / "a8_composition" / "composition.ipynb"
    without = grade(a8, "--only", "per_rank_memory", env=dict(env, AUTOGRADER_ANSWER_KEY="absent"))
    notes = [n for n in without["notes"] if "answer key" in n]
    assert notes and "1 hidden check" in notes[0], without["notes"]
    assert f"Note: {notes[0]}" in without["stdout"]
    with_key = grade(a8, "--only", "per_rank_memory", env=env)
    assert not any("answer key" in n for n in with_key["notes"]), with_key["notes"]


@pytest.mark.parametrize("message, function, stubs, said", [
    # a helper's stub, seen from the function that calls it (the CLI: the frames show it)
    ("NotImplementedError: \n  in cell train_batch, line 7, in train_batch: s = split_batch(X)\n"
     "  in cell split_batch, line 4, in split_batch: raise NotImplementedError()",
     "train_batch", (), "split_batch is not written yet (it raises NotImplementedError in cell "
     "split_batch, line 4); train_batch calls it"),
    # a rank of a multi-process run (A2): the others' failing too is no news
    ("RuntimeError: with 3 processes, rank 0 failed: NotImplementedError\n  in cell "
     "average_gradients, line 4\n(rank(s) 1, 2 failed as well)", "average_gradients", (),
     "average_gradients is not written yet (it raises NotImplementedError in cell "
     "average_gradients, line 4)"),
    # check() in a notebook: no frames; the kernel found the stubs
    ("NotImplementedError: ", "train_batch_speedup", ("split_batch",),
     "split_batch is not written yet (it raises NotImplementedError); train_batch calls it"),
    # torch's own NotImplementedError is no stub: the message stays as the grader made it
    ("NotImplementedError: \n  in cell f, line 7, in f: y = torch.special.op(x)", "f", (), None),
    ("NotImplementedError: Could not run 'aten::op' with arguments from the 'CUDA' backend",
     "f", (), None),
])
def test_stub_messages_from_the_grader_s_replies(message, function, stubs, said):
    from autograder.results import student_message

    assert student_message(message, function, stubs) == (message if said is None else said)


def test_a_parameter_and_other_objects_from_the_probes_descriptions():
    import torch
    from torch import nn

    from autograder.checking.expect import tensor
    from autograder.checking.probes import describe

    with pytest.raises(AssertionError, match=r"^x is an nn.Parameter; the grader takes plain "
                                             r"tensors only: return e.g. p.detach\(\)"):
        tensor(describe(nn.Parameter(torch.zeros(2))), "x")
    with pytest.raises(AssertionError, match=r"^x should be a torch.Tensor, got numpy.ndarray$"):
        tensor(describe(torch.zeros(2).numpy()), "x")
    assert tensor(describe(torch.zeros(2)), "x")["kind"] == "tensor"
