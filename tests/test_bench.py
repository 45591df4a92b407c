"""The benchmarks' registry (``python -m autograder.bench``) lists and runs what it names, the
process counter of the grading benchmark counts a known tree exactly, and the grading benchmark
writes its table (one cheap assignment, one round) between its markers and nowhere else.

Tier: both: the registry and the process counter are quick; the grading benchmark's table is
full (whole gradings).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

import autograder.bench as bench
from autograder.bench import grading
from autograder.bench.processes import ProcessCounter

TINY = '''
import argparse, sys
def main(argv=None):
    p = argparse.ArgumentParser(prog="tiny")
    p.add_argument("--size", type=int, default=2)
    args = p.parse_args(argv)
    print("tiny ran with size", args.size)
    return 0 if args.size > 0 else 3
'''


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A benchmark module of the test's own, registered as ``tiny`` for this test only."""
    (tmp_path / "tiny_bench_module.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench.BENCHMARKS, "tiny",
                        bench.Benchmark("tiny", "tiny_bench_module", "a test's benchmark"))
    monkeypatch.setitem(bench.BENCHMARKS, "gone",
                        bench.Benchmark("gone", "no_such_module_here", "not in this copy"))


def test_the_command_lists_every_registered_benchmark():
    proc = subprocess.run([sys.executable, "-m", "autograder.bench"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines()[1:] if line.startswith("  ") and
              not line.startswith("   ")]
    assert listed == list(bench.BENCHMARKS) == ["a2_ddp", "a4_sharding", "tp", "a6_context_parallel",
                                             "a7_expert_parallel", "a9_resilience", "pp_schedules",
                                             "check-latency", "grading"]
    assert "not in this copy" not in proc.stdout  # every module is in the instructor's copy


def test_the_registry_runs_named_benchmarks_with_their_options(tiny, capsys):
    assert bench.main(["tiny", "--size", "5"]) == 0
    assert capsys.readouterr().out == "tiny ran with size 5\n"
    assert bench.main(["tiny", "tiny"]) == 0  # several: each with its defaults, each announced
    out = capsys.readouterr().out
    assert out.count("tiny ran with size 2") == 2 and out.count("=== tiny") == 2
    assert bench.main(["tiny", "--size", "0"]) == 3  # the benchmark's own exit code


def test_the_registry_refuses_what_it_cannot_run(tiny, capsys):
    assert bench.main(["nonsense"]) == 2
    assert "unknown benchmark 'nonsense'" in capsys.readouterr().err
    assert bench.main(["tiny", "tiny", "--size", "3"]) == 2  # whose options?
    assert "one benchmark at a time" in capsys.readouterr().err
    assert bench.main([]) == 0
    assert "[not in this copy]" in capsys.readouterr().out.split("gone", 1)[1].splitlines()[0]
    assert bench.main(["gone"]) == 1
    assert "no_such_module_here is not in this copy" in capsys.readouterr().err


@pytest.mark.full
@pytest.mark.slow
def test_a_real_benchmark_runs_through_the_registry(tmp_path):
    """tp, as small as it goes: the registry's command, the shared header and plot."""
    proc = subprocess.run([sys.executable, "-m", "autograder.bench", "tp", "--procs", "2",
                           "--hidden", "16", "--tokens", "8", "--repeats", "1", "--warmup", "0",
                           "--timeout", "240", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Hardware: ") and "load average now" in proc.stdout
    for how in ("dense 1t", "dense 2t", "TP x2", "DP x2"):
        assert f"{how}: done" in proc.stdout
    assert (tmp_path / "tp_vs_dp.png").stat().st_size > 0


def test_the_process_counter_counts_a_known_tree():
    """A parent with two children and a grandchild, all alive for seconds: exactly 3 + 1."""
    code = textwrap.dedent("""
        import subprocess
        kids = [subprocess.Popen(["sleep", "3"]) for _ in range(2)]
        kids.append(subprocess.Popen(["sh", "-c", "sleep 3 & wait"]))
        for k in kids:
            k.wait()
    """)
    counter = ProcessCounter()
    proc = subprocess.Popen([sys.executable, "-c", code])
    counter.start(proc.pid)
    proc.wait(timeout=60)
    assert counter.stop() == 4
    assert 0 < counter.cpu_seconds < 3


def _run(seconds, processes, results, rc=0):
    return {"seconds": seconds, "processes": processes, "poll_cpu_s": 0.1, "returncode": rc,
            "timed_out": False, "output": "", "report": {
                "results": results, "score": sum(r["points"] for r in results),
                "max_score": sum(r["max_points"] for r in results)}}


def _check(name, seconds, status="passed"):
    return {"name": name, "seconds": seconds, "status": status,
            "points": 1.0 if status == "passed" else 0.0, "max_points": 1.0}


def test_summary_takes_medians_and_names_what_went_wrong():
    runs = [_run(10.0, 5, [_check("a", 1.0), _check("b", 3.0), _check("c", 2.0), _check("d", 0.5)]),
            _run(30.0, 7, [_check("a", 5.0), _check("b", 1.0), _check("c", 2.0), _check("d", 0.1)]),
            _run(20.0, 6, [_check("a", 4.0), _check("b", 2.0), _check("c", 2.5), _check("d", 0.2)])]
    s = grading.summarise(runs, "reference")
    assert (s["seconds"], s["processes"], s["score"], s["problems"]) == (20.0, 6, "4/4", [])
    assert s["slowest"] == [("a", 4.0), ("c", 2.0), ("b", 2.0)]
    lost = grading.summarise([_run(1.0, 2, [_check("a", 1.0), _check("b", 1.0, "failed")])], "reference")
    assert lost["problems"] == ["the reference lost points: b"] and lost["score"] == "1/2"
    earned = grading.summarise([_run(1.0, 2, [_check("a", 1.0)])], "stub")
    assert earned["problems"] == ["the stub scored 1"]
    broken = grading.summarise([{**_run(1.0, 1, []), "returncode": 1, "report": None}], "stub")
    assert broken["problems"] and broken["score"] == "?"


def test_the_table_goes_between_the_markers_and_replaces_the_last_one(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{grading.BEGIN}\nold table\n{grading.END}\n\nafter\n")
    grading.write_doc(doc, "new table")
    grading.write_doc(doc, "newer table")
    text = doc.read_text()
    assert text == f"# B\n\nbefore\n\n{grading.BEGIN}\nnewer table\n{grading.END}\n\nafter\n"
    bare = tmp_path / "bare.md"
    bare.write_text("# B\n")
    grading.write_doc(bare, "t")
    grading.write_doc(bare, "u")
    assert bare.read_text() == f"# B\n\n## Grading\n\n{grading.BEGIN}\nu\n{grading.END}\n"


def test_the_shipped_doc_has_the_markers_once():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text.count(grading.BEGIN) == 1 and text.count(grading.END) == 1
    assert text.index(grading.BEGIN) < text.index(grading.END)


@pytest.mark.full
@pytest.mark.slow
def test_grading_benchmark_table_for_a1(tmp_path, capsys):
    """One round of A1 (the cheapest): the reference full, the stub zero, real processes and
    real check names in the table, written into the doc given."""
    from autograder.checking.spec import load_spec

    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{grading.BEGIN}\n{grading.END}\n")
    rc = grading.main(["--repeats", "1", "--assignment", "a1", "--speed", "skip", "--doc", str(doc)])
    out = capsys.readouterr().out
    assert rc == 0, out
    spec = load_spec("a1_data_parallel")
    total = sum(c.points for c in spec.checks if not c.speed)  # --speed skip: speed checks SKIP
    text = doc.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| a1_data_parallel |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    ref_procs, stub_procs = (int(n) for n in cells[3].split(" / "))
    assert ref_procs >= 1 and stub_procs >= 1  # at least the sandbox's worker
    assert cells[4] == f"{total:g}/{total:g}" and cells[5] == f"0/{total:g}"
    names = {c.name for c in spec.checks}
    for cell in cells[6:8]:
        slowest = [part.rsplit(" ", 1) for part in cell.split("; ")]
        assert len(slowest) == 3 and all(name in names and float(s) >= 0 for name, s in slowest)
    assert "python -m autograder.bench grading --repeats 1 --speed skip --assignment " \
           "a1_data_parallel --doc" in text
    assert "Load average (1 min):" in text and "Machine: " in text
