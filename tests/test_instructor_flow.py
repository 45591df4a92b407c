"""The instructor's nbgrader flow end to end, in a temporary course (docs/instructor.md):
students added, every assignment generated, submissions autograded, feedback generated, grades
exported.

Submissions, for every assignment: alice pasted the reference answers and wrote her own
written answer; bob handed in the released notebook untouched (for A2 and A3: the smallest
notebook that still goes through every nbgrader step, the release without the demo cells that
nbgrader neither grades nor checks, which a student may delete; running them proves nothing
about nbgrader and cost seconds). For A1 also: carol is alice
with one planted bug in ``allreduce``, and dave handed in the stubs but redefined ``check``
(and patched ``autograder.check``) so that every test cell would print PASS in his kernel.
For A4-A8, alice alone: what is particular to an assignment in this flow is its notebook run in
nbgrader's kernel and its test cells' points against its own grading; the untouched release,
the planted bug and the cheat go through the same nbgrader steps whatever the assignment (and
are graded per assignment by the CLI in tests/test_grader_*.py).

Tier: full: nbgrader end to end, for every assignment (minutes).
"""
from __future__ import annotations

import csv
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from autograder.checking.spec import load_spec
from course.devices import gpu_count
from conftest import REPO, paste_reference_answers, plant_bugs
from test_grader_a1 import BUGS

NOTEBOOKS = {"a1_data_parallel": "data_parallel.ipynb", "a2_ddp": "ddp.ipynb",
             "a3_model_pipeline": "model_pipeline.ipynb", "a4_sharding": "sharding.ipynb",
             "a5_tensor_parallel": "tensor_parallel.ipynb",
             "a6_context_parallel": "context_parallel.ipynb",
             "a7_expert_parallel": "expert_parallel.ipynb", "a8_composition": "composition.ipynb",
             "a9_resilience": "resilience.ipynb",
             "a10_pipeline_schedules": "pipeline_schedules.ipynb"}
STUDENTS = {"a1_data_parallel": ["alice", "bob", "carol", "dave"],
            "a2_ddp": ["alice", "bob"], "a3_model_pipeline": ["alice", "bob"],
            **{a: ["alice"] for a in ("a4_sharding", "a5_tensor_parallel", "a6_context_parallel",
                                      "a7_expert_parallel", "a8_composition", "a9_resilience",
                                      "a10_pipeline_schedules")}}
#: The assignments with written answers (markdown answer cells that a person grades).
WRITTEN = ("a1_data_parallel", "a2_ddp", "a3_model_pipeline")
CHEAT = ("import autograder\n"
         "def check(*args, **kwargs):\n    print('PASS')\n"
         "autograder.check = check\n")
#: Assignments autograded with ``AUTOGRADER_SPEED=skip``: timing A2-A7's speed checks would
#: double the flow's time and prove nothing about nbgrader (their speed checks are graded in
#: tests/test_grader_a*.py); nbgrader awards nothing for a speed check it did not run. A1 keeps
#: measuring: on a machine without 2 GPUs its speed check is a hardware SKIP, which earns
#: nothing either (a SKIP never earns points; docs/instructor.md), and its cell says so
#: without an error.
SPEED_SKIPPED = tuple(a for a in NOTEBOOKS if a != "a1_data_parallel")
ALICE_WRITES = ("Two devices were slower for me because each step moved shards and gradients "
                "between them, which cost more than the arithmetic it saved.")


def source(assignment: str) -> Path:
    return REPO / "solutions" / assignment / NOTEBOOKS[assignment]


