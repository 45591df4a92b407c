"""The checkpoint and restart benchmark (``python -m autograder.bench a9_resilience``) runs through
the registry's command at its smallest, and its two markdown tables hold what they say: every
save, asynchronous save and load took time, the bytes each rank wrote are at least its state's,
the loaded state equals the saved one, and a SIGKILLed rank's job came back under torchrun from
its checkpoint, with the seconds from the kill split into parts that add up. And it stays torch's
own: it imports nothing from solutions/ and defines none of Assignment 9's graded functions.

Tier: both: the source check and the table of a failed run are quick; the real run (two launches
and two torchrun jobs, about 30 s on 2 cores) is full.
"""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import REPO, markdown_table

from autograder.bench import a9_resilience as bench_a9

MODULE = REPO / "autograder" / "bench" / "a9_resilience.py"


@pytest.mark.full
@pytest.mark.slow
def test_bench_a9_saves_loads_and_restarts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "autograder.bench", "a9_resilience", "--procs", "1", "2",
         "--widths", "64", "--repeats", "1", "--warmup", "0", "--restart-width", "64",
         "--timeout", "120", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "standing in for GPUs" in proc.stdout and "load average now" in proc.stdout
    saved = (tmp_path / "a9_resilience.md").read_text()
    assert saved.strip() in proc.stdout

    rows = markdown_table(saved, "width")
    assert [(r["width"], r["n"]) for r in rows] == [("64", "1"), ("64", "2")]
    assert list(rows[0]) == ["width", "params", "n", "MiB/rank", "state/rank", "save s",
                             "async blocked s", "async total s", "load s", "same"]
    params = 4 * (64 * 64 + 64)
    for r in rows:
        assert r["params"] == f"{params / 1e6:.2f}M" and r["same"] == "yes", r
        for key in ("save s", "async blocked s", "async total s", "load s"):
            assert float(r[key]) > 0, (key, r)
        # the total includes the blocked part; the files hold at least the state's bytes
        assert float(r["async total s"]) >= float(r["async blocked s"]), r
        assert float(r["MiB/rank"]) >= float(r["state/rank"]) > 0, r
    # the state splits over the ranks: half each (64 rows in shards of 32; to the 0.01 MiB shown)
    assert abs(2 * float(rows[1]["state/rank"]) - float(rows[0]["state/rank"])) <= 0.02

    restarts = markdown_table(saved, "n")
    assert [r["n"] for r in restarts] == ["1", "2"]
    assert list(restarts[0]) == ["n", "width", "resumed at step", "kill to first step s",
                                 "to new process", "to process group", "build + load",
                                 "first step"]
    for r in restarts:
        assert r["resumed at step"] == str(bench_a9.SAVE_AT), r  # its checkpoint, not step 0
        parts = [float(r[k]) for k in ("to new process", "to process group", "build + load",
                                       "first step")]
        assert all(p >= 0 for p in parts) and float(r["kill to first step s"]) > 0, r
        assert abs(sum(parts) - float(r["kill to first step s"])) <= 0.02, r  # 2-decimal rounding


def test_a_failed_run_is_a_row_that_says_so():
    text = bench_a9.table([{"width": 8, "processes": 2, "failed": "rank 1 | exited with code 1"}])
    assert "| 8 |  | 2 | failed: rank 1 / exited with code 1 |" in text  # no stray column
    assert text.splitlines()[-1].count("|") == text.splitlines()[0].count("|")
    text = bench_a9.restart_table([{"processes": 4, "width": 8, "failed": "exit timeout"}])
    assert text.splitlines()[-1].startswith("| 4 | 8 | failed: exit timeout |")
    assert text.splitlines()[-1].count("|") == text.splitlines()[0].count("|")


def test_the_bench_is_torchs_own():
    """No solutions/ import, and none of A9's graded functions (the student edition ships it)."""
    tree = ast.parse(MODULE.read_text())
    graded = {"diagnose", "save_checkpoint", "load_latest", "train_resumable", "async_save"}
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & graded
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        assert not any(n.split(".")[0] == "solutions" for n in names), names
