"""Assignment 10 through the CLI: the reference scores full (speed measured, and without the
key, where every point but the speed check's is public and nothing is reserved), the stubs zero,
each planted bug loses exactly the checks that judge what it breaks, and a run_schedule that
deadlocks costs one timeout; and, without a grading, the grader's own parts: the schedules it
writes are valid (or, the bad ones, not), torch's lists it runs are valid on this torch, its
validator's messages, its bounds are the text's, and its count of what backward_input keeps
(a backward_input that passes ``retain_graph=True`` and keeps nothing of the graph is not counted
as keeping one: the probe's hooks hold detached tensors, no cycle through the graph).

Planted bugs (one grading, ``--speed skip``; different functions): interleaved 1F1B with one
forward too many in each rank's warm-up (valid lists, so its fixed-cases check is kept; a rank
holds one micro-batch more than the text's bound: the bounds and the random-cases checks), ZB-H1
that puts a W before its I in the cool-down (both of its checks: not valid), ZB-V with its
chunks placed in a loop (stage s on rank s % p) instead of a V (both of its checks: the stated
placement), a backward_input that passes ``retain_graph=True`` and keeps its output in ``saved``
(the check of what it keeps alone: grad_input is right, and backward_weight, graded with it, only
reads the pairs it needs), and a run_schedule that forgets the W of the last micro-batch (the
gradient and random-schedule checks; its timelines and refusals are right). run_schedule's
checks run the student's own lists where they are valid: the buggy ZB-H1 and ZB-V lists are
left out, the interleaved ones (valid, only over the bound) run, with no W to lose. (The W bug
is not one the speed check could see: it times torch's interleaved 1F1B lists, which have no W.)

Three more gradings of run_schedule alone. Without its validity check (``--speed skip``, every
function graded): the bad schedules are run, and the first that deadlocks or leaves a message
unreceived waits on gloo until the ranks' collective timeout (one timeout, 20 s: after it the group is broken and the later cases
fail at once), the refusal check fails, nothing else, and nothing is left behind. A last stage
that uses its input instead of receiving (``--only`` the gradient and timeline checks, which
share one run: each of run_schedule's other checks would wait out a collective timeout of its
own the same way): the previous rank's send is never received, the run stops at the collective
timeout, and both checks fail saying a send had no receive. And a run_schedule that raises ValueError for
every schedule: every run_schedule point lost, the refusal check's included (its valid schedule
must run). Each grading that deadlocks leaves no process behind, and nothing in its TMPDIR but
torch's own inductor cache folder (made by importing torch.distributed.pipelining).

Tier: both: reference full marks (speed measured, and without the key), stub zero and the
grader's parts without a grading are quick; the planted bugs and the deadlocks are full.
"""
from __future__ import annotations

import random
import re
import time

import nbformat
import pytest

from conftest import (REPO, assert_full_marks, assert_only_these_checks_fail,
                      assert_public_points_without_the_key, assert_stubs_score_zero, grade,
                      grade_id, grade_leaving_nothing, planted_copy, points_by_function)

from autograder.assignments.a10_pipeline_schedules import judging as J
from autograder.assignments.a10_pipeline_schedules.spec import SPEC
from autograder.checking.ranks import COLLECTIVE_TIMEOUT

SOURCE = REPO / "solutions" / "a10_pipeline_schedules" / "pipeline_schedules.ipynb"
RELEASE = REPO / "assignments" / "a10_pipeline_schedules" / "pipeline_schedules.ipynb"
CHECKS = REPO / "autograder" / "assignments" / "a10_pipeline_schedules" / "checks.py"
#: The budget of one grading of the reference on 2 cores with --speed skip (about 11 s here).
GRADING_SECONDS = 30
SPEED = {c.name for c in SPEC.checks if c.speed}
RUN_SCHEDULE = {c.name for c in SPEC.checks if c.function == "run_schedule"}

