"""Tests of `course.flight`: the records of real gloo runs (collectives, point-to-point, a
subgroup, a second group of the default group's ranks), a stuck rank's "started" entry, the JSON
round trip, the picture.

Tier: quick: two launches of 2 ranks (about 2 s each, one with a 2 s collective timeout).
"""
from __future__ import annotations

import pytest

from course import collectives, flight
from course.launch import launch


def _every_kind(rank, world_size):
    import torch
    import torch.distributed as dist

    from course.flight import record_trace

    sub = dist.new_group([0])  # rank 1 is no member: its record_trace leaves it out
    twin = dist.new_group([0, 1])  # the default group's ranks, another group: its own count
    with record_trace(groups=[sub, twin]) as trace:
        x = torch.ones(3)
        dist.all_reduce(x)
        dist.broadcast(torch.zeros(2, 2, dtype=torch.float64), src=0)
        if rank == 0:
            dist.send(x, 1)
            dist.all_reduce(torch.ones(5, dtype=torch.int64), group=sub)
        else:
            dist.recv(x, 0)
        dist.all_reduce(torch.ones(1), group=twin)
        dist.barrier()
    return trace


@pytest.mark.parametrize("way", ["this torch's", "wrap"])
def test_every_kind_of_call_is_recorded_in_order_and_completed(way):
    """Both ways of watching (torch 2.14's hooks; 2.11-2.13's wrapping, forced here) agree."""
    env = {collectives.WATCH_ENV: "wrap"} if way == "wrap" else {}
    rank0, rank1 = launch(_every_kind, 2, quiet=True, timeout=60, collective_timeout=20, env=env)
    # torch's group names: the default group "0", then "1", "2" in the order new_group is called
    expected = [(0, "0", [0, 1], "ALLREDUCE", [[3]], "float32", None),
                (1, "0", [0, 1], "BROADCAST", [[2, 2]], "float64", None),
                (2, "0", [0, 1], "SEND", [[3]], "float32", 1),
                (0, "1", [0], "ALLREDUCE", [[5]], "int64", None),  # the subgroup: its own seq
                (0, "2", [0, 1], "ALLREDUCE", [[1]], "float32", None),  # the twin: its own too
                (3, "0", [0, 1], "BARRIER", [], "", None)]
    seen = [(e["seq"], e["group"], e["members"], e["op"], e["shapes"], e["dtype"], e["peer"])
            for e in rank0]
    assert seen == expected
    assert [list(e) for e in rank0] == [list(flight.KEYS)] * len(rank0)
    assert [(e["seq"], e["group"], e["op"]) for e in rank1] == [
        (0, "0", "ALLREDUCE"), (1, "0", "BROADCAST"), (2, "0", "RECV"), (0, "2", "ALLREDUCE"),
        (3, "0", "BARRIER")]
    assert rank1[2]["peer"] == 0 and rank1[2]["shapes"] == [[3]]
    assert {e["state"] for e in rank0 + rank1} == {"completed"}


def _stuck(rank, world_size, folder):
    import torch
    import torch.distributed as dist

    from course.flight import record_trace, save_trace

    try:  # the error leaves the with block, as course.flight's docstring asks
        with record_trace() as trace:
            dist.all_reduce(torch.ones(2))
            if rank == 0:
                dist.all_reduce(torch.ones(2))  # rank 1 never joins: times out
            else:
                dist.recv(torch.ones(2), 0)  # rank 0 never sends: times out
    except RuntimeError:
        pass
    save_trace(folder, trace, rank)
    return trace


def test_a_stuck_rank_keeps_its_call_started_and_the_traces_round_trip(tmp_path):
    rank0, rank1 = launch(_stuck, 2, str(tmp_path), quiet=True, timeout=60, collective_timeout=2)
    assert [(e["seq"], e["state"]) for e in rank0] == [(0, "completed"), (1, "started")]
    assert [(e["seq"], e["op"], e["state"]) for e in rank1] == [(0, "ALLREDUCE", "completed"),
                                                                 (1, "RECV", "started")]
    assert flight.load_traces(tmp_path) == [rank0, rank1]
    (tmp_path / "rank1.json").unlink()
    (tmp_path / "rank3.json").write_text('{"rank": 3, "entries": []}')
    assert flight.load_traces(tmp_path) == [rank0, [], [], []]
    assert flight.load_traces(tmp_path / "nothing-here") == []


def test_plot_traces_draws_every_entry_and_the_mark():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entry = {"group": "5", "members": [0, 1], "shapes": [[3]], "dtype": "float32", "peer": None}
    traces = [[{**entry, "seq": 0, "op": "ALLREDUCE", "state": "completed"},
               {**entry, "seq": 1, "op": "ALLREDUCE", "state": "started"},
               {**entry, "group": "7", "members": [0, 2], "seq": 0, "op": "SEND", "peer": 2,
                "state": "started"}],
              [{**entry, "seq": 0, "op": "ALLREDUCE", "state": "completed"}], []]
    ax = flight.plot_traces(traces, mark=("5", 1))
    texts = [t.get_text() for t in ax.texts]
    assert sum(t.startswith("ALLREDUCE") for t in texts) == 3 and any("SEND" in t for t in texts)
    red = [p for p in ax.patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(red) == 1 and red[0].get_height() == 2  # ranks 0 and 1, group "5"'s members
    assert "group 7: ranks 0,2" in texts
    plt.close(ax.figure)


@pytest.mark.parametrize("groups", [[("0", [0, 1])],
                                    [("0", [0, 1, 2, 3]), ("3", [1, 3]), ("10", [2, 3]),
                                     ("2", [2, 3])]])
def test_groups_are_drawn_largest_first_then_by_members_then_by_name(groups):
    traces = [[{"seq": 0, "group": g, "members": m, "op": "BARRIER", "shapes": [], "dtype": "",
                "peer": None, "state": "completed"} for g, m in reversed(groups)]]
    assert flight._groups(traces) == groups