def nbgrader(course: Path, env: dict, *args: str, timeout: float = 900) -> str:
    exe = Path(sys.executable).parent / "nbgrader"
    proc = subprocess.run([str(exe), *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def check_cell_points(assignment: str) -> dict[str, float]:
    """``{function: points}`` of the autograded test cells (``check("<function>")``)."""
    points = {}
    for cell in nbformat.read(source(assignment), as_version=4).cells:
        m = re.search(r"""check\(\s*["'](\w+)["']""", cell.source)
        if cell.cell_type == "code" and meta(cell).get("grade") and m:
            points[m.group(1)] = float(meta(cell)["points"])
    return points


def graded_cells(path: Path) -> dict[str, str]:
    """What each autograded test cell of a notebook shows (for a failing test's message)."""
    nb = nbformat.read(path, as_version=4)
    return {meta(c)["grade_id"]: "".join(o.get("text", "") or str(o.get("data", o.get("evalue")))
                                         for o in c.outputs)[-600:]
            for c in nb.cells if c.cell_type == "code" and meta(c).get("grade")}


def skipped_cells(path: Path) -> dict[str, float]:
    """``{grade_id: points}`` of the autograded test cells of a notebook whose checks all
    SKIPped: each shows that no points were given and no error (nbgrader would read an error
    as a failure; the points are 0 all the same)."""
    skipped = {}
    for c in nbformat.read(path, as_version=4).cells:
        if c.cell_type != "code" or not meta(c).get("grade") or meta(c).get("solution"):
            continue
        text = "".join(o.get("text", "") for o in c.outputs)
        if "SKIP  " in text and "PASS  " not in text and "FAIL  " not in text:
            assert "point(s) not given" in text, text
            assert not [o for o in c.outputs if o.output_type == "error"], c.outputs
            skipped[meta(c)["grade_id"]] = float(meta(c)["points"])
    return skipped


def written_cells(assignment: str) -> list:
    return [c for c in nbformat.read(source(assignment), as_version=4).cells
            if c.cell_type == "markdown" and meta(c).get("grade") and meta(c).get("solution")]


def region(text: str) -> str:
    m = re.search(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", text, re.S)
    return m.group(1) if m else ""


def normalise(text: str) -> str:
    return " ".join(text.split())


def html_text(path: Path) -> str:
    """What a reader sees in an HTML file: tags removed (syntax highlighting splits code into
    spans), entities decoded, whitespace normalised."""
    raw = path.read_text(encoding="utf-8", errors="ignore")
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S | re.I)
    return normalise(html.unescape(re.sub(r"<[^>]+>", "", raw)))


def answered(assignment: str, release: Path) -> nbformat.NotebookNode:
    """The released notebook with the reference's code answers pasted in and alice's own
    written answer."""
    nb = nbformat.read(release, as_version=4)
    assert paste_reference_answers(nb, source(assignment)) > 0
    for cell in nb.cells:
        if cell.cell_type == "markdown" and meta(cell).get("solution"):
            cell.source = ALICE_WRITES
    return nb


def submissions(assignment: str, release: Path) -> dict[str, nbformat.NotebookNode]:
    """What each student hands in for ``assignment`` (see the module docstring)."""
    bob = nbformat.read(release, as_version=4)
    handed_in = {"alice": answered(assignment, release), "bob": bob}
    if assignment == "a1_data_parallel":
        carol = plant_bugs(answered(assignment, release), {"allreduce": BUGS["allreduce"]})
        dave = nbformat.read(release, as_version=4)
        next(c for c in dave.cells if meta(c).get("grade_id") == "copy_params").source = CHEAT
        handed_in.update(carol=carol, dave=dave)
    else:  # the demo cells left out: nbgrader neither grades nor checks them
        bob.cells = [c for c in bob.cells if c.cell_type != "code"
                     or any(meta(c).get(k) for k in ("grade", "solution", "locked"))]
    return {student: handed_in[student] for student in STUDENTS[assignment]}


@pytest.fixture(scope="module")
def course(tmp_path_factory, offline_env) -> Path:
    """A course run through nbgrader: db, generate, submit, autograde, feedback, export."""
    course = tmp_path_factory.mktemp("instructor") / "course"
    course.mkdir(parents=True)
    shutil.copy(REPO / "nbgrader_config.py", course / "nbgrader_config.py")
    env = offline_env
    roster = course / "students.csv"
    roster.write_text("id,first_name,last_name\n" + "".join(
        f"{s},{s.title()},Student\n" for s in sorted({s for ss in STUDENTS.values() for s in ss})))
    nbgrader(course, env, "db", "student", "import", str(roster))
    # One nbgrader command per step for all assignments where it can (its assignment argument
    # is a glob): each command costs seconds to start, and 8 assignments made 26 of them.
    for assignment in NOTEBOOKS:
        shutil.copytree(REPO / "solutions" / assignment, course / "solutions" / assignment,
                        ignore=shutil.ignore_patterns(".*"))
    nbgrader(course, env, "generate_assignment", "*", "--force")
    for assignment, notebook in NOTEBOOKS.items():
        release = course / "assignments" / assignment / notebook
        assert release.exists() and "BEGIN SOLUTION" not in release.read_text()
        for student, nb in submissions(assignment, release).items():
            folder = course / "submitted" / student / assignment
            folder.mkdir(parents=True)
            nbformat.write(nb, folder / notebook)
    measured = [a for a in NOTEBOOKS if a not in SPEED_SKIPPED]
    assert measured == ["a1_data_parallel"]
    nbgrader(course, env, "autograde", "a1_data_parallel", "--force")
    for others in ("a[!1]*", "a1[0-9]*"):  # all but a1_data_parallel (a10_... starts with a1)
        nbgrader(course, {**env, "AUTOGRADER_SPEED": "skip"}, "autograde", others, "--force")
    nbgrader(course, env, "generate_feedback", "*", "--force")
    nbgrader(course, env, "export", "--to", str(course / "grades.csv"))
    return course


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("assignment", NOTEBOOKS)
def test_exported_scores_per_student(course, assignment):
    points = check_cell_points(assignment)
    full = sum(points.values())
    written = sum(float(meta(c)["points"]) for c in written_cells(assignment))
    assert full > 0 and (written > 0) == (assignment in WRITTEN)
    with open(course / "grades.csv") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f) if r["assignment"] == assignment}
    unrun = sum(c.points for c in load_spec(assignment).checks if c.speed) \
        if assignment in SPEED_SKIPPED else 0.0
    # A1's speed check was measured: where it SKIPped (always without 2 GPUs), 0 points
    graded = {s: course / "autograded" / s / assignment / NOTEBOOKS[assignment]
              for s in STUDENTS[assignment]}
    unjudged = {s: sum(skipped_cells(graded[s]).values()) if assignment not in SPEED_SKIPPED
                else 0.0 for s in ("alice", "carol") if s in graded}
    if assignment == "a1_data_parallel" and gpu_count() < 2:
        assert "check_train_batch_speedup" in skipped_cells(graded["alice"]), graded_cells(
            graded["alice"])
    expected = {"alice": full - unrun - unjudged["alice"]}
    if "bob" in STUDENTS[assignment]:
        expected.update(bob=0.0)
    if assignment == "a1_data_parallel":
        # carol's allreduce is wrong: train_batch runs with it and keeps only its one-device
        # check (1 of its 4 points), and its speedup, counted for correct code only, fails
        expected.update(carol=full - points["allreduce"] - 0.75 * points["train_batch"]
                        - points["train_batch_speedup"], dave=0.0)
    assert set(expected) == set(STUDENTS[assignment]) <= set(rows)
    for student, want in expected.items():
        row = rows[student]
        assert float(row["score"]) == pytest.approx(want), (student, row, graded_cells(
            graded[student]))
        assert float(row["max_score"]) == pytest.approx(full + written), (student, row)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("assignment", WRITTEN)