#: one forward more in each rank's warm-up: valid, one micro-batch over the peak's bound
WARMUP = {"interleaved_1f1b": (
    "        warmup = min(total, (v - 1) * p + 2 * (p - 1 - rank))\n",
    "        warmup = min(total, (v - 1) * p + 2 * (p - 1 - rank) + 1)\n")}
#: the cool-down's W before its I (on rank 0 the W is of that same micro-batch)
W_BEFORE_I = {"zero_bubble_h1": ('            ops += [f"{rank}I{i}", f"{rank}W{w}"]\n',
                                 '            ops += [f"{rank}W{w}", f"{rank}I{i}"]\n')}
#: the two chunks placed in a loop (stage s on rank s % p), not in a V
LOOP = {"zero_bubble_v": ("        down, up = rank, 2 * p - 1 - rank",
                          "        down, up = rank, p + rank")}
#: the graph kept alive: retained, and the stage's output (its grad_fn) kept in saved
RETAINED = {"backward_input": (
    "        grads = torch.autograd.grad(h, [first, *(out for _, out in kept)], grad_output)\n",
    "        grads = torch.autograd.grad(h, [first, *(out for _, out in kept)], grad_output,\n"
    "                                    retain_graph=True)\n")}
KEEPS_OUTPUT = {"backward_input": ("    return grads[0], saved\n",
                                   "    return grads[0], saved + [h]\n")}
#: the W of the last micro-batch skipped (its weights' gradients never added)
LAST_W = {"run_schedule": (
    "            else:                               # W: the weights, from the graph I kept\n",
    "            elif mb < m - 1:                    # W: the last micro-batch's forgotten\n")}
BUGS_FAIL = {"interleaved_1f1b_within_the_bubble_and_memory_bounds",
             "interleaved_1f1b_random_cases_and_value_errors",
             "zero_bubble_h1_valid_and_within_bounds",
             "zero_bubble_h1_random_cases_and_value_errors",
             "zero_bubble_v_placed_in_a_v_and_valid",
             "zero_bubble_v_within_bounds_on_random_cases_and_value_errors",
             "backward_input_keeps_only_what_the_weights_need",
             "run_schedule_gradients_match_one_process",
             "run_schedule_random_valid_schedules"}
#: no validity check: a bad schedule is run (a deadlocking one waits on gloo)
NO_REFUSAL = {"run_schedule": (
    "    schedules.check(schedule, m)                       # ValueError (a bad or deadlocking "
    "list): nothing sent\n", "")}
#: the last stage takes the micro-batch itself instead of receiving the previous stage's output
NO_RECEIVE = {"run_schedule": (
    '            x = inputs[mb] if stage == 0 else receive("act", stage, mb, stage - 1)\n',
    '            x = inputs[mb] if stage in (0, n_stages - 1) else receive("act", stage, mb, '
    'stage - 1)\n')}
#: every schedule refused
REFUSES_ALL = {"run_schedule": ("    m = len(inputs)\n",
                                '    m = len(inputs)\n    raise ValueError("refused")\n')}


#: What torch leaves in the temporary folder by itself (tests/test_lessons.py): importing
#: torch.distributed.pipelining, as the grader does for torch's own lists, makes inductor's cache
#: folder there.
TORCH_LEFTOVERS = ("torchinductor_",)


@pytest.mark.slow
def test_reference_solution_scores_full_marks(offline_env):
    """Speed measured: the reference's speedup over one process is shown beside the reference's
    own in the same run (1.33x and 1.28x measured here), or, on a busy machine or one with fewer
    than 2 free cores, the check is skipped with the reason (assert_full_marks)."""
    start = time.monotonic()
    report = grade(SOURCE, env=offline_env)
    took = time.monotonic() - start
    print(report["stdout"])
    assert_full_marks(report)
    (speed,) = [r for r in report["results"] if r["name"] in SPEED]
    if speed["status"] == "passed":
        assert re.search(r": \d+\.\d\dx \(reference \d+\.\d\dx; median of \d+ interleaved "
                         r"rounds\)$", speed["message"]), speed
    assert took < 2 * GRADING_SECONDS, f"grading took {took:.1f} s"


