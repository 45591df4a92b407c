"""The course on the torch releases it supports (2.11 to 2.15): one way to watch collectives,
one normalisation of their names, the newer torch.distributed names on older releases.

Every test runs on the torch installed, against the same records, 2.14.1's: on 2.14 and later
through torch's pre-hook (2.15's names normalised), on 2.11-2.13 by wrapping.

Tier: quick (two launches of 2 processes).
"""
from __future__ import annotations

import types

import pytest

from course import collectives, compat
from course.launch import launch

#: What 2.14.1's pre-hook reports for the calls of :func:`every_kind_of_call` on gloo:
#: (op, input tensors, output tensors, input elements, output elements, peer).
EXPECTED = [("ALLREDUCE", 1, 0, 4, 0, -1), ("BROADCAST", 1, 0, 4, 0, -1),
            ("ALLGATHER", 1, 1, 4, 8, -1), ("ALLGATHER", 1, 2, 4, 8, -1),
            ("REDUCE_SCATTER", 1, 1, 4, 2, -1), ("REDUCE_SCATTER", 2, 1, 8, 4, -1),
            ("ALLTOALL", 1, 1, 4, 4, -1), ("ALLTOALL", 2, 2, 4, 4, -1),
            ("BARRIER", 0, 0, 0, 0, -1), ("REDUCE", 1, 0, 4, 0, -1),
            ("GATHER", 1, 2, 4, 8, -1), ("SCATTER", 2, 1, 8, 4, -1), ("SEND", 1, 0, 4, 0, 1),
            ("ALLGATHER", 1, 1, 4, 8, -1), ("REDUCE_SCATTER", 1, 1, 4, 2, -1),
            ("ALLREDUCE", 1, 0, 4, 0, -1), ("ALLGATHER", 2, 2, 8, 16, -1),
            ("REDUCE_SCATTER", 2, 2, 8, 4, -1), ("SCATTER", 2, 1, 8, 4, -1),
            ("ALLGATHER", 1, 1, 4, 8, -1)]


def every_kind_of_call(rank, world_size):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from course.collectives import watch_group

    seen, x = [], torch.ones(4)
    lists_all_to_all = hasattr(dist.ProcessGroup, "register_pre_hook")  # 2.11's gloo has none
    note = (lambda op, i, o, peer: seen.append(
        (op, len(i), len(o), sum(t.numel() for t in i), sum(t.numel() for t in o), peer)))
    with watch_group(None, note):
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        dist.all_gather_into_tensor(torch.empty(8), x)
        dist.all_gather([torch.empty(4), torch.empty(4)], x)
        dist.reduce_scatter_tensor(torch.empty(2), x)
        dist.reduce_scatter(torch.empty(4), [torch.ones(4), torch.ones(4)])
        dist.all_to_all_single(torch.empty(4), x)
        if lists_all_to_all:
            dist.all_to_all([torch.empty(2), torch.empty(2)], [torch.ones(2), torch.ones(2)])
        dist.barrier()
        dist.reduce(x, 0)
        dist.gather(x, [torch.empty(4), torch.empty(4)] if rank == 0 else None, 0)
        dist.scatter(torch.empty(4), [torch.ones(4), torch.ones(4)] if rank == 0 else None, 0)
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        funcol.all_gather_tensor(x, 0, [0, 1])
        funcol.reduce_scatter_tensor(torch.ones(4), "sum", 0, [0, 1])
        funcol.all_reduce(x, "sum", [0, 1])
        with dist._coalescing_manager(async_ops=False):
            dist.all_gather_into_tensor(torch.empty(8), x)
            dist.all_gather_into_tensor(torch.empty(8), x)
        with dist._coalescing_manager(async_ops=False):
            dist.reduce_scatter_tensor(torch.empty(2), x)
            dist.reduce_scatter_tensor(torch.empty(2), x)
        mesh = init_device_mesh("cpu", (2,))
        distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]).redistribute(
            mesh, [Replicate()]).to_local()
    return seen, lists_all_to_all


@pytest.mark.parametrize("way", ["this torch's", "wrap"])
def test_watch_group_sees_every_kind_of_call(way):
    """Both ways of watching give 2.14.1's records: names, tensors, elements, peers. The
    wrapping way follows what 2.11-2.13's Python functions call (2.14 calls the dispatcher's
    ops instead): it is tested on those releases, where it is the way taken."""
    import torch.distributed as dist

    if way == "wrap" and hasattr(dist.ProcessGroup, "register_pre_hook"):
        pytest.skip("this torch has ProcessGroup.register_pre_hook: the wrapping way is for "
                    "2.11-2.13 and is tested there (docs/testing.md: other torch releases)")
    env = {collectives.WATCH_ENV: "wrap"} if way == "wrap" else {}
    (rank0, lists), (rank1, _) = launch(every_kind_of_call, 2, quiet=True, env=env)
    expected = [e for e in EXPECTED if lists or e != ("ALLTOALL", 2, 2, 4, 4, -1)]
    assert rank0 == expected
    assert [r[0] for r in rank1] == [("RECV" if e[0] == "SEND" else e[0]) for e in expected]


def test_the_names_of_every_release_normalise_to_one():
    renamed = {"ALLGATHER_BASE": "ALLGATHER", "REDUCE_SCATTER_BASE": "REDUCE_SCATTER",
               "ALLTOALL_BASE": "ALLTOALL", "ALLGATHER_INTO_TENSOR_COALESCED": "ALLGATHER",
               "REDUCE_SCATTER_TENSOR_COALESCED": "REDUCE_SCATTER", "ALLREDUCE": "ALLREDUCE"}
    for new, old in renamed.items():
        assert collectives.normalise(new) == old
        assert collectives.normalise(types.SimpleNamespace(name=new)) == old
        assert collectives.normalise(f"OpType.{new}") == old
    assert set(renamed.values()) <= set(collectives.OPS)


def test_install_adds_the_newer_names_only_where_missing(monkeypatch):
    import torch.distributed as dist

    for new, old in compat.ALIASES.items():
        monkeypatch.delattr(dist, new, raising=False)
    compat.install()
    for new, old in compat.ALIASES.items():
        assert getattr(dist, new) is getattr(dist, old)
    marker = object()
    monkeypatch.setattr(dist, "all_gather_single", marker)
    compat.install()
    assert dist.all_gather_single is marker


def test_needs_says_which_release(capsys):
    assert compat.needs(2, 0, "anything")
    assert not compat.needs(99, 0, "a future feature")
    assert "a future feature needs torch >= 99.0" in capsys.readouterr().out


def test_every_test_file_is_sorted_for_the_other_torch_runs():
    """CI runs ``make test-torch`` (the quick tier's tests that reach torch's APIs) on the oldest
    and newest supported torch: a new test file must be put in the Makefile's TORCH_TESTS or
    TORCH_INDEPENDENT_TESTS, never fall out of both unnoticed."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    makefile = repo.joinpath("Makefile").read_text().replace("\\\n", " ")
    lists = {name: set(re.search(rf"^{name} = (.*)$", makefile, re.M).group(1).split())
             for name in ("TORCH_TESTS", "TORCH_INDEPENDENT_TESTS")}
    files = {p.stem for p in repo.joinpath("tests").glob("test_*.py")}
    assert not lists["TORCH_TESTS"] & lists["TORCH_INDEPENDENT_TESTS"]
    assert lists["TORCH_TESTS"] | lists["TORCH_INDEPENDENT_TESTS"] == files, (
        files ^ (lists["TORCH_TESTS"] | lists["TORCH_INDEPENDENT_TESTS"]))
