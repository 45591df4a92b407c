"""Shared test helpers: tiny Fashion-MNIST files, notebook execution, grading runs.

Tests never download: the data loader is fed small IDX files written here, in the exact
format torchvision reads.
"""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file (the MNIST format)."""
    magic = struct.pack(">HBB", 0, 0x08, array.ndim)
    dims = struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(magic + dims + array.astype(np.uint8).tobytes())


def write_tiny_fashion_mnist(root: Path, n_train: int = 512, n_test: int = 128, seed: int = 0) -> Path:
    """Small but learnable Fashion-MNIST files under ``root/FashionMNIST/raw``."""
    rng = np.random.default_rng(seed)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prototypes = rng.integers(0, 256, size=(10, 28, 28))
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n)
        noise = rng.normal(0, 40, size=(n, 28, 28))
        images = np.clip(prototypes[labels] + noise, 0, 255)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_tiny_fashion_mnist(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def offline_env(tiny_data) -> dict:
    """Environment for running notebooks and the grader in tests: offline, tiny data, quick mode."""
    env = dict(os.environ)
    env.update(COURSE_DATA=str(tiny_data), COURSE_OFFLINE="1", COURSE_FULL="0",
               MPLBACKEND="Agg", PYTHONWARNINGS="ignore",
               # the spec's default call timeouts, whatever this machine calibrated
               AUTOGRADER_CALIBRATION=str(tiny_data / "no-calibration.json"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="session")
def edition(tmp_path_factory) -> Path:
    """The student edition of the working tree (new, not yet committed files included), built
    once for the tests that read it (test_edition.py, test_answer_keys.py); a test that adds a
    file to it removes it again."""
    out = tmp_path_factory.mktemp("edition") / "scale-pytorch-student"
    proc = subprocess.run([sys.executable, "-m", "autograder", "edition", str(out),
                           "--include-untracked"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def grade(notebook: Path, *extra: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Grade ``notebook`` with the CLI in a fresh process, as folder grading and nbgrader do
    (:func:`autograder.invoke.run_grader`: forked from a warm template after the first grading
    with this environment, cold with ``AUTOGRADER_WARM=0``); return the full JSON report."""
    from autograder.invoke import run_grader

    run = run_grader(["grade", str(notebook), *extra], timeout=timeout, env=env, separate=True)
    if run.timed_out:
        raise subprocess.TimeoutExpired(["autograder", "grade", str(notebook)], timeout)
    if run.report is None:
        return {"returncode": run.returncode, "stdout": run.output, "stderr": run.error_output,
                "results": [], "score": 0}
    return {**run.report, "returncode": run.returncode, "stdout": run.output,
            "stderr": run.error_output}


def points_by_function(report: dict) -> dict[str, float]:
    totals: dict[str, float] = {}
    for r in report["results"]:
        totals[r["function"]] = totals.get(r["function"], 0) + r["points"]
    return totals


# ---------------------------------------------------------------- submissions made by the tests

_MARKERS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[^\n]*\n?", re.M)


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def plant_bugs(nb, bugs: dict[str, tuple[str, str]]):
    """In place: in the answer cell of each function, replace ``old`` by ``new`` (``bugs`` maps
    function -> (old, new)); fails when a bug no longer applies to the reference."""
    for function, (old, new) in bugs.items():
        cell = next(c for c in nb.cells if grade_id(c) == function and c.cell_type == "code")
        assert old in cell.source, f"the planted bug for {function} no longer applies"
        cell.source = cell.source.replace(old, new)
    return nb