@pytest.mark.slow
def test_reference_earns_every_public_point_without_the_key(offline_env):
    """Every check is public: without the key the reference earns all but the speed check's
    point (skipped unmeasured), and nothing is reserved for the instructor."""
    report = assert_public_points_without_the_key(SOURCE, offline_env)
    assert not [c.name for c in SPEC.checks if c.hidden]
    assert report["score"] == sum(c.points for c in SPEC.checks) - 1 == 15, report["stdout"]
    assert "more when your instructor grades" not in report["stdout"]


@pytest.mark.slow
def test_released_stubs_score_zero_with_readable_messages(offline_env):
    assert_stubs_score_zero(grade(RELEASE, "--speed", "skip", env=offline_env))


@pytest.mark.full
@pytest.mark.slow
def test_planted_bugs_lose_exactly_their_checks(offline_env, tmp_path):
    # run seed 1 (each bug fails its checks at every seed: a random interleaved case is within
    # the bound with the extra forward only for p = m = 1, a random ZB-H1 case is valid with
    # the W first only for p = 1, and the random run_schedule case (6 stages, m = 2, split 1.0)
    # splits every backward)
    report = grade(planted_copy(SOURCE, tmp_path, "bugs", WARMUP, W_BEFORE_I, LOOP, RETAINED,
                                KEEPS_OUTPUT, LAST_W),
                   "--speed", "skip", "--seed", "1", env=offline_env)
    print(report["stdout"])
    assert_only_these_checks_fail(report, BUGS_FAIL, skipped_with_reason=SPEED)
    failed = {r["name"]: r["message"] for r in report["results"] if r["status"] == "failed"}
    for name in ("within_the_bubble_and_memory_bounds", "random_cases_and_value_errors"):
        assert "activations at its peak" in failed[f"interleaved_1f1b_{name}"], failed
        assert "the text's bound is" in failed[f"interleaved_1f1b_{name}"], failed
    for name in ("valid_and_within_bounds", "random_cases_and_value_errors"):
        assert re.search(r"is not a valid schedule: rank 0: 0W(\d+) comes before 0I\1, which it "
                         r"needs", failed[f"zero_bubble_h1_{name}"]), failed
    for name in ("placed_in_a_v_and_valid", "within_bounds_on_random_cases_and_value_errors"):
        assert "in the placement the text states" in failed[f"zero_bubble_v_{name}"], failed
    assert "an autograd graph outlives it" in failed[
        "backward_input_keeps_only_what_the_weights_need"], failed
    assert "differs from one process's" in failed["run_schedule_gradients_match_one_process"]
    assert "with the random schedule" in failed["run_schedule_random_valid_schedules"], failed


@pytest.mark.full
@pytest.mark.slow
def test_a_run_schedule_that_does_not_refuse_costs_one_timeout(offline_env, tmp_path):
    """Every function graded, ``--speed skip``: run_schedule without its validity check runs the
    bad schedules; the first that deadlocks waits on gloo until the collective timeout (20 s),
    after which the group is broken and the later cases end at once. Only the refusal check
    fails (once, not once per bad schedule), and no process or file is left behind."""
    report = grade_leaving_nothing(planted_copy(SOURCE, tmp_path, "no_refusal", NO_REFUSAL),
                                    "--speed", "skip", "--seed", "1", env=offline_env,
                                    seconds=COLLECTIVE_TIMEOUT + GRADING_SECONDS, prefix="a10-",
                                   allowed=TORCH_LEFTOVERS)
    assert_only_these_checks_fail(report, {"run_schedule_refuses_bad_schedules_before_sending"},
                                  skipped_with_reason=SPEED)
    (refusal,) = [r for r in report["results"] if r["status"] == "failed"]
    assert refusal["seconds"] < 2 * COLLECTIVE_TIMEOUT, refusal
    assert "should raise ValueError" in refusal["message"] or \
        "before refusing; it must refuse before any" in refusal["message"], refusal


