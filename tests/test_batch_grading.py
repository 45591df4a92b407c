"""Grading a whole class (issue 14): stable shards, disjoint jobs, resume, merge, progress and
the gradebook; checks the machine could not judge, re-timed at the end and counted by one rule
(issue 22 F). Fast tests replace the per-notebook grader by a stand-in (the folder logic is
what they test); the slow tests grade real A1 notebooks (with --jobs 2 and sequentially; and
on a machine shown no GPU, where A1's speedup check cannot be judged).

Tier: both: the folder logic with a stand-in grader is quick; the real class gradings are full
(minutes).
"""
from __future__ import annotations

import csv
import io
import json
import threading
import time
from pathlib import Path

import nbformat
import pytest

from autograder.integrations import batch, gradebook, jobs, merge, shards, store
from autograder.integrations.progress import Progress
from conftest import REPO as REPO_ROOT, plant_bugs

A1 = "a1_data_parallel"


# ----------------------------------------------------------------------------------- shards

def test_shards_are_disjoint_cover_the_class_and_stay_put_when_students_join():
    students = [f"s{i:03d}" for i in range(200)]
    slices = [shards.select([(s,) for s in students], k, 4) for k in range(1, 5)]
    assert sorted(s for sl in slices for (s,) in sl) == students
    assert all(20 < len(sl) < 80 for sl in slices), [len(sl) for sl in slices]
    before = {s: shards.shard_of(s, 4) for s in students}
    later = students + [f"late{i}" for i in range(50)]
    assert {s: shards.shard_of(s, 4) for s in later if s in before} == before


@pytest.mark.parametrize("text", ["0/3", "4/3", "1", "a/b", "1/0"])
def test_bad_shards_are_refused(text):
    with pytest.raises(ValueError):
        shards.parse_shard(text)


# -------------------------------------------------------------------------------------- jobs

