"""The pipeline-schedule benchmark (``python -m autograder.bench pp_schedules``) runs through the
registry's command at its smallest, and its markdown table holds what it says: the predicted
bubble, peaks and messages are course.schedules' counts of torch's lists, the ranks sent as many
messages as counted, the measured saved-for-backward peak of the first rank equals the count
where one stage per rank makes them comparable, the gradients equal one process's, and what
torch refuses is a row that says why. Its byte counter counts a known graph exactly. And it stays
torch's own: the student edition ships it, so it imports nothing from solutions/ and holds no
schedule builder, executor or split backward of its own (Assignment 10's answers).

Tier: both: the counter, the predictions and the source checks are quick; the real run (two
launches of 2 and 4 processes, about 10 s on 2 cores) is full.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, markdown_table

from autograder.bench import pp_schedules as bench_pp
from course import schedules as sch

MODULE = REPO / "autograder" / "bench" / "pp_schedules.py"


@pytest.mark.full
@pytest.mark.slow
def test_bench_pp_schedules_predicts_measures_and_skips(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "autograder.bench", "pp_schedules", "--procs", "2", "4",
         "--micro-batches", "2", "--depth", "4", "--width", "16", "--rows", "2",
         "--repeats", "1", "--warmup", "1", "--timeout", "120", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "standing in for GPUs" in proc.stdout and "load average now" in proc.stdout
    saved = (tmp_path / "pp_schedules.md").read_text()
    assert saved.strip() in proc.stdout

    rows = markdown_table(saved, "schedule")
    assert list(rows[0]) == bench_pp.HEAD
    assert [(r["schedule"], r["p"]) for r in rows] == [(name, p) for p in ("2", "4")
                                                       for name in bench_pp.SCHEDULES]
    skipped = {(r["schedule"], r["p"]): r["step s"] for r in rows if r["bubble predicted"] == ""}
    # DualPipeV wants m >= 2p, 1F1B m >= p; 8 stages do not split 4 blocks
    assert skipped[("DualPipeV", "2")].startswith("torch refuses: DualPipeV requires")
    assert skipped[("1F1B", "4")].startswith("torch refuses: ")
    for name in ("interleaved 1F1B", "interleaved ZB", "ZBV", "DualPipeV"):
        assert skipped[(name, "4")] == "depth 4 does not split into 8 stages"
    assert len(skipped) == 6
    for r in rows:
        if (r["schedule"], r["p"]) in skipped:
            continue
        p, v = int(r["p"]), int(r["v"])
        cls = bench_pp.SCHEDULES[r["schedule"]][0].removeprefix("Schedule")
        lists = sch.torch_order(cls, p, 2, v)
        predicted = bench_pp.predict(r["schedule"], p, 2, 4)
        assert r["bubble predicted"] == f"{predicted['bubble']:.3f}", r
        assert r["in flight/rank predicted"] == " ".join(
            f"{n / v:.1f}" for n in sch.peak_in_flight(lists)), r
        assert r["messages"] == str(sch.messages(lists)) == r["sent"], r
        assert float(r["step s"]) > 0 and float(r["bubble measured"]) >= 0, r
        assert r["same"] == "yes" and float(r["grad diff"]) < 1e-10, r
        measured = [float(x) for x in r["saved/rank measured"].split()]
        assert len(measured) == p and min(measured) > 0 and float(r["saved MiB max"]) >= 0, r
        if v == 1:  # rank 0 holds stage 0 alone: its saved bytes are the count's, exactly
            assert r["saved/rank measured"].split()[0] == r["in flight/rank predicted"].split()[0], r


def test_the_byte_counter_counts_what_autograd_holds():
    """Two Linear + ReLU blocks on a (4, 8) input: the input once (saved by the Linear) and each
    ReLU's output once (saved by the ReLU and the next Linear), never the weights; all released
    by the backward; a backward that keeps the graph keeps them until the graph goes."""
    torch.manual_seed(0)
    model = bench_pp.build_model(2, 8)
    counter = bench_pp.SavedBytes({q.untyped_storage().data_ptr() for q in model.parameters()})
    x = torch.randn(4, 8, dtype=torch.float64)
    one = x.numel() * x.element_size()
    with counter.hooks():
        out = model(x)
    assert counter.now == counter.peak == 3 * one  # x, first ReLU's output, last ReLU's output
    out.sum().backward(retain_graph=True)
    assert counter.now == 3 * one
    out.sum().backward()
    assert counter.now == 0 and counter.peak == 3 * one
    assert not counter.held
    # a graph kept by its backward is released with its output (as torch's split backward
    # keeps it): the ReLU's saved output does not hold its own node
    with counter.hooks():
        out = model(x)
    out.sum().backward(retain_graph=True)
    del out
    assert counter.now == 0 and not counter.held


def test_predictions_are_course_schedules_counts_of_torchs_lists():
    got = bench_pp.predict("GPipe", 4, 8, 16)
    assert got["skipped"] is None and got["bubble"] == pytest.approx(3 / 8)
    assert got["in_flight"] == [8.0] * 4 and got["messages"] == 2 * 3 * 8
    # torch's 1F1B lists name the last rank's forwards 1..m; renumbered, they are 1F1B's
    got = bench_pp.predict("1F1B", 4, 8, 16)
    assert got["bubble"] == pytest.approx(3 / 8) and got["in_flight"] == [4.0, 3.0, 2.0, 1.0]
    got = bench_pp.predict("ZBV", 4, 8, 16)
    assert got["in_flight"] == [4.0] * 4 and got["messages"] == 96
    assert bench_pp.predict("DualPipeV", 4, 4, 16)["skipped"].startswith("torch refuses: ")
    assert bench_pp.predict("ZBV", 4, 8, 12)["skipped"] == "depth 12 does not split into 8 stages"


def test_a_skipped_row_says_why_in_a_whole_row():
    text = bench_pp.table([{"schedule": "ZBV", "p": 2, "v": 2, "skipped": "failed: rank 1 | code 1"}])
    last = text.splitlines()[-1]
    assert last.startswith("| ZBV | 2 | 2 | failed: rank 1 / code 1 |")
    assert last.count("|") == text.splitlines()[0].count("|")


def test_the_bench_is_torchs_own():
    """The student edition ships it: nothing from solutions/, no schedule lists built, no
    executor and no split backward of its own (torch's schedule classes and PipelineStage do
    that), only course.schedules for the counts."""
    from autograder.integrations.edition import wanted

    assert wanted("autograder/bench/pp_schedules.py")
    source = MODULE.read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        assert not any(n.split(".")[0] == "solutions" for n in names), names
    defined = {n.name.lower() for n in ast.walk(tree)
               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    looks_like_an_answer = re.compile(r"interleav|zero_bubble|zb|dualpipe|execut|runtime|lower|"
                                      r"backward_input|backward_weight|split|order|lists")
    assert not {n for n in defined if looks_like_an_answer.search(n)}, defined
    assert "autograd.grad(" not in source and "_Action(" not in source
    assert "_PipelineScheduleRuntime" not in source  # the classes run their own lists