@pytest.mark.full
@pytest.mark.slow
def test_a_last_stage_that_does_not_receive(offline_env, tmp_path):
    """``--only`` the gradient and timeline checks (one run): the last stage runs on the
    micro-batch itself, so the previous rank's send is never received and waits until the
    collective timeout; both checks fail, each saying what went wrong: a send without its
    receive. (run_schedule's random-schedule and refusal checks would each wait out a timeout of
    their own the same way: 40 s more.) Nothing is left behind."""
    shared_run = {"run_schedule_gradients_match_one_process", "run_schedule_timelines"}
    report = grade_leaving_nothing(planted_copy(SOURCE, tmp_path, "no_receive", NO_RECEIVE),
                                    "--only", ",".join(sorted(shared_run)), "--speed", "skip",
                                    env=offline_env, seconds=COLLECTIVE_TIMEOUT + GRADING_SECONDS,
                                   prefix="a10-", allowed=TORCH_LEFTOVERS)
    assert points_by_function(report) == {"run_schedule": 0}, report["stdout"]
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == shared_run, report["stdout"]
    for name in shared_run:
        assert "sent one nobody received" in results[name]["message"], results[name]


@pytest.mark.full
@pytest.mark.slow
def test_a_run_schedule_that_refuses_every_schedule(offline_env, tmp_path):
    """ValueError for every schedule (before anything is sent): it loses every run_schedule
    point, the refusal check's too, whose last schedule is valid and must run."""
    report = grade(planted_copy(SOURCE, tmp_path, "refuses_all", REFUSES_ALL), "--only",
                   "run_schedule", "--speed", "skip", env=offline_env)
    print(report["stdout"])
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == RUN_SCHEDULE, report["stdout"]
    assert all(r["status"] == "failed" and r["points"] == 0 for r in results.values()), \
        report["stdout"]
    refusal = results["run_schedule_refuses_bad_schedules_before_sending"]["message"]
    assert "with the valid GPipe lists" in refusal and "raised ValueError" in refusal and \
        "a valid schedule must run" in refusal, refusal


# ---------------------------------------------------------------------------- the grader's parts

def test_random_schedules_are_valid_and_use_every_rank():
    """The random schedules run_schedule's check writes: valid for course.schedules (which
    defines the text's rules), every stage on one rank and every rank with a stage, each
    backward whole or split as asked."""
    from course import schedules

    for seed in range(200):
        rng = random.Random(seed)
        p = rng.randint(1, 4)
        n, m, split = rng.randint(p, 7), rng.randint(1, 4), rng.choice([0.0, 0.5, 1.0])
        lists = J.random_schedule(rng, p, n, m, split)
        what = (seed, p, n, m, split, lists)
        schedules.check(lists, m)
        placement = J.placement_by_rank(lists)
        assert sorted(s for stages in placement for s in stages) == list(range(n)), what
        assert all(placement), what
        kinds = {schedules.parse_action(a)[0].kind for entries in lists for a in entries}
        if split in (0.0, 1.0):
            assert kinds == ({"F", "B"} if split == 0.0 else {"F", "I", "W"}), what
    # the generators' random arguments: in the text's ranges, and ones they must accept
    for seed in range(200):
        p, v, m = J.random_interleaved(random.Random(seed))
        assert 1 <= p <= 6 and 1 <= v <= 4 and m % p == 0 and p <= m <= 5 * p, (p, v, m)
        p, m = J.random_h1(random.Random(seed))
        assert 1 <= p <= 6 and p <= m <= 5 * p, (p, m)
        p, m = J.random_v(random.Random(seed))
        assert 1 <= p <= 6 and 2 * p <= m <= 5 * p, (p, m)


