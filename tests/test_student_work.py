"""A student's work never lives in tracked files, and nothing of the instructor's overwrites it.

``make lab`` starts JupyterLab in the student's work folder (``python -m course.lab
--work-dir``; autograder/integrations/workfolder.py): copies of the lessons and of the released
assignments, made on the first run, never overwritten; a newer release lands beside a copy the
student changed, and one line says so. ``make release`` stops while ``assignments/`` holds
changes that no release wrote.

The release cases run on a small git repository of the test's own (a lesson, A1's release), so
that "the instructor releases again" changes nothing here; the work folder of the real
repository is checked for what it holds, and a whole student session through ``make lab``'s
path (a lesson run, A1 edited and checked, graded from the lab's terminal) for leaving
``git status`` as it was.

Tier: both: the work folder's rules are quick; the student session (a lesson and check() in
kernels, a grading run) is full.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO, paste_reference_answers

from autograder.integrations import edition, workfolder
from autograder.registry import ASSIGNMENTS
from course import lab

A1 = "assignments/a1_data_parallel/data_parallel.ipynb"
LESSON = "course/lessons/02_data_parallel_ideas.ipynb"
TODAY = "2026-11-28"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], capture_output=True, text=True, check=True).stdout


def status(repo: Path = REPO) -> str:
    return git(repo, "status", "--porcelain", "--untracked-files=all")


@pytest.fixture
def course_repo(tmp_path) -> Path:
    """A repository of the test's own: one lesson, A1's source and release, committed."""
    repo = tmp_path / "course"
    for rel in (LESSON, A1, "solutions/a1_data_parallel/data_parallel.ipynb"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, repo / rel)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "release 1")
    return repo


def release_again(repo: Path, rel: str = A1, text: str = "Release 2: a clarified text.") -> bytes:
    """The instructor changes a released notebook (as a new `make release` and a pull do)."""
    nb = nbformat.read(repo / rel, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell(text))
    nbformat.write(nb, repo / rel)
    return (repo / rel).read_bytes()


def edit_answer(path: Path, function: str = "copy_params") -> bytes:
    """The student writes an answer into their copy and saves it."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == function)
    cell.source = f"def {function}(*args):\n    return 'my work'\n"
    nbformat.write(nb, path)
    return path.read_bytes()


def files_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- what the work folder holds

def test_work_folder_holds_lessons_and_releases_and_no_answers(tmp_path):
    work = tmp_path / "work"
    said = workfolder.sync(work)
    assert len(said) == 1 and "made" in said[0], said
    lessons = sorted(p.name for p in (REPO / "course" / "lessons").glob("*.ipynb"))
    assert sorted(p.name for p in (work / "lessons").glob("*.ipynb")) == lessons
    for a in ASSIGNMENTS.values():
        copy = work / "assignments" / a.name / a.notebook
        assert copy.read_bytes() == a.release.read_bytes(), copy
    # nothing of the instructor's, nothing that shadows the installed packages
    assert not [p for p in work.rglob("*") if p.name in ("solutions", "answer_key.py")
                or p.name.endswith(".egg-info") or p.name in ("course", "autograder")]
    assert {p.split("/")[0] for p in files_in(work)} == {"lessons", "assignments", ".release.json"}
    assert not edition.leaks(work, edition.solution_regions() + edition.key_regions())
    assert workfolder.sync(work) == []  # the second run: nothing to do, nothing said


def test_the_default_work_folder_is_ignored_by_git():
    assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q",
                           "work/assignments/a1_data_parallel/data_parallel.ipynb"]).returncode == 0


def test_release_with_solution_text_is_not_copied(course_repo, tmp_path):
    source = nbformat.read(course_repo / "solutions/a1_data_parallel/data_parallel.ipynb", 4)
    answer = next(c.source for c in source.cells if "### BEGIN SOLUTION" in c.source)
    release_again(course_repo, text="```python\n" + answer + "\n```")
    git(course_repo, "add", "-A")
    with pytest.raises(workfolder.WorkFolderError, match="reference solution"):
        workfolder.sync(tmp_path / "work", course_repo)
    assert not (tmp_path / "work" / A1).exists()