def planted_copy(source: Path, tmp_path: Path, name: str, *bugs: dict) -> Path:
    """``source`` with every dict of ``bugs`` planted (:func:`plant_bugs`), written to
    ``tmp_path / <name>.ipynb``: the notebook a planted-bug test grades."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    for planted in bugs:
        plant_bugs(nb, planted)
    path = tmp_path / f"{name.replace(' ', '_')}.ipynb"
    nbformat.write(nb, path)
    return path


def paste_reference_answers(nb, source: Path) -> int:
    """In place: the reference's code answers (markers removed) into ``nb``'s answer cells, as a
    student who copied them would; returns how many cells were pasted."""
    import nbformat

    answers = {grade_id(c): c.source for c in nbformat.read(source, as_version=4).cells
               if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}
    pasted = 0
    for cell in nb.cells:
        if cell.cell_type == "code" and grade_id(cell) in answers:
            cell.source = _MARKERS.sub("", answers[grade_id(cell)])
            pasted += 1
    return pasted


# ------------------------------------------------------------------------- what a report shows

def assert_full_marks(report: dict) -> None:
    """Every point this machine can grade, and a reason for each skipped check."""
    from autograder.checking.spec import functions_of

    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == report["max_score"] > 0, report["stdout"]
    failed = [r for r in report["results"] if r["status"] == "failed"]
    assert not failed, failed
    skipped = [r for r in report["results"] if r["status"] == "skipped"]
    assert all(r["message"] for r in skipped), "a skipped check must say why"
    assert points_by_function(report).keys() == functions_of(report["assignment"]).keys()
    assert "Total:" in report["stdout"] and "Hardware:" in report["stdout"]


def assert_grades_full_marks_within(source: Path, seconds: float, env: dict) -> dict:
    """Grade ``source`` (``--speed skip``): full marks, in under ``seconds``; the report."""
    import time

    start = time.monotonic()
    report = grade(source, "--speed", "skip", env=env)
    took = time.monotonic() - start
    assert_full_marks(report)
    print(report["stdout"])
    assert took < seconds, f"grading took {took:.1f} s"
    return report


def assert_public_points_without_the_key(source: Path, env: dict) -> dict:
    """The student's view of ``source`` (``AUTOGRADER_ANSWER_KEY=absent``, ``--speed skip``):
    every public check passes, every hidden one is reserved (SKIP with the RESERVED reason, no
    points either way), a speed check is skipped unmeasured, every function keeps a public
    check, and the report says how many points the instructor's grading adds. The report."""
    from autograder.checking.spec import load_spec
    from autograder.keys import RESERVED, WITHOUT_KEY_ENV, is_reserved

    report = grade(source, "--speed", "skip", env={**env, WITHOUT_KEY_ENV: "absent"})
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    spec = load_spec(report["assignment"])
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {c.name for c in spec.checks}, report["stdout"]
    for check in spec.checks:
        r = results[check.name]
        if check.hidden:
            assert is_reserved(r) and r["message"] == RESERVED and r["points"] == 0, r
        elif check.speed:
            assert r["status"] == "skipped" and not is_reserved(r), r
        else:
            assert r["status"] == "passed" and r["points"] == r["max_points"], r
    public = sum(c.points for c in spec.checks if not c.hidden and not c.speed)
    assert report["score"] == report["max_score"] == public, report["stdout"]
    assert {c.function for c in spec.checks if not c.hidden} == {c.function for c in spec.checks}
    reserved = sum(c.points for c in spec.checks if c.hidden)
    if reserved:
        assert f"{reserved:g} more when your instructor grades" in report["stdout"], report["stdout"]
    return report


def assert_stubs_score_zero(report: dict) -> None:
    """Zero, and every failure says NotImplementedError without a traceback; no message names
    the launcher's frames (course/launch.py), which would point a student at the wrong file."""
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert report["score"] == 0
    assert report["max_score"] > 0
    for r in report["results"]:
        if r["status"] == "failed":
            assert "NotImplementedError" in r["message"], r
        assert "course/launch.py" not in r["message"], r
    assert "Traceback" not in report["stdout"]


