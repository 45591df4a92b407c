"""The tensor-parallel benchmark (``python -m autograder.bench tp``) counts what it claims: the
bytes each rank hands to collectives per step, forward and backward, against the formulas of
lesson 13 (TP: one all-reduce of a (tokens, d) activation each way; DP: all the gradients once).

Tier: full: real runs of the TP benchmark on 2 ranks.
"""
from __future__ import annotations

import pytest


@pytest.mark.full
@pytest.mark.slow
def test_bench_tp_counts_the_bytes_of_tp_and_dp(tmp_path):
    from autograder.bench import tp as bench_tp

    d, tokens = 16, 8
    rows = bench_tp.measure([2], [d], tokens, warmup=0, repeats=1, timeout=240.0)
    by_how = {r["how"]: r for r in rows}
    assert set(by_how) == {"dense 1t", "dense 2t", "TP x2", "DP x2"}
    assert by_how["dense 1t"]["calls"] == by_how["dense 2t"]["calls"] == 0
    assert by_how["TP x2"]["calls"] == 2
    assert by_how["TP x2"]["bytes"] == 2 * tokens * d * 4
    assert by_how["TP x2"]["params"] == (8 * d * d + 5 * d - d) // 2 + d  # all but the last bias split
    assert by_how["DP x2"]["calls"] == 1
    assert by_how["DP x2"]["bytes"] == (8 * d * d + 5 * d) * 4
    assert all(r["seconds"] > 0 for r in rows)
    assert bench_tp.plot(rows, tmp_path, "test", tokens).stat().st_size > 0
