"""The Gradescope bundle: what is inside, and its run_autograder run on this machine the way
Gradescope runs it (a temporary folder stands in for /autograder).

Tier: both: the bundle's contents are quick; its run_autograder run is full.
"""
from __future__ import annotations

import json
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

ASSIGNMENT = "a1_data_parallel"
SOLUTION = REPO / "solutions" / ASSIGNMENT / "data_parallel.ipynb"


def build(tmp_path: Path, *extra: str, assignment: str = ASSIGNMENT) -> Path:
    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "autograder", "gradescope", "build",
                           "--assignment", assignment, "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / f"{assignment}-gradescope.zip"


def test_bundle_carries_the_answer_key_and_hides_it_from_graded_code(tmp_path):
    """The hidden checks run on Gradescope: the key travels in the bundle (students never get
    it), the reference notebook does not; setup.sh makes solutions/ root's only and
    run_autograder runs graded code as the `grader` user, who cannot read it."""
    keyed = "a7_expert_parallel"
    with zipfile.ZipFile(build(tmp_path, assignment=keyed)) as z:
        names = set(z.namelist())
        setup, run = z.read("setup.sh").decode(), z.read("run_autograder").decode()
    assert f"solutions/{keyed}/answer_key.py" in names
    assert not [n for n in names if n.startswith("solutions/") and not n.endswith("answer_key.py")]
    assert 'chmod -R go-rwx "$SOURCE/solutions"' in setup
    assert 'AUTOGRADER_SANDBOX_USER="$sandbox_user"' in run and "sandbox_user=grader" in run


def test_bundle_contents(tmp_path):
    with zipfile.ZipFile(build(tmp_path)) as z:
        names = set(z.namelist())
        infos = {i.filename: i for i in z.infolist()}
        setup = z.read("setup.sh").decode()
    for script in ("setup.sh", "run_autograder"):
        assert script in names
        assert (infos[script].external_attr >> 16) & stat.S_IXUSR, f"{script} not executable"
    assert f"assignments/{ASSIGNMENT}/data_parallel.ipynb" in names
    assert f"autograder/assignments/{ASSIGNMENT}/checks.py" in names and "autograder/cli.py" in names
    assert "pyproject.toml" in names and "course/devices.py" in names
    assert not [n for n in names if n.startswith(("solutions/", "tests/")) or "/." in n
                or n.startswith(".") or "__pycache__" in n]
    assert 'pip install -e "$SOURCE"' in setup
    assert "torch==" in setup and "download.pytorch.org/whl/cpu" in setup
    with zipfile.ZipFile(build(tmp_path, "--with-reference")) as z:
        assert f"solutions/{ASSIGNMENT}/data_parallel.ipynb" in z.namelist()


def run_autograder(tmp_path: Path, submission_files: dict[str, str], env: dict) -> dict:
    root = tmp_path / "autograder"
    with zipfile.ZipFile(build(tmp_path)) as z:
        z.extractall(root / "source")
    (root / "submission").mkdir()
    for name, text in submission_files.items():
        path = root / "submission" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = dict(env, AUTOGRADER_ROOT=str(root), AUTOGRADER_PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((root / "results" / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.full
def test_run_autograder_grades_the_submission(tmp_path, offline_env):
    from course.devices import gpu_count

    results = run_autograder(tmp_path, {"work/data_parallel.ipynb": SOLUTION.read_text(),
                                        "notes.txt": "hi"}, offline_env)
    tests = results["tests"]
    # a check this machine could not judge (A1's speedup: Gradescope has no GPUs) earns nothing
    skipped = [t for t in tests if t["output"].startswith("Not graded on the grading machine")]
    judged = [t for t in tests if t not in skipped]
    assert judged and all(t["status"] == "passed" and t["score"] == t["max_score"] > 0
                          for t in judged), tests
    assert results["score"] == sum(t["max_score"] for t in judged) > 0
    assert all(t["score"] == 0 and "earns no points" in t["output"] for t in skipped), skipped
    if gpu_count() < 2:   # the speedup needs 2 GPUs: SKIP, whatever the load
        assert [t["name"] for t in skipped] == [
            "train_batch_speedup: train_batch_speedup_two_gpus"], tests


def test_run_autograder_without_a_notebook(tmp_path, offline_env):
    results = run_autograder(tmp_path, {"answer.py": "print(1)"}, offline_env)
    assert results["score"] == 0 and "No notebook" in results["output"]