def assert_only_these_lose_points(report: dict, broken, *, all_of_them: bool = True) -> None:
    """The functions in ``broken`` (and their ``_speedup`` checks, which count only for correct
    code) score zero with a message (with ``all_of_them=False``: lose points, each failed check
    with a message, where a bug leaves some of a function's checks right); every other function
    scores full on every check this machine could grade (a check that cannot be judged here is
    a SKIP with its reason)."""
    from autograder.checking.spec import functions_of

    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    got, full = points_by_function(report), functions_of(report["assignment"])
    assert got.keys() == full.keys()
    broken = set(broken) | {f"{f}_speedup" for f in broken}
    for name, points in full.items():
        results = [r for r in report["results"] if r["function"] == name]
        assert sum(r["max_points"] for r in results) == points, (name, results)
        if name in broken and not all_of_them:
            assert got[name] < points, (name, results)
            assert all(r["message"] for r in results if r["status"] == "failed"), results
        elif name in broken:
            assert got[name] == 0, (name, results)
            assert all(r["status"] in ("failed", "skipped") and r["message"] for r in results), results
        else:  # full marks for every check this machine could grade (a SKIP says why)
            assert all(r["message"] for r in results if r["status"] == "skipped"), results
            assert got[name] == sum(r["max_points"] for r in results
                                    if r["status"] != "skipped"), (name, results)


def assert_only_these_checks_fail(report: dict, names, *, skipped_with_reason=()) -> None:
    """The checks ``names`` score zero with a message; every other check passes with full
    points, but those in ``skipped_with_reason`` (speed checks under ``--speed skip``), which
    may instead be a SKIP that says why."""
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    names = set(names)
    assert names <= {r["name"] for r in report["results"]}, names
    for r in report["results"]:
        if r["name"] in names:
            assert r["status"] == "failed" and r["points"] == 0 and r["message"], r
        elif r["name"] in skipped_with_reason and r["status"] == "skipped":
            assert r["message"], r
        else:
            assert r["status"] == "passed" and r["points"] == r["max_points"], r


def processes_tagged(tag: str) -> list[int]:
    """The live processes whose environment holds ``AUTOGRADER_RUN_TAG=tag`` (a grading's
    sandboxes, ranks and what the submission started inherit it): what a grading left behind."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("AUTOGRADER_RUN_TAG") == tag:
                found.append(process.pid)
        except (psutil.Error, OSError):  # gone, or not ours to read
            pass
    return found



def grade_leaving_nothing(notebook, *extra, env, seconds: float, prefix: str,
                          allowed: tuple[str, ...] = ()) -> dict:
    """The report of grading ``notebook`` within ``seconds``, after which no process is left
    behind and the grading's TMPDIR (every sandbox's and rank's temporary files) holds nothing
    but the top-level entries whose names start with one of ``allowed`` (torch's own caches)."""
    import shutil
    import tempfile
    import time
    import uuid

    tag = uuid.uuid4().hex
    scratch = Path(tempfile.mkdtemp(prefix=prefix))  # short: the fork server's socket is in it
    start = time.monotonic()
    report = grade(notebook, *extra, timeout=400,
                   env={**env, "AUTOGRADER_RUN_TAG": tag, "TMPDIR": str(scratch)})
    took = time.monotonic() - start
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    assert took < seconds, f"grading took {took:.0f} s"
    time.sleep(0.5)
    left = processes_tagged(tag)
    assert not left, f"processes left behind: {left}"
    files = sorted(str(f.relative_to(scratch)) for f in scratch.rglob("*")
                   if not f.relative_to(scratch).parts[0].startswith(allowed))
    assert not files, f"files left behind: {files[:10]}"
    shutil.rmtree(scratch)
    return report


def markdown_table(text: str, first: str) -> list[dict]:
    """The markdown table of ``text`` whose header starts with ``| first |``, as dicts (a
    benchmark's report): a separator row under the header, every row as wide as it."""
    lines = text[text.index(f"\n| {first} |") + 1:].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break  # the table's end
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert set(rows[1]) <= {"---", "---:"}, rows[1]
    assert all(len(row) == len(rows[0]) for row in rows), rows
    return [dict(zip(rows[0], row)) for row in rows[2:]]


# ---------------------------------------------------------------- many seeds, busy machine

def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=2,
                     help="seeds per assignment in test_reference_seeds.py (default 2, new "
                          "ones every run; --seeds 50 for a long run)")


@pytest.fixture
def busy_cores():
    """One busy process per core for the duration of a test: correct code must still get
    full marks (speed checks may SKIP with their reason, never FAIL)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n or 1)]
    try:
        yield len(procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
