"""The A4 benchmark (``python -m autograder.bench a4_sharding``) measures what it says: per-rank model-state bytes
of real runs match the ZeRO accounting where the layout is exact, its own bucketed and
overlapped gradient averaging give the per-parameter result, and the student edition leaves it
out (it holds A4-like code).

Tier: both: that the student edition leaves the benchmark out is quick; its real runs on ranks
are full.
"""
from __future__ import annotations

import pytest

from autograder.bench import a4_sharding as bench_memory
from course.launch import launch


@pytest.mark.full
@pytest.mark.slow
def test_fsdp_and_ddp_bytes_per_rank_match_the_accounting():
    """FSDP2 on 2 ranks: every parameter's dim 0 is even, so its shards are exactly half."""
    for method in ("DDP", "FSDP2 fully_shard"):
        ranks = launch(bench_memory.memory_rank, 2, method, None, backend="gloo", quiet=True)
        for row in ranks:
            num_params = row.pop("num_params")
            assert row == bench_memory.zero_bytes(num_params, 2, bench_memory.STAGES[method]), method


@pytest.mark.full
@pytest.mark.slow
def test_bucketed_and_overlapped_averaging_equal_per_parameter_all_reduce():
    ranks = launch(bench_memory.step_time_rank, 2, 1, backend="gloo", quiet=True)
    for row in ranks:
        assert row["buckets"] > 1
        for name in ("bucketed, after backward", "bucketed, overlapped"):
            assert row["difference"][name] == 0.0, name
        assert row["difference"]["DDP (PyTorch)"] < 1e-6


def test_the_student_edition_leaves_the_bench_out():
    from autograder.integrations.edition import wanted

    assert not wanted("autograder/bench/a4_sharding.py")
    for shipped in ("__init__.py", "__main__.py", "common.py", "a2_ddp.py", "tp.py", "grading.py"):
        assert wanted(f"autograder/bench/{shipped}"), shipped