def test_bad_schedules_are_each_invalid():
    from course import schedules

    for seed in range(5):
        bad = J.bad_schedules(random.Random(seed))
        assert len(bad) == 8 and len({why for why, _, _ in bad}) == 8
        for why, lists, m in bad:
            assert len(lists) == 2, why
            with pytest.raises(ValueError):
                schedules.check(lists, m)
    # a deadlock is among them (what a run_schedule without the check hangs on)
    assert sum("deadlock" in why for why, _, _ in bad) == 2


def test_torch_lists_the_checks_run_are_valid_on_this_torch():
    """Each of torch's built-in schedules that run_schedule's checks run (and the speed
    check's) gives valid lists on this torch, placed and split as the check's label says (a
    None is silently left out of the gradient checks; the speed check would fail)."""
    from autograder.assignments.a10_pipeline_schedules import checks as C
    from autograder.assignments.a10_pipeline_schedules import ranks as R
    from course import schedules

    calls = re.findall(r'_torch_lists\("(\w+)", (\w+), (\w+), (\w+)\)', CHECKS.read_text())
    assert len(calls) >= 6, calls
    for name, *numbers in calls:
        p, m, v = (int(n) if n.isdigit() else getattr(R, n) for n in numbers)
        lists = C._torch_lists(name, p, m, v)
        assert lists is not None, f"torch's {name}(p={p}, m={m}, v={v}) lists are not valid here"
        schedules.check(lists, m)
        placed = schedules.stage_ranks(lists)
        kinds = {schedules.parse_action(a)[0].kind for entries in lists for a in entries}
        if name == "Interleaved1F1B":
            assert placed == J.interleaved_placement(p, v) and kinds == {"F", "B"}, (name, lists)
        elif name in ("ZBVZeroBubble", "DualPipeV"):
            assert placed == J.v_placement(p) and {"I", "W"} <= kinds, (name, lists)
        else:
            assert name == "InterleavedZeroBubble" and v == 1, name
            assert placed == {s: s for s in range(p)} and kinds == {"F", "I", "W"}, (name, lists)


