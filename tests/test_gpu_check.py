"""``make gpu-check`` (``python -m autograder.gpu_check``) without a GPU: it says so, runs only its start-up
checks and exits 0; and the parts that a GPU run relies on work and can fail here on CPU:
the per-cell CUDA probe of the lessons, the judging of Assignment 2's functions, the report.

The GPU sections themselves need a GPU: ``make gpu-check`` on a GPU machine runs them and
writes docs/gpu-report.md (docs/gpu-check.md).

Tier: both: start-up and report checks are quick; the per-cell lesson probe is full.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from autograder.gpu_check import report as gpu_check_report

REPO = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "autograder.gpu_check"]


def test_cpu_mode_says_no_gpu_runs_start_up_checks_and_exits_zero(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # CPU mode even on a GPU machine
    proc = subprocess.run([*COMMAND, "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No CUDA GPU found" in proc.stdout
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert report["gpu_found"] is False and report["exit_code"] == 0 and not report["failures"]
    sections = {s["key"]: s for s in report["sections"]}
    assert sections["start"]["status"] == "passed"
    start = {i["name"]: i["status"] for i in sections["start"]["items"]}
    assert any(n.startswith("grader CLI starts") for n in start) and len(start) >= 10
    assert set(start.values()) == {"passed"}
    for key in ("lessons", "grading", "nccl", "torchrun", "launch", "bandwidth"):
        assert sections[key]["status"] == "not run" and "no CUDA GPU" in sections[key]["why_not"]
    md = (tmp_path / "gpu-report.md").read_text()
    assert "No CUDA GPU was found on this machine" in md and "Result: passed" in md


def test_unknown_section_is_refused(tmp_path):
    proc = subprocess.run([*COMMAND, "--out", str(tmp_path), "--only", "lessons,nonsense"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nonsense" in proc.stderr


def test_report_fails_only_on_failed_items(tmp_path):
    R, S = gpu_check_report.Report, gpu_check_report.Section
    report = R(datetime.date.today().isoformat(), "host", True,
               {"torch": "x", "gpus": [{"index": 0, "name": "Some GPU", "memory_gib": 80.0,
                                        "capability": "9.0", "multiprocessors": 132}]})
    s = S("grading", "Grading")
    report.sections.append(s)
    s.add("a1 speed checks that need 2 GPUs", "skipped", "train_batch_speedup_two_gpus")
    s.add("contrast: plain fork", "expected failure", "RuntimeError: Cannot re-initialize CUDA")
    s.add("figure", "info", "", ring_ms=1.5)
    assert report.exit_code() == 0 and s.status == "passed"
    s.add("a2_ddp solution", "failed", "lost points")
    assert report.exit_code() == 1 and s.status == "failed"
    md, js = gpu_check_report.write(report, tmp_path)
    text = md.read_text()
    assert text.startswith("# GPU verification report: Some GPU") and "FAILED, 1 failure(s)" in text
    assert "ring_ms: 1.5" in text and json.loads(js.read_text())["failures"] == [
        "Grading: a2_ddp solution: lost points"]
    with pytest.raises(ValueError):
        s.add("x", "ok")


@pytest.mark.full
@pytest.mark.slow
def test_lesson_probe_counts_cells_ranks_timings_and_the_failing_cell(tmp_path, monkeypatch):
    """A small notebook through the lessons' runner: no cell uses CUDA here (even on a GPU
    machine: nothing in it asks for CUDA), the launched rank reports back, the printed timing
    is kept, and the failing cell is named with its index in the file."""
    from autograder.gpu_check import lessons as gpu_check_lessons

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# tiny"),
        nbformat.v4.new_code_cell("import torch\nfrom course.launch import launch\nx = torch.ones(3)"),
        nbformat.v4.new_code_cell("print(launch(lambda rank, world: rank + 41, 1, backend='gloo', quiet=True))"),
        nbformat.v4.new_code_cell("print('step took 12.5 ms, speedup 1.90x')"),
        nbformat.v4.new_code_cell("raise ValueError('planted')"),
        nbformat.v4.new_code_cell("print('never runs')"),
    ])
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    r = gpu_check_lessons.run_lesson(path, timeout=120)
    assert r["failed_cell"] == 4 and "ValueError: planted" in r["error"]
    assert r["code_cells"] == 5 and r["cells_run"] == 3  # the failing cell's probe never ran
    assert r["cuda_cells"] == []
    by_cell = {c["cell"]: c for c in r["cells"]}
    assert by_cell[2]["ranks"] == 1 and by_cell[1]["ranks"] == 0
    assert r["timings"] == ["[cell 3] step took 12.5 ms, speedup 1.90x"]


def test_a2_judging_passes_the_reference_and_fails_planted_bugs():
    """The NCCL section's judge, on a gloo group of one in this process: the reference's
    functions pass (all but the set-up line, which wants NCCL), broken ones fail."""
    import torch.distributed as dist

    from autograder.gpu_check import distributed as gpu_check_distributed
    from autograder.gpu_check import ranks as gpu_check_ranks

    fns = gpu_check_distributed.a2_reference_functions()
    broken = {**fns,
              "average_gradients": lambda model: [p.grad.zero_() for p in model.parameters()
                                                  if p.grad is not None],
              "ring_allreduce": lambda t: t.mul_(2),
              "make_dataloader": lambda ds, b, r, w, s: fns["make_dataloader"](
                  list(ds)[:-1], b, r, w, s)}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        good = gpu_check_ranks.rank_a2_checks(0, 1, fns)
        bad = gpu_check_ranks.rank_a2_checks(0, 1, broken)
    finally:
        dist.destroy_process_group()
    assert good["setup"][0] is False and "backend gloo" in good["setup"][1]
    assert all(good[k][0] for k in gpu_check_distributed.A2_FUNCTIONS), good
    assert not any(bad[k][0] for k in ("average_gradients", "ring_allreduce", "make_dataloader")), bad
    assert bad["train_ddp"][0]  # the reference's train_ddp, with the reference's own loader


def _result(name, status, message="", points=1.0):
    return {"name": name, "function": name, "status": status, "message": message,
            "points": points if status == "passed" else 0.0, "max_points": points}


def test_grading_judge_wants_full_solutions_and_stubs_that_are_only_unimplemented():
    from autograder.gpu_check import grading as g

    def report(*results, rc=0):
        scored = [r for r in results if r["status"] != "skipped"]
        return {"returncode": rc, "tail": "", "results": list(results),
                "score": sum(r["points"] for r in results), "max_score": sum(r["max_points"] for r in scored)}

    two = "train_batch is correct, but its speedup needs 2 or more CUDA GPUs and this machine has 1"
    full = report(_result("copy_params_values", "passed"), _result("train_batch_speedup_two_gpus", "skipped", two),
                  _result("ring_allreduce_bandwidth", "passed", "ring: 0.95x (reference 0.97x)"))
    assert g.judge(full, "solution") == (True, "2/2")
    speed = g.speed_checks(full)
    assert speed["need_two_gpus"] == ["train_batch_speedup_two_gpus"]
    assert speed["passed"] == ["ring_allreduce_bandwidth: ring: 0.95x (reference 0.97x)"]
    lost = report(_result("copy_params_values", "failed", "wrong values"), _result("other", "passed"))
    assert g.judge(lost, "solution")[0] is False
    assert g.judge(report(_result("a", "passed"), rc=1), "solution")[0] is False
    stub = report(_result("a", "failed", "NotImplementedError: write it"), _result("b", "skipped", two))
    assert g.judge(stub, "stub")[0] is True
    broken = report(_result("a", "failed", "your notebook's code could not be loaded: No module named x"))
    assert g.judge(broken, "stub")[0] is False  # zero, but because grading broke
    assert g.judge(report(_result("a", "passed")), "stub")[0] is False


def test_the_student_edition_leaves_the_gpu_check_out():
    """It grades and executes the reference solutions, which the edition does not have."""
    from autograder.integrations.edition import wanted

    for name in ("__init__.py", "__main__.py", "cli.py", "ranks.py", "report.py"):
        assert not wanted(f"autograder/gpu_check/{name}"), name