# ---------------------------------------------------------------- a newer release

def test_a_newer_release_lands_beside_an_edited_copy(course_repo, tmp_path):
    work = tmp_path / "work"
    workfolder.sync(work, course_repo, today=TODAY)
    mine = edit_answer(work / A1)
    new = release_again(course_repo)
    said = workfolder.sync(work, course_repo, today=TODAY)
    beside = work / "assignments/a1_data_parallel/data_parallel.release-2026-11-28.ipynb"
    assert said == [f"{work / A1}: the new release is beside your copy, as {beside.name} "
                    "(your copy is unchanged)"]
    assert (work / A1).read_bytes() == mine and beside.read_bytes() == new
    assert workfolder.sync(work, course_repo, today=TODAY) == []  # said once, landed once
    # a third release, the same day, while the student kept working: beside again, not over
    newer = release_again(course_repo, text="Release 3.")
    assert "release-2026-11-28-2.ipynb" in workfolder.sync(work, course_repo, today=TODAY)[0]
    assert (work / A1).read_bytes() == mine and beside.read_bytes() == new
    assert beside.with_name("data_parallel.release-2026-11-28-2.ipynb").read_bytes() == newer


def test_a_folder_without_a_record_keeps_the_students_files(course_repo, tmp_path):
    """A work folder made otherwise (``make docker-work``, or before the record): a file that
    differs from the release is treated as the student's."""
    work = tmp_path / "work"
    workfolder.sync(work, course_repo, today=TODAY)
    (work / workfolder.MANIFEST).unlink()
    mine = edit_answer(work / A1)
    said = workfolder.sync(work, course_repo, today=TODAY)
    assert len(said) == 1 and "beside your copy" in said[0], said
    assert (work / A1).read_bytes() == mine


def test_an_untouched_copy_takes_the_new_release(course_repo, tmp_path):
    work = tmp_path / "work"
    workfolder.sync(work, course_repo)
    new = release_again(course_repo)
    assert workfolder.sync(work, course_repo) == [
        f"{work / A1}: updated to the new release (you had not changed it)"]
    assert (work / A1).read_bytes() == new
    assert files_in(work) == {"lessons/02_data_parallel_ideas.ipynb", A1, ".release.json"}


def test_new_assignments_arrive_and_a_deleted_copy_comes_back(course_repo, tmp_path):
    work = tmp_path / "work"
    workfolder.sync(work, course_repo)
    (work / "lessons/02_data_parallel_ideas.ipynb").unlink()  # to start the lesson over
    a2 = course_repo / "assignments/a2_ddp/ddp.ipynb"
    a2.parent.mkdir()
    shutil.copy2(REPO / "assignments/a2_ddp/ddp.ipynb", a2)
    git(course_repo, "add", "-A")
    said = workfolder.sync(work, course_repo)
    assert sorted(said) == [f"{work}/assignments/a2_ddp/ddp.ipynb: added (new in the release)",
                            f"{work}/lessons/02_data_parallel_ideas.ipynb: added (restored: "
                            "the released version)"]
    assert (work / "assignments/a2_ddp/ddp.ipynb").read_bytes() == a2.read_bytes()


# ---------------------------------------------------------------- make release

def test_make_release_stops_before_replacing_someones_work(course_repo):
    assert workfolder.release_guard(course_repo) == []
    release_again(course_repo)  # what `make release` writes, then records
    workfolder.record_release(course_repo)
    assert workfolder.release_guard(course_repo) == []  # releasing twice before a commit is fine
    edit_answer(course_repo / A1)  # someone worked in the released copy
    (course_repo / "assignments/a1_data_parallel/scratch.ipynb").write_text("{}")
    assert sorted(workfolder.release_guard(course_repo)) == [
        A1, "assignments/a1_data_parallel/scratch.ipynb"]