def test_written_answers_wait_for_manual_grading(course, assignment):
    from nbgrader.api import Gradebook

    notebook = Path(NOTEBOOKS[assignment]).stem
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for cell in written_cells(assignment):
            gid = meta(cell)["grade_id"]
            for student in set(STUDENTS[assignment]) & {"alice", "carol"}:
                # they wrote an answer: a person must grade it
                grade = gb.find_grade(gid, notebook, assignment, student)
                assert grade.needs_manual_grade and grade.manual_score is None, student
                assert grade.auto_score is None
                assert gb.find_submission(assignment, student).needs_manual_grade
            # bob left "YOUR ANSWER HERE": nbgrader scores an unchanged answer cell 0 by itself
            grade = gb.find_grade(gid, notebook, assignment, "bob")
            assert grade.score == 0 and not grade.needs_manual_grade


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("assignment", NOTEBOOKS)
def test_feedback_has_no_solution_text(course, assignment):
    stem = Path(NOTEBOOKS[assignment]).stem
    feedback = {s: course / "feedback" / s / assignment / f"{stem}.html"
                for s in STUDENTS[assignment]}
    for path in feedback.values():
        assert path.exists(), path
    texts = {s: html_text(p) for s, p in feedback.items()}
    written_solutions = [normalise(region(c.source)) for c in written_cells(assignment)]
    code_regions = [normalise(region(c.source))
                    for c in nbformat.read(source(assignment), as_version=4).cells
                    if c.cell_type == "code" and meta(c).get("solution")]
    assert all(written_solutions) and bool(written_solutions) == (assignment in WRITTEN)
    assert len(code_regions) >= 3
    # the search works: alice's feedback shows her own answers (which are the reference's code)
    assert (normalise(ALICE_WRITES) in texts["alice"]) == (assignment in WRITTEN)
    assert any(r in texts["alice"] for r in code_regions)
    for student, text in texts.items():
        for written in written_solutions:
            assert written not in text, f"{student}'s feedback shows the model answer"
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    if "bob" in texts:
        assert not [r for r in code_regions if r in texts["bob"]], \
            "the untouched stub's feedback shows reference code"
        assert "NotImplementedError" in texts["bob"]