def test_validate_rejects_what_the_text_rules_out_with_a_readable_message():
    good = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    placement = {0: 0, 1: 1}
    assert J.validate(good, "g", 2, 2, placement, "FB")  # the model's timeline
    cases = [
        # a wrong placement: stage 1 stated on rank 0
        (good, {0: 1, 1: 0}, "FB", "rank 0's list holds 0F0, but stage 0 is on rank 1 in the "
                                   "placement the text states"),
        (good, {0: 0}, "FB", "but stage 1 is not one of the 1 stages 0..0 in the placement"),
        # a kind the generator may not use (ZB's lists hold no B)
        (good, placement, "FIW", "rank 0's list holds '0B0', not an action "
                                 "'<stage><kind><micro-batch>' with kind one of F, I, W"),
        # not one action each
        ([["0F0", " 0F1", "0B0", "0B1"], good[1]], placement, "FB", "holds ' 0F1', not an action"),
        ([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1 1F1"]], placement, "FB",
         "holds '1B1 1F1', not an action"),
        ([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1SEND_F0", "1B0", "1F1", "1B1"]], placement, "FB",
         "holds '1SEND_F0', not an action"),
        ([["0F0", "F1", "0B0", "0B1"], good[1]], placement, "FB", "holds 'F1', not an action"),
        ([["0F0", "0F01", "0B0", "0B1"], good[1]], placement, "FB", "holds '0F01', not an action"),
        # the rules of Part 1
        ([good[0], ["1F0", "1B0", "1F1"]], placement, "FB", "g is not a valid schedule: "),
        ([good[0]], placement, "FB", "g returned 1 list(s); there are 2 ranks"),
        ([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]], placement, "FB",
         "g is not a valid schedule: "),
    ]
    for lists, placed, kinds, message in cases:
        with pytest.raises(AssertionError) as raised:
            J.validate(lists, "g", 2, 2, placed, kinds)
        assert message in str(raised.value), (lists, str(raised.value))
        assert len(str(raised.value)) < 300, str(raised.value)


def test_bounds_are_the_texts_formulas():
    """The bounds the checks hold the generators to are the formulas the text states (read
    from the released notebook's Part 1), on a few values."""
    (part1,) = [c.source for c in nbformat.read(RELEASE, as_version=4).cells
                if c.cell_type == "markdown" and c.source.startswith("## Part 1")]
    text = " ".join(part1.split())
    bounds = {}
    for name, said in re.findall(r"\*\*`(\w+)\([^`]*\)`\*\* \(\d points?[^)]*\):(.*?)(?=\*\*`\w+\(|"
                                 r"How it is graded)", text):
        (bubble,) = re.findall(r"bubble at most `([^`]+)`", said)
        (peak,) = re.findall(r"peak in flight at most `([^`]+)`", said)
        bounds[name] = bubble, peak
    assert set(bounds) == {"interleaved_1f1b", "zero_bubble_h1", "zero_bubble_v"}, bounds
    ours = {"interleaved_1f1b": lambda p, v, m: J.interleaved_bounds(p, v, m),
            "zero_bubble_h1": lambda p, v, m: J.h1_bounds(p, m),
            "zero_bubble_v": lambda p, v, m: J.v_bounds(p, m)}
    for p, v, m in [(1, 1, 1), (2, 2, 4), (4, 2, 8), (3, 3, 6), (6, 4, 30), (5, 1, 12)]:
        for name, (bubble, peak) in bounds.items():
            got_bubble, got_peaks = ours[name](p, v, m)
            assert got_bubble == eval(bubble, {}, {"p": p, "v": v, "m": m}), (name, p, v, m)
            assert got_peaks == [eval(peak, {"min": min}, {"p": p, "v": v, "m": m, "r": r})
                                 for r in range(p)], (name, p, v, m)


def _backward_input(*bugs):
    """The reference's backward_input with ``bugs`` (old, new) planted, in its own namespace."""
    import torch

    (source,) = [c.source for c in nbformat.read(SOURCE, as_version=4).cells
                 if grade_id(c) == "backward_input" and c.cell_type == "code"]
    for old, new in bugs:
        assert old in source
        source = source.replace(old, new)
    ns = {"torch": torch}
    exec(source, ns)
    return ns


def _stages(n=2):
    import torch

    from autograder.assignments.a10_pipeline_schedules.checks import _random_stage

    rng, g = random.Random(5), torch.Generator().manual_seed(5)
    return [_random_stage(rng, g) for _ in range(n)]


def test_backward_input_probe_counts_what_is_kept():
    """The probe behind the check of what backward_input keeps, in this process: the
    reference keeps no graph and at most the text's bytes; retaining the graph and keeping the
    output in ``saved`` is seen."""
    from autograder.assignments.a10_pipeline_schedules.probes import probe_backward_input

    cases = _stages()
    for (stage, x, _), reply in zip(cases, probe_backward_input(_backward_input(), cases)):
        assert reply["graph_alive"] == 0, reply
        bound = sum(x.shape[0] * (l.in_features + l.out_features) for l in stage
                    if hasattr(l, "in_features")) * x.element_size()
        assert 0 < reply["kept_bytes"] <= bound, (reply, bound)
    kept = probe_backward_input(_backward_input(RETAINED["backward_input"],
                                                KEEPS_OUTPUT["backward_input"]), cases)
    assert all(reply["graph_alive"] > 0 for reply in kept), kept


def test_retain_graph_alone_keeps_no_graph_alive():
    """retain_graph=True and nothing of the graph kept: the graph dies with the call (without
    the probe's hooks nothing stays alive), so the probe should count nothing alive."""
    import torch

    from autograder.assignments.a10_pipeline_schedules.probes import probe_backward_input

    cases = _stages()
    assert any(isinstance(layer, (torch.nn.Tanh, torch.nn.ReLU)) for stage, _, _ in cases
               for layer in stage), "no stage has an op that saves its output"
    replies = probe_backward_input(_backward_input(RETAINED["backward_input"]), cases)
    assert [reply["graph_alive"] for reply in replies] == [0] * len(cases)