def test_jobs_get_disjoint_cores_gpus_ports_and_folders(tmp_path):
    alloc = jobs.Allocator(list(range(6)), ["0", "1", "2", "3"], tmp_path)
    held, clashes, lock = [], [], threading.Lock()

    def job(need):
        slot = alloc.acquire(need)
        with lock:
            for other in held:
                if (set(other.cores) & set(slot.cores) or set(other.gpus) & set(slot.gpus)
                        or other.index == slot.index or other.tmp == slot.tmp
                        or not (other.ports[1] < slot.ports[0] or slot.ports[1] < other.ports[0])):
                    clashes.append((other, slot))
            held.append(slot)
        assert len(slot.cores) == need.cores and len(slot.gpus) == need.gpus
        assert slot.tmp.is_dir()
        time.sleep(0.01)
        with lock:
            held.remove(slot)
        alloc.release(slot)

    needs = [jobs.Needs(2, 2), jobs.Needs(1), jobs.Needs(2), jobs.Needs(3, 1)] * 10
    threads = [threading.Thread(target=job, args=(n,)) for n in needs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not clashes
    assert not list(tmp_path.iterdir())          # every job's folder removed after it
    wide = jobs.Allocator(list(range(256)), [], tmp_path)   # a big machine: ports still fit
    slots = [wide.acquire(jobs.Needs(1)) for _ in range(256)]
    assert all(a.ports[1] < b.ports[0] for a, b in zip(slots, slots[1:]))
    assert slots[0].ports[0] >= 1024 and slots[-1].ports[1] < 32768
    for slot in slots:
        wide.release(slot)
    a = alloc.acquire(jobs.Needs(1))
    env = a.env({})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["COURSE_PORTS"] == "%d-%d" % a.ports


def test_job_sizes_come_from_the_specs_and_are_capped_at_the_machine():
    assert jobs.needs_of(A1, 2, 0) == jobs.Needs(1, 0)
    assert jobs.needs_of("a2_ddp", 2, 0) == jobs.Needs(2, 0)
    assert jobs.needs_of("a2_ddp", 1, 0) == jobs.Needs(1, 0)   # SKIPs, as when graded alone
    # on NCCL where 2 GPUs are visible, as when graded alone on that machine
    assert jobs.needs_of("a2_ddp", 16, 8) == jobs.Needs(2, 2)
    assert jobs.needs_of("a3_model_pipeline", 16, 8) == jobs.Needs(2, 2)
    assert jobs.needs_of(A1, 16, 1) == jobs.Needs(1, 1)
    assert jobs.needs_of(None, 16, 8) == jobs.Needs(1, 0)
    assert jobs.capacity([jobs.Needs(2)], 2, 0) == 1           # A2 or A3 on this 2-core machine
    assert jobs.capacity([jobs.Needs(1)], 2, 0) == 2           # A1 without GPUs
    assert jobs.capacity([jobs.Needs(1, 2), jobs.Needs(2)], 16, 8) == 4


def test_a_pinned_grader_runs_on_its_cores_only():
    import subprocess
    import sys

    from autograder.warm import PIN

    core = sorted(jobs.usable_cores())[-1]
    out = subprocess.run([sys.executable, "-c", PIN, str(core), "-c",
                          "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{core}]"


def test_ports_come_from_the_jobs_range(monkeypatch):
    from course.launch import free_port

    monkeypatch.setenv("COURSE_PORTS", "21000-21009")
    assert all(21000 <= free_port() <= 21009 for _ in range(20))


# ----------------------------------------------------------------------------------- progress

def test_progress_is_one_plain_line_per_submission_when_not_a_terminal():
    stream = io.StringIO()
    p = Progress(2, stream)
    p.update("alice: graded, 3/4 (5 s)", failed=False)
    p.update("bob: timeout, 0/4 (900 s)", failed=True)
    p.close()
    assert stream.getvalue().splitlines() == ["[1/2] alice: graded, 3/4 (5 s)",
                                              "[2/2] bob: timeout, 0/4 (900 s)"]


def test_progress_is_a_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    p = Progress(2, stream)
    p.update("alice", failed=False)
    p.update("bob", failed=True)
    p.close()
    assert "2/2" in stream.getvalue() and "failures 1" in stream.getvalue()
    assert "alice" not in stream.getvalue()


# --------------------------------------------------- folder grading with a stand-in grader

SPEED_FN = "f_speedup"                    # the stand-in's speed check's function
LOAD = ("f: the timed code is correct (your speedup 1.41x), but even the reference solution "
        "reached only 1.02x on this machine in this run (median of 6 interleaved rounds; it "
        "needs 1.10x to show a speedup here), so the hardware cannot judge one: not graded here")
NO_GPUS = "f is correct, but its speedup needs 2 or more CUDA GPUs and this machine has 0"


def speed_result(outcome):
    """The stand-in's speed check (3 points) from ``[status, message]``."""
    status, message = outcome
    return {"name": "speedup", "function": SPEED_FN, "points": 3.0 if status == "passed" else 0.0,
            "max_points": 3.0, "status": status, "message": message, "seconds": 1.0}


def fake_row(path, student, key, score=None, only=None, speed=None, seed=None):
    """The 'notebook' is JSON: ``score`` (checks c1 and c2, 5 points) and, optionally, its
    speed check's outcome in the first pass (``first``) and when re-timed (``retry``)."""
    from autograder.results import SPEED_NOT_MEASURED

    data = json.loads(Path(path).read_text())
    score = float(data["score"]) if score is None else score
    results = [{"name": "c1", "function": "f", "points": min(score, 2.0), "max_points": 2.0,
                "status": "passed" if score >= 2 else "failed", "message": ""},
               {"name": "c2", "function": "g", "points": max(score - 2, 0.0), "max_points": 3.0,
                "status": "passed" if score >= 5 else "failed", "message": ""}]
    if "first" in data:
        results.append(speed_result(["skipped", SPEED_NOT_MEASURED] if speed == "skip"
                                    else data["retry"] if only else data["first"]))
    if only:   # --only: the checks of these functions alone, as the CLI grades them
        results = [r for r in results if r["function"] in only.split(",")]
    report = {"assignment": A1, "score": sum(r["points"] for r in results), "seed": seed or 7,
              "max_score": sum(r["max_points"] for r in results if r["status"] != "skipped"),
              "results": results, "notes": []}
    return batch.settled(batch.Graded(
        student=student, notebook=Path(path).name, assignment=A1, score=report["score"],
        max_score=report["max_score"], status=batch.GRADED, not_graded_points=0.0, message="",
        key=key, results={"score": score}, report=report, output="table"))


@pytest.fixture
def fake_grader(monkeypatch):
    """batch.grade_one replaced: the 'notebook' is JSON (:func:`fake_row`); records calls (the
    slot each ran in, --only, --seed, --speed, when it ran); ``fail_on`` makes that student's
    grading raise KeyboardInterrupt."""
    calls, lock = [], threading.Lock()
    state = {"fail_on": None}

    def grade_one(notebook, workdir, assignment=None, timeout=0, student="", relpath="",
                  key="", seed=None, env=None, cpus=None, on_start=None, only=None, speed=None):
        ran = [time.monotonic(), None]   # when it started and ended
        with lock:
            calls.append((student, tuple(cpus), env["COURSE_PORTS"], str(workdir), only, seed,
                          speed, ran))
        if student == state["fail_on"]:
            raise KeyboardInterrupt
        time.sleep(0.02)
        row = fake_row(notebook, student, key, only=only, speed=speed, seed=seed)
        ran[1] = time.monotonic()
        return row

    monkeypatch.setattr(batch, "grade_one", grade_one)
    monkeypatch.setattr(batch, "reference_exposed", lambda: None)
    monkeypatch.delenv("AUTOGRADER_SPEED", raising=False)   # the default: measure
    return calls, state


def make_class(root: Path, n: int = 6) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"st{i}.ipynb").write_text(json.dumps({"score": i % 6}))
    return root


def grades(out: Path) -> list[dict]:
    with open(out / "grades.csv") as f:
        return list(csv.DictReader(f))


def test_resume_skips_unchanged_notebooks_and_force_regrades(fake_grader, tmp_path):
    calls, _ = fake_grader
    subs = make_class(tmp_path / "subs")
    out = tmp_path / "out"
    first = batch.grade_folder(subs, out, assignment=A1, jobs=2, progress_stream=io.StringIO())
    assert len(calls) == 6 and [g.score for g in first] == [0, 1, 2, 3, 4, 5]
    before = grades(out)
    again = batch.grade_folder(subs, out, assignment=A1, jobs=2, progress_stream=io.StringIO())
    assert len(calls) == 6 and grades(out) == before
    assert [g.report for g in again] == [g.report for g in first]
    (subs / "st3.ipynb").write_text(json.dumps({"score": 5}))       # a resubmission
    batch.grade_folder(subs, out, assignment=A1, jobs=2, progress_stream=io.StringIO())
    assert [c[0] for c in calls[6:]] == ["st3"]
    assert grades(out)[3]["score"] == "5"
    batch.grade_folder(subs, out, assignment=A1, jobs=2, force=True, progress_stream=io.StringIO())
    assert len(calls) == 13
    # each job had its own cores and port range while it ran (2 jobs on A1's 1 core each)
    assert all(len(c[1]) == 1 for c in calls)


def test_an_interrupted_run_leaves_no_half_written_result(fake_grader, tmp_path):
    calls, state = fake_grader
    subs = make_class(tmp_path / "subs")
    out = tmp_path / "out"
    state["fail_on"] = "st2"
    with pytest.raises(KeyboardInterrupt):
        batch.grade_folder(subs, out, assignment=A1, jobs=1, progress_stream=io.StringIO())
    first = len(calls)                 # st0..st2, maybe st3 (its result is thrown away)
    done = {r["student"] for r in grades(out)}
    assert done == {"st0", "st1"}
    for key in ("st0", "st1"):   # complete folders; nothing of the others
        assert {p.name for p in (out / key).iterdir()} == {
            "results.json", "report.json", "output.txt", store.MARKER}
    assert not any((out / f"st{i}").exists() for i in range(2, 6))
    state["fail_on"] = None
    batch.grade_folder(subs, out, assignment=A1, jobs=1, progress_stream=io.StringIO())
    assert sorted(c[0] for c in calls[first:]) == ["st2", "st3", "st4", "st5"]
    assert not (out / ".work").exists()


def test_a_folder_without_its_marker_is_not_taken_as_a_result(tmp_path):
    g = fake_row(make_class(tmp_path / "s", 1) / "st0.ipynb", "st0", "st0")
    store.write_result(tmp_path / "out", g, "fp")
    assert store.read_result(tmp_path / "out", "st0", "fp", batch.Graded) == g
    assert store.read_result(tmp_path / "out", "st0", "other", batch.Graded) is None
    (tmp_path / "out" / "st0" / store.MARKER).unlink()
    assert store.read_result(tmp_path / "out", "st0", None, batch.Graded) is None


def test_two_shards_merged_equal_one_run_and_duplicates_are_refused(fake_grader, tmp_path):
    subs = make_class(tmp_path / "subs", 12)
    kw = dict(assignment=A1, jobs=2, progress_stream=io.StringIO())
    batch.grade_folder(subs, tmp_path / "one", **kw)
    batch.grade_folder(subs, tmp_path / "s1", shard=(1, 2), **kw)
    batch.grade_folder(subs, tmp_path / "s2", shard=(2, 2), **kw)
    assert grades(tmp_path / "s1") and grades(tmp_path / "s2")
    rows, missing = merge.merge([tmp_path / "s1", tmp_path / "s2"], tmp_path / "merged")
    assert not missing
    assert (tmp_path / "merged" / "grades.csv").read_text() == (
        tmp_path / "one" / "grades.csv").read_text()
    assert (tmp_path / "merged" / "checks.csv").read_text() == (
        tmp_path / "one" / "checks.csv").read_text()
    with pytest.raises(merge.MergeError, match="twice"):
        merge.merge([tmp_path / "s1", tmp_path / "s1"], tmp_path / "m2")
    # a shard folder that also holds another shard's student: refused, not counted twice
    moved = grades(tmp_path / "s2")[0]["student"]
    manifest = json.loads((tmp_path / "s1" / "shard.json").read_text())
    manifest["class"][moved] = 1
    (tmp_path / "s1" / "shard.json").write_text(json.dumps(manifest))
    import shutil
    shutil.copytree(tmp_path / "s2" / moved, tmp_path / "s1" / moved)
    with pytest.raises(merge.MergeError, match=moved):
        merge.merge([tmp_path / "s1", tmp_path / "s2"], tmp_path / "m3")


def test_merge_reports_missing_students_and_shards(fake_grader, tmp_path):
    subs = make_class(tmp_path / "subs", 12)
    batch.grade_folder(subs, tmp_path / "s1", assignment=A1, shard=(1, 3),
                       progress_stream=io.StringIO())
    gone = grades(tmp_path / "s1")[0]["student"]
    import shutil
    shutil.rmtree(tmp_path / "s1" / gone)
    code = merge.main([str(tmp_path / "s1"), "--out", str(tmp_path / "m")])
    manifest = json.loads((tmp_path / "m" / "shard.json").read_text())
    assert code == 3
    assert manifest["missing_shards"] == [2, 3]
    others = {f"st{i}" for i in range(12)} - {r["student"] for r in grades(tmp_path / "s1")}
    assert set(manifest["missing"]) == others | {gone}


# ------------------------------------------------- checks the machine could not judge (#22 F)

def speed_class(root: Path, outcomes: dict) -> Path:
    """``{student: (first pass, re-timed)}``, each ``[status, message]``; all at 5/5 otherwise."""
    root.mkdir(parents=True, exist_ok=True)
    for student, (first, retry) in outcomes.items():
        (root / f"{student}.ipynb").write_text(json.dumps(
            {"score": 5, "first": list(first), "retry": list(retry)}))
    return root


def retimed(calls):
    return [c for c in calls if c[4]]


def test_unjudged_checks_are_retimed_alone_and_what_stays_unjudged_keeps_one_maximum(
        fake_grader, tmp_path):
    calls, _ = fake_grader
    still = LOAD.replace("1.02x", "0.97x")          # loaded again, in another run
    subs = speed_class(tmp_path / "subs", {
        "judged": (["passed", ""], ["passed", ""]),
        "passes": (["skipped", LOAD], ["passed", "f_speedup: 1.40x (reference 1.42x)"]),
        "slow": (["skipped", LOAD], ["failed", "your speedup is 1.01x"]),
        "loaded": (["skipped", LOAD], ["skipped", still])})
    out = tmp_path / "out"
    rows = batch.grade_folder(subs, out, assignment=A1, jobs=2, progress_stream=io.StringIO())
    first = [c for c in calls if not c[4]]
    again = retimed(calls)
    # the unjudged ones, again: --only their check's function, the first pass's seed, the
    # whole machine, one at a time, after the first pass
    assert sorted(c[0] for c in again) == ["loaded", "passes", "slow"]
    assert all(c[4] == SPEED_FN and c[5] == 7 and c[6] == "measure" for c in again)
    assert all(c[1] == tuple(jobs.usable_cores()) for c in again)
    assert min(c[7][0] for c in again) >= max(c[7][1] for c in first)
    spans = sorted(c[7] for c in again)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    got = {r["student"]: r for r in grades(out)}
    assert {r["max_score"] for r in got.values()} == {"8"}            # one maximum
    assert [(s, got[s]["score"], got[s]["needs_timing"], got[s]["not_graded_points"])
            for s in sorted(got)] == [("judged", "8", "", "0"), ("loaded", "5", SPEED_FN, "3"),
                                      ("passes", "8", "", "0"), ("slow", "5", "", "0")]
    by = {g.student: g for g in rows}
    assert [r["status"] for r in by["passes"].report["results"]] == ["passed"] * 3
    assert by["passes"].report["results"][2]["message"].startswith("f_speedup: 1.40x")
    assert by["slow"].report["score"] == 5 and by["slow"].report["max_score"] == 8
    notes = " ".join(by["loaded"].report["notes"])
    assert "re-timed alone at the end of the class run: SKIP again" in notes and "0.97x" in notes
    assert retime_banner() in (out / "loaded" / "output.txt").read_text()
    # the student reads the same: no points for the SKIP, out of the check's maximum, and why
    results = json.loads((out / "loaded" / "results.json").read_text())
    speed = [t for t in results["tests"] if t["name"].startswith(SPEED_FN)]
    assert results["score"] == 5 and speed[0]["score"] == 0 and speed[0]["max_score"] == 3
    assert "0.97x" in speed[0]["output"] and "earns no points" in speed[0]["output"]
    assert "Needs timing: f_speedup" in results["output"]
    assert json.loads((out / "loaded" / "report.json").read_text()) == by["loaded"].report
    # the same rule on a rerun (nothing regraded; the still-unjudged one is re-timed again)
    n = len(calls)
    batch.grade_folder(subs, out, assignment=A1, jobs=2, progress_stream=io.StringIO())
    assert [(c[0], c[4]) for c in calls[n:]] == [("loaded", SPEED_FN)]
    assert {r["student"]: r["score"] for r in grades(out)} == {
        s: r["score"] for s, r in got.items()}


def retime_banner():
    from autograder.integrations.retime import BANNER

    return BANNER


def test_a_reason_that_stays_word_for_word_is_retimed_once_not_per_student(fake_grader, tmp_path):
    calls, _ = fake_grader
    subs = speed_class(tmp_path / "subs", {
        s: (["skipped", NO_GPUS], ["skipped", NO_GPUS]) for s in ("ann", "bob", "cyd")})
    batch.grade_folder(subs, tmp_path / "out", assignment=A1, progress_stream=io.StringIO())
    assert [c[0] for c in retimed(calls)] == ["ann"]
    got = grades(tmp_path / "out")
    assert [(r["score"], r["max_score"], r["needs_timing"]) for r in got] == [
        ("5", "8", SPEED_FN)] * 3
    report = json.loads((tmp_path / "out" / "cyd" / "report.json").read_text())
    assert any("not re-timed" in n and "when ann's was re-timed" in n for n in report["notes"])


def test_speed_skip_runs_are_reported_as_such_not_retimed(fake_grader, tmp_path, monkeypatch,
                                                          capsys):
    calls, _ = fake_grader
    monkeypatch.setenv("AUTOGRADER_SPEED", "skip")
    subs = speed_class(tmp_path / "subs", {s: (["passed", ""], ["passed", ""]) for s in "ab"})
    out = tmp_path / "out"
    assert batch.main([str(subs), str(out), "--assignment", A1]) == 0
    assert not retimed(calls) and {c[6] for c in calls} == {"skip"}
    assert [(r["score"], r["max_score"], r["needs_timing"]) for r in grades(out)] == [
        ("5", "8", f"{SPEED_FN} (--speed skip)")] * 2
    printed = capsys.readouterr().out
    assert "--speed skip: nothing is timed or re-timed" in printed
    assert "2 of 2 notebook(s) still need a timing" in printed
    assert "counts in max_score and earns 0" in printed       # the rule, stated
    # later, on hardware that can time them: only those checks are timed
    monkeypatch.delenv("AUTOGRADER_SPEED")
    n = len(calls)
    assert batch.main([str(subs), str(out), "--assignment", A1]) == 0
    assert [(c[0], c[4], c[6]) for c in calls[n:]] == [("a", SPEED_FN, "measure"),
                                                        ("b", SPEED_FN, "measure")]
    assert [(r["score"], r["max_score"], r["needs_timing"]) for r in grades(out)] == [
        ("8", "8", "")] * 2
    assert "still need a timing" not in capsys.readouterr().out


def test_shards_merge_on_the_same_rule(fake_grader, tmp_path, monkeypatch, capsys):
    subs = speed_class(tmp_path / "subs", {
        f"st{i}": (["skipped", NO_GPUS], ["skipped", NO_GPUS]) if i % 2 else
        (["passed", ""], ["passed", ""]) for i in range(8)})
    kw = dict(assignment=A1, progress_stream=io.StringIO())
    batch.grade_folder(subs, tmp_path / "one", **kw)
    for k in (1, 2):
        batch.grade_folder(subs, tmp_path / f"s{k}", shard=(k, 2), **kw)
    assert merge.main([str(tmp_path / "s1"), str(tmp_path / "s2"), "--out",
                       str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "grades.csv").read_text() == (
        tmp_path / "one" / "grades.csv").read_text()
    assert "4 of 8 notebook(s) still need a timing" in capsys.readouterr().out
    # the rule is applied where the grades are counted: the merge gives the unjudged check
    # nothing, for every shard alike, out of the same maximum (there is no switch to award it)
    monkeypatch.setenv("AUTOGRADER_SKIPPED", "award")
    rows, _ = merge.merge([tmp_path / "s1", tmp_path / "s2"], tmp_path / "m0")
    assert {(g.student, g.score, g.max_score) for g in rows} == {
        (f"st{i}", 5.0 if i % 2 else 8.0, 8.0) for i in range(8)}
    results = json.loads((tmp_path / "m0" / "st1" / "results.json").read_text())
    assert results["score"] == 5 and "earns no points" in results["tests"][-1]["output"]


# ---------------------------------------------------------------------------------- gradebook

def test_class_summaries_and_nbgrader_gradebook(fake_grader, tmp_path):
    from nbgrader.api import Gradebook

    subs = make_class(tmp_path / "subs", 6)
    rows = batch.grade_folder(subs, tmp_path / "out", assignment=A1, jobs=2,
                              progress_stream=io.StringIO())
    checks = list(csv.DictReader(open(tmp_path / "out" / "checks.csv")))
    assert [(c["check"], c["passed"], c["failed"]) for c in checks] == [("c1", "4", "2"),
                                                                         ("c2", "1", "5")]
    wide = list(csv.DictReader(open(tmp_path / "out" / "gradebook.csv")))
    assert [(w["student"], w[A1]) for w in wide] == [(f"st{i}", str(i)) for i in range(6)]
    assert (tmp_path / "out" / "scores.png").read_bytes()[:4] == b"\x89PNG"
    # the stand-in's report has functions f and g; real reports have the spec's functions
    real = [fake_row(subs / "st5.ipynb", "st5", "st5")]
    real[0].report["results"] = [{"function": f, "points": p, "max_points": p}
                                 for f, p in batch_points().items()]
    real[0].report["results"][0]["points"] = 0.0
    db = tmp_path / "gradebook.db"
    assert gradebook.export_nbgrader(db, real) == 1
    total = sum(batch_points().values())
    first = next(iter(batch_points().values()))
    with Gradebook(f"sqlite:///{db}") as gb:
        sub = gb.find_submission(A1, "st5")
        assert sub.score == pytest.approx(total - first)
        assert sub.max_score == pytest.approx(total)
    assert rows


def batch_points():
    from autograder.checking.spec import functions_of

    return functions_of(A1)


# ------------------------------------------------------------------------- real grading (slow)

@pytest.mark.slow
@pytest.mark.full
def test_jobs_give_the_same_scores_as_grading_one_at_a_time(offline_env, tmp_path, monkeypatch):
    """Three A1 notebooks (the reference, the stubs, a planted bug), graded sequentially and
    with --jobs 2 (one core each): the same score and the same status of every check."""
    from test_grader_a1 import BUGS, RELEASE, SOURCE

    for k, v in offline_env.items():
        monkeypatch.setenv(k, v)
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "ref.ipynb").write_bytes(SOURCE.read_bytes())
    (subs / "stub.ipynb").write_bytes(RELEASE.read_bytes())
    nbformat.write(plant_bugs(nbformat.read(SOURCE, as_version=4),
                              {"allreduce": BUGS["allreduce"]}), subs / "bug.ipynb")
    runs = {}
    for jobs_n in (1, 2):
        rows = batch.grade_folder(subs, tmp_path / f"out{jobs_n}", jobs=jobs_n,
                                  progress_stream=io.StringIO())
        runs[jobs_n] = {g.student: (g.score, g.max_score, g.status,
                                    [(r["name"], r["status"], r["message"] if r["status"] ==
                                      "skipped" else "") for r in g.report["results"]])
                        for g in rows}
    assert runs[1] == runs[2]
    ref = next(g for g in rows if g.student == "ref")  # every point but the skipped ones,
    skipped = sum(r["max_points"] for r in ref.report["results"]  # which earn nothing
                  if r["status"] == "skipped")
    assert runs[2]["ref"][0] == runs[2]["ref"][1] - skipped > 0 and runs[2]["stub"][0] == 0
    assert 0 < runs[2]["bug"][0] < runs[2]["ref"][0]


@pytest.mark.slow
@pytest.mark.full
def test_a_speed_check_this_machine_cannot_judge_is_retimed_then_noted_out_of_one_maximum(
        offline_env, tmp_path, monkeypatch):
    """Real A1 grading shown no GPU (``CUDA_VISIBLE_DEVICES=""``, which the folder grader
    reads and passes on): train_batch's speedup check cannot be judged, whatever the load, so
    the outcome is fixed. Two reference copies and the stub: the first copy's check is re-timed
    (its notebook graded again with --only train_batch_speedup and its seed), SKIPs with the
    same reason, so the second copy's is not re-timed; both get every other point and none of
    the unjudged check's, out of the same maximum as the stub's, with the check named in
    needs_timing."""
    from autograder.checking.spec import load_spec
    from autograder.integrations.retime import BANNER
    from test_grader_a1 import RELEASE, SOURCE

    for k, v in offline_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("AUTOGRADER_SPEED", raising=False)
    subs = tmp_path / "subs"
    subs.mkdir()
    for name, source in (("ann", SOURCE), ("bob", SOURCE), ("stub", RELEASE)):
        (subs / f"{name}.ipynb").write_bytes(source.read_bytes())
    out, log = tmp_path / "out", io.StringIO()
    rows = {g.student: g for g in batch.grade_folder(subs, out, progress_stream=log)}
    spec = load_spec(A1)
    total = sum(c.points for c in spec.checks)
    speed = next(c for c in spec.checks if c.speed)
    got = {r["student"]: r for r in grades(out)}
    assert [(s, float(r["score"]), float(r["max_score"]), r["needs_timing"])
            for s, r in sorted(got.items())] == [
        ("ann", total - speed.points, total, speed.function),
        ("bob", total - speed.points, total, speed.function), ("stub", 0.0, total, "")], \
        log.getvalue()
    assert float(got["ann"]["not_graded_points"]) == speed.points
    ann, bob = rows["ann"], rows["bob"]
    first, again = (out / "ann" / "output.txt").read_text().split(BANNER)
    assert f"Seed: {ann.report['seed']}" in again and speed.name in again
    assert "copy_params" in first and "copy_params" not in again   # --only: that check alone
    assert BANNER not in (out / "bob" / "output.txt").read_text()
    assert any(f"{speed.name}: re-timed alone at the end of the class run: SKIP again" in n
               and "CUDA GPUs" in n for n in ann.report["notes"])
    assert any(f"{speed.name}: not re-timed" in n and "when ann's" in n
               for n in bob.report["notes"])
    assert f"re-timing ann: {speed.name} SKIP" in log.getvalue()
    results = json.loads((out / "bob" / "results.json").read_text())
    test = next(t for t in results["tests"] if t["name"].endswith(speed.name))
    assert results["score"] == total - speed.points
    assert test["score"] == 0 and test["max_score"] == speed.points and "CUDA GPUs" in test["output"]


# ------------------------------------------------------------------------- cluster launchers

def test_slurm_array_task_grades_its_shard(tmp_path):
    import os
    import subprocess

    env = dict(os.environ, SLURM_ARRAY_TASK_ID="2", SLURM_ARRAY_TASK_COUNT="4", PYTHON="echo",
               SLURM_SUBMIT_DIR=str(tmp_path))
    out = subprocess.run(["bash", str(REPO_ROOT / "course/scripts/slurm_grade.sbatch"), "subs",
                          "grades"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["-m", "autograder", "grade-folder", "subs", "grades/shard-3-of-4",
                           "--shard", "3/4"]


def test_kubernetes_indexed_job_shards_match_its_completions():
    import yaml

    job = yaml.safe_load((REPO_ROOT / "docker/k8s-grade-job.yaml").read_text())
    merge_job = yaml.safe_load((REPO_ROOT / "docker/k8s-grade-merge.yaml").read_text())
    spec = job["spec"]
    env = {e["name"]: e["value"] for e in spec["template"]["spec"]["containers"][0]["env"]}
    merge_env = {e["name"]: e["value"]
                 for e in merge_job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert spec["completionMode"] == "Indexed"
    assert int(env["SHARDS"]) == spec["completions"] == int(merge_env["SHARDS"])
    assert "GRADE_SHARD=$k/$SHARDS" in spec["template"]["spec"]["containers"][0]["args"][0]


def test_a_hidden_check_without_the_key_is_neither_timed_again_nor_awarded():
    """Graded without the answer keys (solutions/ absent), a hidden check SKIPs as reserved:
    the class run does not re-time it (it would only skip again), awards it nothing, and says
    why in needs_timing; a speed check the machine could not judge is still re-timed (and,
    until judged, earns nothing either)."""
    import types

    from autograder.integrations import retime
    from autograder.keys import RESERVED

    reserved = {"name": "h", "function": "route", "status": "skipped", "points": 0.0,
                "max_points": 2.0, "message": RESERVED}
    speed = {"name": "s", "function": "f_speedup", "status": "skipped", "points": 0.0,
             "max_points": 1.0, "message": "needs 2 GPUs"}
    row = types.SimpleNamespace(status=batch.GRADED, report={"results": [reserved]})
    assert retime.pending([row], "measure") == []
    row.report["results"].append(speed)
    assert retime.pending([row], "measure") == [(0, [speed])]
    t = gradebook.tally([reserved, speed])
    assert t.score == 0.0 and t.max_score == 3.0
    assert "route (hidden: no answer key here)" in t.needs_timing
    assert "answer key" in gradebook.rule_text()
