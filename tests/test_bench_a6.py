"""The context-parallel benchmark (``python -m autograder.bench a6_context_parallel``) measures
what it says: its own ring attention and Ulysses equal full attention (output and q/k/v
gradients, float64, causal or not, on 1 and 2 ranks), the bytes each rank sends are the
formulas' exactly, the memory per rank falls with more ranks, a configuration over the memory
cap is skipped and says so, the table and the plot are produced; and the student edition
leaves the module and its attention (``cp_attention``) out (they hold A6's answers).

Tier: both: that the student edition leaves the benchmark out is quick; its real runs on ranks
are full.
"""
from __future__ import annotations

import ast

import pytest

from conftest import REPO

from autograder.bench import a6_context_parallel as bench_cp
from course.launch import launch


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_ring_and_ulysses_equal_full_attention(world_size):
    for causal in (False, True):
        ranks = launch(bench_cp.check_rank, world_size, 8 * world_size, causal, backend="gloo",
                       quiet=True)
        for diffs in ranks:
            assert set(diffs) == {"ring", "ulysses"}
            assert max(diffs.values()) < 1e-12, (causal, diffs)


@pytest.mark.full
@pytest.mark.slow
def test_bench_a6_counts_bytes_and_memory_and_plots(tmp_path):
    heads, head_dim, seqs = 4, 8, [32, 64]
    # a cap that full (matmul) at 64 tokens passes (its S x S scores), and nothing else does
    need = {(m, n): bench_cp.estimate_bytes(m, n, 64, heads, head_dim) * n
            for m in bench_cp.METHODS for n in (1, 2) if n == 1 or not m.startswith("full")}
    biggest_other = max(b for key, b in need.items() if key != ("full-matmul", 1))
    assert biggest_other < need["full-matmul", 1]
    cap = (biggest_other + need["full-matmul", 1]) / 2 / 2**30
    rows = bench_cp.measure([1, 2], seqs, bench_cp.METHODS, warmup=1, repeats=1, max_gib=cap,
                            heads=heads, head_dim=head_dim, timeout=240.0, echo=lambda s: None)
    by = {(r["method"], r["processes"], r["seq"]): r for r in rows}
    assert len(by) == 2 * 2 + 2 * 2 * 2  # full: 1 process; ring and Ulysses: 1 and 2
    assert "--max-gib" in by["full-matmul", 1, 64]["skipped"]
    done = [r for r in rows if not r["skipped"]]
    assert len(done) == len(rows) - 1
    for r in done:
        assert r["seconds"] > 0 and r["peak"] > 0
        assert (r["sent_forward"], r["sent_backward"]) == r["expected"], r
        if r["method"] in ("ring", "ulysses"):
            assert r["check"] < 1e-12
    for seq in seqs:
        elements = heads * seq // 2 * head_dim * 4  # bytes of one rank's q on 2 ranks
        assert by["ring", 2, seq]["sent_forward"] == 2 * elements           # (n-1)(|K|+|V|)
        assert by["ring", 2, seq]["sent_backward"] == 3 * 2 * elements      # (2n-1)(|K|+|V|)
        assert by["ulysses", 2, seq]["sent_forward"] == 4 * elements // 2   # 4 (n-1)/n |q|
        assert by["ring", 1, seq]["sent_forward"] == by["ring", 1, seq]["sent_backward"] == 0
        for method in ("ring", "ulysses"):
            assert by[method, 2, seq]["peak"] < by[method, 1, seq]["peak"], (method, seq)
        # the inputs alone: q, k, v and the output's gradient
        assert by["full-sdpa", 1, seq]["peak"] >= 4 * 2 * elements
    text = bench_cp.table(rows)
    assert "skipped: needs" in text and text.count("\n") == len(rows)
    assert bench_cp.plot(rows, tmp_path, "test", "tiny").stat().st_size > 0


def test_the_student_edition_leaves_the_bench_out():
    from autograder.integrations.edition import wanted

    bench = REPO / "autograder" / "bench"
    left_out = {"a6_context_parallel.py", "cp_attention.py"}  # the bench and its attention
    for name in left_out:
        assert not wanted(f"autograder/bench/{name}"), name
    stems = {name.removesuffix(".py") for name in left_out}
    for path in bench.glob("*.py"):  # what ships never imports what does not
        if not wanted(f"autograder/bench/{path.name}"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not stems & {part for n in names for part in n.split(".")}, path.name