def test_make_release_runs_the_guard_first_unless_forced():
    def dry(*args: str) -> list[str]:
        return subprocess.run(["make", "--no-print-directory", "-n", "release", *args], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.splitlines()

    lines = dry()
    guard = next(i for i, line in enumerate(lines) if "workfolder release-guard" in line)
    assert guard < next(i for i, line in enumerate(lines) if "generate_assignment" in line)
    assert "workfolder release-record" in lines[-1]
    assert not [line for line in dry("FORCE=1") if "release-guard" in line]


# ---------------------------------------------------------------- make lab

class Started(Exception):
    pass


def start(monkeypatch, *argv: str) -> tuple[list[str], dict]:
    """``python -m course.lab ARGV`` up to the moment it would become JupyterLab."""
    seen = {}

    def execve(path, cmd, env):
        seen.update(cmd=cmd, env=env)
        raise Started

    with monkeypatch.context() as m, pytest.raises(Started):
        m.setattr(os, "execve", execve)
        lab.main(list(argv))
    return seen["cmd"], seen["env"]


def test_make_lab_starts_in_the_work_folder(monkeypatch, tmp_path, capsys):
    work = tmp_path / "work"
    cmd, env = start(monkeypatch, "--work-dir", str(work), "--port=1")
    assert f"--ServerApp.root_dir={work}" in cmd and "--port=1" in cmd
    assert (work / A1).is_file() and (work / "lessons").is_dir()
    assert "made" in capsys.readouterr().out
    release = work / A1
    mine = edit_answer(release)
    start(monkeypatch, "--work-dir", str(work))
    assert release.read_bytes() == mine


def test_make_lab_instructor_stays_in_the_repository(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COURSE_WORK_DIR", str(tmp_path / "work"))
    cmd, _ = start(monkeypatch, "--instructor", "--ServerApp.root_dir=.")
    assert not (tmp_path / "work").exists()
    assert [a for a in cmd if "root_dir" in a] == ["--ServerApp.root_dir=."]


# ---------------------------------------------------------------- a whole student session

@pytest.mark.slow
@pytest.mark.full
def test_a_student_session_leaves_the_repository_as_it_was(offline_env, monkeypatch, tmp_path):
    before = status()
    work = tmp_path / "work"
    _, env = start(monkeypatch, "--work-dir", str(work))  # what `make lab` makes and starts in
    for key in ("COURSE_DATA", "COURSE_OFFLINE", "COURSE_FULL", "MPLBACKEND", "PYTHONWARNINGS",
                "AUTOGRADER_CALIBRATION"):
        monkeypatch.setenv(key, offline_env[key])
    monkeypatch.setenv("PATH", env["PATH"])

    def run(path: Path, nb) -> list:
        NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)  # saved, as the lab saves it
        return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]

    lesson = work / "lessons" / Path(LESSON).name
    outputs = run(lesson, nbformat.read(lesson, as_version=4))
    assert outputs and not [o for o in outputs if o.output_type == "error"]

    a1 = work / A1
    nb = nbformat.read(a1, as_version=4)
    assert paste_reference_answers(nb, REPO / "solutions/a1_data_parallel/data_parallel.ipynb")
    wanted = {"setup", "copy_params", "check_copy_params"}
    nb.cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") in wanted]
    outputs = run(a1, nb)
    assert not [o for o in outputs if o.output_type == "error"], outputs
    shown = "".join(o.get("text", "") for o in outputs)
    assert "PASS" in shown and "copy_params" in shown and "FAIL" not in shown, shown

    # graded from the lab's terminal: it opens in the work folder, with the server's PATH
    report = tmp_path / "report.json"
    proc = subprocess.run(["python", "-m", "autograder", "grade", A1, "--only", "copy_params",
                           "--report", str(report)], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "PATH": env["PATH"]}, timeout=600)
    results = json.loads(report.read_text())["results"]
    assert results and all(r["status"] == "passed" for r in results), proc.stdout + proc.stderr

    assert workfolder.sync(work) == []  # the next `make lab`: the release has not changed
    changed = sorted(set(status().splitlines()) ^ set(before.splitlines()))
    assert not changed, f"the student's session changed the repository: {changed}"
