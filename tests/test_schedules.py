"""Tests of `course.schedules` (lesson 18's toolkit): torch's action format read, each kind of
mistake named by `check`, the simulated times against times counted by hand, and the counters
against the published closed forms on torch's own schedule classes.

Tier: quick: pure Python and torch's schedule classes built from stand-in stages (no processes).
"""
from __future__ import annotations

import pytest

from course import schedules as sch
from course.schedules import Op

#: GPipe on 2 ranks with 2 micro-batches, written by hand
GPIPE = {0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 1B1"}
#: the same actions, rank 0's backward moved before its second forward: each rank waits for the other
CROSSED = {0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"}


def test_parse_reads_text_objects_pairs_and_skips_the_rest():
    from torch.distributed.pipelining.schedules import _Action

    parsed = sch.parse({0: ["0F0", None, "", "0I0", "0REDUCE_GRAD", "0WAIT_REDUCE_GRAD", "0W0"], 1: "1F0  1B0"})
    assert parsed[0] == [(Op(0, "F", 0),), (Op(0, "I", 0),), (Op(0, "W", 0),)]
    assert parsed[1] == [(Op(1, "F", 0),), (Op(1, "B", 0),)]
    assert sch.parse([[_Action.from_str("3SEND_F12")]]) == {0: [(Op(3, "SEND_F", 12),)]}
    assert sch.parse_action("3WAIT_SEND_B1") == (Op(3, "WAIT_SEND_B", 1),)
    pair = _Action.from_str("(4F4;3B0)OVERLAP_F_B")
    assert sch.parse_action(pair) == (Op(4, "F", 4), Op(3, "B", 0)) == sch.parse_action(str(pair))
    for wrong in ("2X0", "2F", "F0", "(1F0;2F1)OVERLAP_F_B"):
        with pytest.raises(ValueError):
            sch.parse_action(wrong)
    with pytest.raises(ValueError, match="ranks must be 0..p-1"):
        sch.parse({1: "1F0"})


def test_simulated_times_are_the_hand_counted_ones():
    """F costs 1 and B 2; rank 1 starts at 1, rank 0's backwards wait for rank 1's."""
    timeline = sch.simulate(GPIPE)
    assert [(str(op), s, e) for op, s, e in timeline[0]] == [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)]
    assert [(str(op), s, e) for op, s, e in timeline[1]] == [("1F0", 1, 2), ("1F1", 2, 3), ("1B0", 3, 5), ("1B1", 5, 7)]
    assert sch.span(timeline) == 9
    assert sch.bubble(timeline) == pytest.approx((2 * 9 - 12) / 12)            # (p - 1) / m = 1/2
    assert sch.bubble(timeline, within="rank") == pytest.approx((9 + 6) / 12 - 1)
    late = sch.simulate(GPIPE, latency=0.5)                                    # two hops in each direction
    assert late[1][0][1:] == (1.5, 2.5) and sch.span(late) == pytest.approx(10)
    halves = sch.simulate({0: "0F0 0I0 0W0", 1: "1F0 1I0 1W0"}, cost={"W": 3})
    assert [(str(op), s, e) for op, s, e in halves[0]] == [("0F0", 0, 1), ("0I0", 3, 4), ("0W0", 4, 7)]
    with pytest.raises(ValueError, match="within"):
        sch.bubble(timeline, within="ranks")


def test_a_rank_with_two_stages_runs_each_in_half_the_time():
    """Rank 0 holds stages 0 and 3 (a V): the turn at stages 1-2 stays on rank 1, no message."""
    v = {0: "0F0 3F0 3B0 0B0", 1: "1F0 2F0 2B0 1B0"}
    timeline = sch.check(v)
    assert [(str(op), s, e) for op, s, e in timeline[0]] == [
        ("0F0", 0, 0.5), ("3F0", 1.5, 2), ("3B0", 2, 3), ("0B0", 5, 6)]
    assert sch.messages(v) == 4
    assert sch.stage_ranks(v) == {0: 0, 3: 0, 1: 1, 2: 1}


def test_a_pair_waits_for_both_inputs_then_runs_forward_then_backward():
    """An OVERLAP_F_B pair starts when both of its actions can (torch's lowering places it only
    then) and runs them one after the other, as torch's runtime does."""
    lists = {0: "0F0 1F0 0F1 (1F1;1B0)OVERLAP_F_B 1B1 0B0 0B1"}        # one rank, two stages
    timeline = sch.check(lists)
    assert [(str(op), s, e) for op, s, e in timeline[0]] == [
        ("0F0", 0, 0.5), ("1F0", 0.5, 1), ("0F1", 1, 1.5), ("1F1", 1.5, 2), ("1B0", 2, 3),
        ("1B1", 3, 4), ("0B0", 4, 5), ("0B1", 5, 6)]
    assert sch.peak_in_flight(lists) == [4] and sch.messages(lists) == 0
    with pytest.raises(ValueError, match=r"deadlock: no rank can go on \(rank 0 at 1F0\+1B0\)"):
        sch.check({0: "0F0 (1F0;1B0)OVERLAP_F_B 0B0"})             # its backward needs its own forward
    with pytest.raises(ValueError, match="1B0 comes before 1F0"):
        sch.check({0: "0F0 (1B0;1F0)OVERLAP_F_B 0B0"})
    with pytest.raises(ValueError, match="the lists name no F, B, I or W"):
        sch.check({0: "0REDUCE_GRAD", 1: []})


@pytest.mark.parametrize("lists, n_micro, message", [
    ({0: "0F0 0W0 0I0", 1: "1F0 1I0 1W0"}, None, "0W0 comes before 0I0"),
    ({0: "0F0 0B0", 1: "1F0 1B0 1F0"}, None, "1F0 appears 2 times"),
    ({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1B1"}, None, "stage 1, micro-batch 1: 0 F, 1 B"),
    ({0: "0F0 0I0 0B0", 1: "1F0 1B0"}, None, "1 F, 1 B, 1 I, 0 W"),
    (GPIPE, 1, "micro-batch 1 is not in 0..0"),
    ({0: "0F0 0B0", 1: "1F0 0B0"}, None, "stage 0 is on rank 0 and on rank 1"),
    ({0: "0F0 0B0", 1: "2F0 2B0"}, None, "the lists name [0, 2]"),
    (CROSSED, None, "deadlock: no rank can go on (rank 0 at 0B0; rank 1 at 1F1)"),
])
def test_each_mistake_is_named(lists, n_micro, message):
    with pytest.raises(ValueError) as error:
        sch.check(lists, n_micro=n_micro)
    assert message in str(error.value)


def test_lowered_lists_need_every_message_once_and_in_place():
    lowered = {rank: [str(a) for a in actions] for rank, actions in sch.torch_lower(GPIPE, 2).items()}
    assert "0SEND_F0" in lowered[0] and "1RECV_F0" in lowered[1] and "1SEND_B0" in lowered[1]
    assert sch.span(sch.check(lowered)) == sch.span(sch.check(GPIPE))   # messages take no time

    def changed(rank, edit):
        lists = {r: list(actions) for r, actions in lowered.items()}
        lists[rank] = edit(lists[rank])
        return lists

    def move(actions, name, before):
        actions = [a for a in actions if a != name]
        actions.insert(actions.index(before), name)
        return actions

    cases = [
        (changed(1, lambda a: [x for x in a if x != "1RECV_F1"]), "rank 1 names 1RECV_F1 0 times"),
        (changed(0, lambda a: a + ["0SEND_F1"]), "rank 0 names 0SEND_F1 2 times"),
        (changed(0, lambda a: move(a, "0SEND_F1", "0F1")), "0SEND_F1 comes before 0F1"),
        (changed(1, lambda a: move(a, "1F1", "1RECV_F1")), "1RECV_F1 comes after 1F1"),
        (changed(0, lambda a: a + ["0SEND_B0"]), "a message no transfer needs"),
    ]
    for lists, message in cases:
        with pytest.raises(ValueError) as error:
            sch.check(lists)
        assert message in str(error.value)


def test_a_send_posted_too_late_is_a_deadlock():
    """With messages named: every message is in place, but rank 0 sends micro-batch 0's
    activation only after its backward, which waits for rank 1, which waits for that send."""
    lists = {0: "0F0 0RECV_B0 0B0 0SEND_F0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    with pytest.raises(ValueError, match=r"deadlock: no rank can go on \(rank 0 at 0B0; rank 1 at 1F0\)"):
        sch.check(lists)


#: GPipe's lists above lowered with messages and the waits for the sends where torch 2.15 puts
#: them (a forward's after the sending stage's backward of that micro-batch, a backward's at the end)
WAITED = {0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0WAIT_SEND_F0 0RECV_B1 0B1 0WAIT_SEND_F1",
          1: "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1WAIT_SEND_B0 1WAIT_SEND_B1"}


def test_waits_are_checked_and_hold_their_rank_until_the_receive():
    """A wait is no compute and no message: it changes no count and takes no time, but every send
    needs one after it, and it holds its rank until the peer has posted the matching receive."""
    timeline = sch.check(WAITED)
    assert sch.order(timeline) == {r: a.split() for r, a in GPIPE.items()} and sch.span(timeline) == 9
    assert sch.messages(WAITED) == sch.messages(GPIPE) and sch.peak_in_flight(WAITED) == [2, 2]

    def edited(rank, old, new, lists=WAITED):
        return {**lists, rank: lists[rank].replace(old, new)}

    for lists, message in [
        (edited(1, " 1WAIT_SEND_B1", ""), "rank 1 names 1WAIT_SEND_B1 0 times; 1SEND_B1 needs it once"),
        (edited(1, "1WAIT_SEND_B1", "1WAIT_SEND_B1 1WAIT_SEND_B1"), "names 1WAIT_SEND_B1 2 times"),
        (edited(0, "0F1 0SEND_F1", "0F1 0WAIT_SEND_F1 0SEND_F1", edited(0, " 0WAIT_SEND_F1", "")),
         "0WAIT_SEND_F1 comes before 0SEND_F1"),
        (edited(0, "0B1", "0B1 0WAIT_SEND_B1"), "0WAIT_SEND_B1, a wait for a send no list names"),
    ]:
        with pytest.raises(ValueError) as error:
            sch.check(lists)
        assert message in str(error.value)
    # rank 1 posts the receive of micro-batch 0 after its forward of micro-batch 1: without waits
    # that is fine; with rank 0 waiting for the send of micro-batch 0 before it sends micro-batch 1,
    # rank 0 waits for rank 1, which waits for rank 0
    late = {0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1",
            1: "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1"}
    sch.check(late)
    with pytest.raises(ValueError, match=r"deadlock: no rank can go on \(rank 0 at 0WAIT_SEND_F0; rank 1 at 1F1\)"):
        sch.check({0: late[0].replace("0SEND_F0", "0SEND_F0 0WAIT_SEND_F0") + " 0WAIT_SEND_F1",
                   1: late[1] + " 1WAIT_SEND_B0 1WAIT_SEND_B1"})
    # a wait lasts until its message has arrived: with a latency of 0.5, rank 0's second forward
    # starts at 1.5 instead of 1 when a wait for the first send comes before it
    early = edited(0, "0SEND_F0", "0SEND_F0 0WAIT_SEND_F0", edited(0, " 0WAIT_SEND_F0", ""))
    assert sch.simulate(WAITED, latency=0.5)[0][1][1:] == (1, 2)
    assert sch.simulate(early, latency=0.5)[0][1][1:] == (1.5, 2.5)


def test_torch_names_the_waits_for_its_sends_from_2_15_on():
    """Release-specific: torch 2.15's lowering adds a WAIT_SEND_F or WAIT_SEND_B for every send
    (its runtime retires a send only there) and a WAIT_REDUCE_GRAD after each REDUCE_GRAD; earlier
    releases wait for all sends at the end of the step and name no wait. Either way the lists pass."""
    from torch.distributed.pipelining.schedules import _ComputationType

    lowered = {rank: [str(a) for a in actions] for rank, actions in sch.torch_lower(GPIPE, 2).items()}
    names_waits = hasattr(_ComputationType, "WAIT_SEND_F")
    assert (sch.parse(lowered) == sch.parse(WAITED)) == names_waits       # UNSHARD etc. left out
    waits = [a for actions in lowered.values() for a in actions if "WAIT_SEND" in a]
    sends = [a for actions in lowered.values() for a in actions if a[1:5] == "SEND"]
    assert len(waits) == (len(sends) if names_waits else 0) and len(sends) == 4
    assert sch.span(sch.check(lowered)) == 9


@pytest.mark.parametrize("p", [2, 3, 4])
def test_counts_on_torchs_classes_follow_the_closed_forms(p):
    """Bubbles (p-1)/m (GPipe), (p-1)/(vm) (interleaved, m a multiple of p), (p-1)/(3m) (ZB-H1);
    messages 2(vp-1)m round robin and 2(2p-2)m in a V; GPipe holds m, ZBV 2p stages per rank."""
    for m in (p, 2 * p):
        gpipe = sch.torch_order("GPipe", p, m)
        assert sch.bubble(sch.check(gpipe, n_micro=m)) == pytest.approx((p - 1) / m)
        assert sch.peak_in_flight(gpipe) == [m] * p and sch.messages(gpipe) == 2 * (p - 1) * m
        zb_h1 = sch.torch_order("InterleavedZeroBubble", p, m, 1)
        assert sch.bubble(sch.check(zb_h1, n_micro=m)) == pytest.approx((p - 1) / (3 * m))
        for v in (2, 3):
            interleaved = sch.torch_order("Interleaved1F1B", p, m, v)
            assert sch.bubble(sch.check(interleaved, n_micro=m)) == pytest.approx((p - 1) / (v * m))
            assert sch.messages(interleaved) == 2 * (v * p - 1) * m
    m = 2 * p
    for name in ("ZBVZeroBubble", "DualPipeV"):
        lists = sch.torch_order(name, p, m, 2)
        timeline = sch.check(lists, n_micro=m)
        assert sch.messages(lists) == 2 * (2 * p - 2) * m
        assert sch.span(sch.check(sch.torch_order(name, p, m, 2, with_comms=True))) == sch.span(timeline)
        assert sch.peak_in_flight(sch.order(timeline)) == sch.peak_in_flight(lists)
    zbv = sch.torch_order("ZBVZeroBubble", p, m, 2)
    assert sch.bubble(sch.check(zbv), within="rank") == pytest.approx(0)
    assert sch.peak_in_flight(zbv) == [2 * p] * p


def test_torch_refuses_what_it_cannot_run():
    with pytest.raises(ValueError):
        sch.torch_order("ZBVZeroBubble", 4, 8, 3)                 # exactly two stages per rank
    with pytest.raises(ValueError):
        sch.torch_order("1F1B", 4, 8, 2)                          # one stage per rank
    with pytest.raises(Exception):
        sch.torch_lower(CROSSED, 2)                               # sends and receives cannot be placed


def test_draw_puts_one_bar_and_label_per_action():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = sch.check(sch.torch_order("ZBVZeroBubble", 2, 4, 2))
    fig, ax = plt.subplots()
    sch.draw(ax, timeline, "ZBV")
    n = sum(len(entries) for entries in timeline.values())
    assert len(ax.collections) == n and len(ax.texts) == n
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    plt.close(fig)
