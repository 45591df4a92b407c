"""The expert-parallel benchmark (``python -m autograder.bench a7_expert_parallel``) measures
what it says: its own expert-parallel MoE layer equals the dense one (output, load-balancing
loss, gradients of the tokens, the router and every expert, float64, uneven token counts, on 1
and 2 ranks), its routing and capacity follow Assignment 7's contract on hand-made cases, the
bytes each rank sends counted at the process group are the formula's exactly, the balanced
router is more balanced than the random one, the table and the plot are produced; and the
student edition leaves the benchmark and its layer (``moe_dispatch``) out (they hold A7's
answers).

Tier: both: the routing cases and that the student edition leaves the benchmark out are quick;
its real runs on ranks are full.
"""
from __future__ import annotations

import ast

import pytest
import torch

from conftest import REPO

from autograder.bench import a7_expert_parallel as bench_ep
from autograder.bench import moe_dispatch as moe
from course.launch import launch


def test_routing_and_capacity_follow_the_contract():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    weights, experts = moe.route(logits, 2)
    assert experts.tolist() == [[1, 2], [0, 1]]  # ties to the lower index
    assert torch.allclose(weights, torch.full((2, 2), 0.5, dtype=torch.float64))
    with pytest.raises(ValueError):
        moe.route(logits, 5)
    assert moe.expert_capacity(50, 10, 2, 1.1) == 11  # exact: 11/10, not float 1.1
    assert moe.expert_capacity(0, 4, 1, 1.25) == 0 and moe.expert_capacity(8, 4, 2, 1) == 4
    # every first choice before any second: token 3's first choice (1) is kept and token 2's
    # second (1 too) is not; in token order it would be the other way round
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    assert moe.keep_mask(experts, 2).tolist() == [[True, True], [True, True], [False, False],
                                                  [True, False]]
    assert not moe.keep_mask(experts, 0).any()


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_expert_parallel_equals_the_dense_layer(world_size):
    for diff in launch(bench_ep.check_rank, world_size, backend="gloo", quiet=True):
        assert diff < 1e-12


@pytest.mark.full
@pytest.mark.slow
def test_bench_a7_counts_bytes_and_load_and_plots(tmp_path):
    rows = bench_ep.measure([1, 2], [2, 4], count=48, warmup=0, repeats=1, d=16, hidden=32,
                            timeout=240.0, echo=lambda s: None)
    by = {(r["router"], r["experts"], r["processes"]): r for r in rows}
    assert len(by) == 2 * 2 * 2 and not any(r["skipped"] for r in rows)
    for r in rows:
        assert r["seconds"] > 0 and r["check"] < 1e-12
        assert r["exact"], r  # every rank's counted bytes are the formula's
        assert (r["sent_forward"], r["sent_backward"]) == r["expected"], r
        if r["processes"] == 1:
            assert r["expected"] == (0, 0) and r["calls"] == ([], [])
        else:  # counts, dispatch, combine; backward: the two token exchanges
            assert r["calls"] == (["ALLTOALL"] * 3, ["ALLTOALL"] * 2), r["calls"]
            assert r["sent_forward"] > 0 and r["sent_forward"] % (16 * 4) == 0  # whole rows
    for e in (2, 4):  # one rank holds every expert
        assert by["random", e, 1]["load"]["rank_kept"] == 1.0
    # top-2 of 2 experts is every expert: balanced whatever the router; of 4 it is not
    assert by["random", 2, 2]["load"]["expert_routed"] == 1.0
    assert (by["balanced", 4, 2]["load"]["expert_routed"]
            < by["random", 4, 2]["load"]["expert_routed"])
    text = bench_ep.table(rows)
    assert text.count("\n") == len(rows) and "counted != formula" not in text
    assert bench_ep.plot(rows, tmp_path, "test", "tiny").stat().st_size > 0


@pytest.mark.full
@pytest.mark.slow
def test_bench_a7_skips_what_does_not_split():
    rows = bench_ep.measure([2], [3], routers=["random"], count=8, d=4, hidden=4,
                            echo=lambda s: None)
    assert rows == [{"router": "random", "experts": 3, "processes": 2,
                     "skipped": "3 experts % 2 != 0"}]
    assert "skipped: 3 experts % 2" in bench_ep.table(rows)


def test_the_student_edition_leaves_the_bench_out():
    from autograder.integrations.edition import wanted

    bench = REPO / "autograder" / "bench"
    left_out = {"a7_expert_parallel.py", "moe_dispatch.py"}  # the bench and its MoE layer
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
