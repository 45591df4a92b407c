"""The student edition: no solution code inside, and a student can still self-check with it.

The edition is graded with its own copy of the autograder: a bare virtual environment whose
site-packages point at this one's (for torch & co.) but not at this project's editable install,
so that the grader, its sandboxed workers and the check modules all come from the edition.

Tier: both: the edition's contents are quick; grading with the edition's own venv is full.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest

from conftest import REPO, paste_reference_answers

from autograder.checking.spec import load_spec
from autograder.keys import has_key, is_reserved
from autograder.registry import ASSIGNMENTS

SOURCES = sorted((REPO / "solutions").glob("*/*.ipynb"))
A1 = "assignments/a1_data_parallel/data_parallel.ipynb"
A1_SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"


def normalise(text: str) -> str:
    return " ".join(text.split())


def solution_regions() -> list[str]:
    """Every ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` text of every reference notebook."""
    regions = []
    for path in SOURCES:
        for cell in nbformat.read(path, as_version=4).cells:
            regions += [m.group(1) for m in re.finditer(
                r"### BEGIN SOLUTION[^\n]*\n(.*?)### END SOLUTION", cell.source, re.S)
                if m.group(1).strip()]
    return regions


def fragments(region: str) -> list[str]:
    """The whole region and every 3 consecutive non-blank lines of it (50+ characters)."""
    lines = [normalise(line) for line in region.splitlines() if line.strip()]
    out = [normalise(region)]
    out += [" ".join(lines[i:i + 3]) for i in range(len(lines) - 2)
            if len(" ".join(lines[i:i + 3])) >= 50]
    return out


@pytest.fixture(scope="module")
def edition_python(edition, tmp_path_factory) -> Path:
    """A Python that imports ``autograder`` and ``course`` from the edition only."""
    venv = tmp_path_factory.mktemp("venv") / "edition-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A path line in a .pth adds that folder, without running the .pth files in it: this
    # project's editable-install hook in our site-packages is not run.
    Path(site, "edition.pth").write_text(f"{edition}\n{sysconfig.get_paths()['purelib']}\n")
    where = subprocess.run([str(python), "-c", "import autograder, course; "
                            "print(autograder.__file__); print(course.__file__)"],
                           capture_output=True, text=True, cwd=edition, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(Path(p).is_relative_to(edition) for p in where.stdout.split()), where.stdout
    return python


def edition_grade(python: Path, edition: Path, notebook: str, env: dict, *args: str) -> dict:
    report = edition / ".report.json"
    proc = subprocess.run([str(python), "-m", "autograder", "grade", notebook,
                           "--report", str(report), *args], cwd=edition, env=env,
                          capture_output=True, text=True, timeout=600)
    assert report.exists(), proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    report.unlink()
    data.update(stdout=proc.stdout, stderr=proc.stderr, returncode=proc.returncode)
    return data


# ---------------------------------------------------------------- what is (not) inside

def test_edition_has_no_solutions_nor_instructor_files(edition):
    assert not [p for p in edition.rglob("*") if p.name == "solutions"]
    assert not (edition / "nbgrader_config.py").exists()
    assert not (edition / "tests").exists()
    assert not (edition / ".git").exists()
    assert not (edition / "docs" / "instructor.md").exists()
    assert not list(edition.rglob("*hidden*"))
    for needed in ("README.md", "Makefile", "pyproject.toml", A1, "course/__init__.py",
                   "autograder/assignments/a1_data_parallel/checks.py", "docker/Dockerfile"):
        assert (edition / needed).is_file(), f"{needed} missing from the edition"


def test_no_solution_text_anywhere_in_the_edition(edition):
    regions = solution_regions()
    assert len(regions) >= 5, "the reference notebooks should have solution regions"
    searched = [(frag, region.strip().splitlines()[0]) for region in regions
                for frag in fragments(region)]
    files = [p for p in edition.rglob("*") if p.is_file()]
    assert len(files) > 10
    for path in files:
        text = normalise(path.read_text(encoding="utf-8", errors="ignore"))
        for frag, first in searched:
            assert frag not in text, (f"{path.relative_to(edition)} contains solution text "
                                      f"(region starting {first!r})")
        if path.suffix == ".ipynb":
            assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, path


def test_leak_search_finds_a_planted_leak(edition, tmp_path):
    """The search above is not vacuous: a copied region is found, and the builder refuses it."""
    from autograder.integrations.edition import leaks, solution_regions as builder_regions

    region = solution_regions()[1]
    planted = tmp_path / "copy"
    planted.mkdir()
    (planted / "notes.py").write_text("# my notes\n" + region)
    assert leaks(planted, builder_regions(REPO))
    text = normalise((planted / "notes.py").read_text())
    assert any(frag in text for frag in fragments(region))


def test_readme_tells_students_what_differs(edition):
    readme = (edition / "README.md").read_text()
    note = readme.split("\n\n", 2)[1]
    assert "Student edition" in note
    for phrase in ("fixed threshold", "may differ", "tests/", "80%"):
        assert phrase in readme, phrase
    assert readme.startswith("# ")


def test_default_build_takes_committed_files_only(tmp_path):
    from autograder.integrations.edition import build

    repo = tmp_path / "repo"
    (repo / "course").mkdir(parents=True)
    (repo / "README.md").write_text("# Course\n\ntext\n")
    (repo / "course" / "kept.py").write_text("x = 1\n")
    (repo / "solutions" / "a").mkdir(parents=True)
    (repo / "solutions" / "a" / "s.py").write_text("secret = 1\n")
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "README.md", "course/kept.py", "solutions/a/s.py"], check=True)
    (repo / "course" / "junk.py").write_text("scratch\n")  # untracked
    out = tmp_path / "out"
    files = build(out, repo=repo)
    assert sorted(files) == ["README.md", "course/kept.py"]
    assert not (out / "course" / "junk.py").exists() and not (out / "solutions").exists()
    files = build(out, repo=repo, force=True, include_untracked=True)
    assert "course/junk.py" in files


def test_edition_builds_with_python_and_git_alone(tmp_path):
    """``make docker-work`` builds the lab's work folder on the host, where the project may not
    be installed: ``python -S`` (no site-packages: no nbformat, torch or psutil) builds it, and
    the leak search still reads every reference notebook's solution regions."""
    out = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-S", "-m", "autograder", "edition", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / A1).exists() and not (out / "solutions").exists()
    from autograder.integrations.edition import solution_regions

    with_nbformat = [m.group(1) for path in SOURCES for cell in nbformat.read(path, 4).cells
                     for m in re.finditer(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION",
                                          cell.source, re.S) if m.group(1).strip()]
    assert solution_regions() == with_nbformat and len(with_nbformat) >= 60


# ---------------------------------------------------------------- self-check still works

def test_reference_is_absent_and_speedup_says_fixed_threshold(edition, edition_python):
    code = ("from autograder.checking.reference import reference_cells\n"
            "from autograder.checking.speed import judge_rounds\n"
            "assert reference_cells('a1_data_parallel') is None\n"
            "try:\n    judge_rounds(lambda i: (1.0, None), what='train_batch on 2 GPUs',\n"
            "                 fixed_threshold=1.3, reference_minimum=1.1, has_reference=False)\n"
            "except AssertionError as e:\n    print(e)\n")
    proc = subprocess.run([str(edition_python), "-c", code], cwd=edition, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fixed" in proc.stdout and "may differ" in proc.stdout


@pytest.mark.slow
@pytest.mark.full
def test_released_notebook_scores_zero_with_readable_messages(edition, edition_python,
                                                               offline_env):
    report = edition_grade(edition_python, edition, A1, offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == 0 and report["max_score"] > 0
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert failed and all("NotImplementedError" in r["message"] for r in failed), failed
    assert "Traceback" not in report["stdout"] and "Total: 0" in report["stdout"]


@pytest.mark.slow
@pytest.mark.full
def test_pasted_solution_answers_get_full_marks(edition, edition_python, offline_env):
    """A student who writes the reference's answers into the released notebook gets every
    point that this machine can grade (skipped checks say why)."""
    answers = [c for c in nbformat.read(A1_SOURCE, as_version=4).cells
               if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code"]
    nb = nbformat.read(edition / A1, as_version=4)
    assert paste_reference_answers(nb, A1_SOURCE) == len(answers) >= 5
    path = edition / "assignments" / "a1_data_parallel" / "my_work.ipynb"
    nbformat.write(nb, path)
    try:
        report = edition_grade(edition_python, edition, str(path.relative_to(edition)),
                               offline_env)
    finally:
        path.unlink()
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    graded = [r for r in report["results"] if r["status"] != "skipped"]
    assert graded and all(r["status"] == "passed" for r in graded), graded
    assert report["score"] == report["max_score"] > 0
    assert all(r["message"] for r in report["results"] if r["status"] == "skipped")


KEYED = [a for a in sorted(ASSIGNMENTS) if has_key(a)]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("assignment", KEYED)
def test_the_reference_in_the_edition_earns_every_public_point(assignment, edition,
                                                                edition_python, offline_env):
    """No key in the edition: the reference's answers earn every public point, each hidden
    check is reserved for the instructor (never passed, never failed), and the report says
    how many points are checked here and how many when the instructor grades."""
    a = ASSIGNMENTS[assignment]
    nb = nbformat.read(edition / "assignments" / assignment / a.notebook, as_version=4)
    assert paste_reference_answers(nb, a.source) > 0
    path = edition / "assignments" / assignment / "my_work.ipynb"
    nbformat.write(nb, path)
    try:
        report = edition_grade(edition_python, edition, str(path.relative_to(edition)),
                               {**offline_env, "AUTOGRADER_SPEED": "skip"})
    finally:
        path.unlink()
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    spec = load_spec(assignment)
    hidden = {c.name for c in spec.checks if c.hidden}
    results = {r["name"]: r for r in report["results"]}
    assert hidden and {n for n, r in results.items() if is_reserved(r)} == hidden, report["stdout"]
    public = [r for n, r in results.items() if n not in hidden and r["status"] != "skipped"]
    assert public and all(r["status"] == "passed" for r in public), report["stdout"]
    assert report["score"] == report["max_score"] > 0
    assert "more when your instructor grades" in report["stdout"]


@pytest.mark.slow
@pytest.mark.full
def test_a_busy_machine_skips_a_speedup_it_cannot_judge(edition, edition_python, offline_env):
    """No reference in the edition: a speed check asks a fixed threshold, but only where the
    grader measures that the machine gives the timed processes their cores. A10's reference,
    graded while 2 other processes spin on this machine's cores, gets a SKIP that says how many
    cores it measured (it got 0.82x against the fixed 1.2x, a FAIL, before the measurement)."""
    a = ASSIGNMENTS["a10_pipeline_schedules"]
    nb = nbformat.read(edition / "assignments" / a.name / a.notebook, as_version=4)
    assert paste_reference_answers(nb, a.source) > 0
    path = edition / "assignments" / a.name / "my_work.ipynb"
    nbformat.write(nb, path)
    spin = "import time\nend = time.time() + 600\nwhile time.time() < end: pass\n"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        report = edition_grade(edition_python, edition, str(path.relative_to(edition)),
                               offline_env, "--only", "run_schedule_speedup")
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        path.unlink()
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    (result,) = report["results"]
    assert result["status"] == "skipped" and result["points"] == 0, result
    assert re.search(r"the timed code is correct .* only \d\.\d\d cores' worth of CPU",
                     result["message"]), result
