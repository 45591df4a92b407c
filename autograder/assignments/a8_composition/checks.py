"""Checks for Assignment 8: composing parallelisms.

Graded: the cost model (``per_rank_memory``, ``step_time``, ``best_config``: in the sandbox's
process) and ``train_3d``: one run on 8 processes trains every mesh of :data:`.ranks.RUNS`
(:func:`_train_run`), judged by all of its checks against one process training the dense model
(float64). The cost model's public checks compare with the fixed cases' values stored as data
(public_cases.json); its hidden checks (``hidden=True`` in spec.py) compare hidden and random
cases with the instructor's answer key (:func:`autograder.keys.answer_key`), loaded only here,
in the grader's process. Communication is counted by the ranks' harness, per group. Each check
judges only what it is named for: the ValueError checks the errors (whatever the values),
train_3d's the states, the losses and the groups, each on its own. The cost model's replies are
judged in :mod:`.judging` (a step_time failure names every key that differs and where the
difference starts; a hidden check's shows no expected value). Points: spec.py.
"""
from __future__ import annotations

import math

import torch

from autograder.checking.collectives import HOOKED_COLLECTIVES
from autograder.checking.expect import assert_close, fresh_generator, tensor
from autograder.keys import answer_key

from . import expected as E
from . import ranks as R
from .judging import NOT_SHOWN, dict_of, judge_memory, judge_time, result_of, show_inputs
from .probes import probe_best, probe_cost, probe_train
from .spec import SPEC

graded = SPEC.graded
EPS = torch.finfo(torch.float64).eps


def _key():
    """The instructor's answer key (a hidden check runs only where it is present)."""
    key = answer_key(SPEC.assignment)
    assert key is not None, "the answer key is absent: this check should have been skipped"
    return key


def _shared_cases(student, key, make, probe, args):
    """``(seed, cases, reply)`` of one probe call on ``args(cases)`` shared by a function's
    checks (``make(g)``: the cases, from a fresh generator)."""
    def run():
        g, seed = fresh_generator()
        cases = make(g)
        return seed, cases, student.call(probe, *args(cases))
    return student.shared(key, run)


def _public(name) -> list[tuple]:
    """``[(inputs by parameter, expected)]`` of ``name``'s public fixed cases (the JSON's)."""
    params = SPEC.function(name).params
    return [(tuple(case[p] for p in params), case["expected"])
            for case in E.public_cases()[name]]


# ---------------------------------------------------------------------------- per_rank_memory

def _public_memory(student):
    """``(cases, wants, results, errors)``: the public fixed cases (run first), what came back,
    and what the bad cases raised (run after them)."""
    cases, wants = zip(*_public("per_rank_memory"))
    results, errors = student.shared("memory", lambda: student.call(
        probe_cost, "per_rank_memory", list(cases), [(m, p) for m, p, _ in E.BAD_CASES]))
    return cases, wants, results, errors


@graded
def test_per_rank_memory_exact_bytes_on_public_cases(student):
    cases, wants, results, _ = _public_memory(student)
    judge_memory(results, cases, wants, "a public case: public_cases.json")


@graded
def test_per_rank_memory_exact_bytes_on_hidden_and_random_cases(student):
    key = _key()
    seed, cases, (results, _) = _shared_cases(
        student, "memory_hidden", key.memory_cases, probe_cost,
        lambda cases: ("per_rank_memory", cases, []))
    judge_memory(results, cases, [key.per_rank_memory(m, p) for m, p in cases],
                 f"a hidden or random case, seed {seed}", hidden=True)


def _judge_errors(name, public, hw=None):
    """ValueError for each bad case, and none for the public cases (which break no rule),
    whatever their values."""
    cases, _, results, errors = public
    assert len(errors) == len(E.BAD_CASES) and len(results) == len(cases) and all(
        isinstance(reply, dict) for reply in results), "the reply was tampered with"
    for (model, par, rule), error in zip(E.BAD_CASES, errors):
        assert error == "ValueError", (
            f"{name} with {rule} should raise ValueError; got {error} (for "
            f"{show_inputs(model, par, hw)})")
    for case, reply in zip(cases, results):
        assert not reply.get("error", "").startswith("ValueError"), (
            f"{name} raised {reply['error']}, but this configuration breaks no rule (for "
            f"{show_inputs(*case)})")


@graded
def test_per_rank_memory_value_errors(student):
    _judge_errors("per_rank_memory", _public_memory(student))


# ---------------------------------------------------------------------------- step_time

def _public_time(student):
    """``(cases, wants, results, errors)``, as :func:`_public_memory`'s."""
    cases, wants = zip(*_public("step_time"))
    results, errors = student.shared("time", lambda: student.call(
        probe_cost, "step_time", list(cases), [(m, p, E.H100) for m, p, _ in E.BAD_CASES]))
    return cases, wants, results, errors


@graded
def test_step_time_matches_the_cost_model_on_public_cases(student):
    cases, wants, results, _ = _public_time(student)
    judge_time(results, cases, wants, "a public case: public_cases.json")


@graded
def test_step_time_matches_the_cost_model_on_hidden_and_random_cases(student):
    key = _key()
    seed, cases, (results, _) = _shared_cases(
        student, "time_hidden", key.time_cases, probe_cost,
        lambda cases: ("step_time", cases, []))
    judge_time(results, cases, [key.step_time(*case) for case in cases],
               f"a hidden or random case, seed {seed}", hidden=True)


@graded
def test_step_time_value_errors(student):
    _judge_errors("step_time", _public_time(student), E.H100)


# ---------------------------------------------------------------------------- best_config

def _judge_best(student, cases, wants, hidden=False):
    """``best_config`` on ``cases`` (``(what, model, hw, world size)``) against ``wants`` (the
    configuration, or None where nothing fits); it runs with the student's own per_rank_memory
    and step_time (``hidden``: the expected configurations are not shown)."""
    results = student.call(probe_best, [(model, hw, world) for _, model, hw, world in cases])
    assert isinstance(results, list) and len(results) == len(cases), "the reply was tampered with"
    for (label, model, hw, world), reply, want in zip(cases, results, wants):
        what = f"best_config for {label}"
        inputs = f"model_cfg={model}, hw_cfg={hw}, world_size={world}"
        if want is None:
            assert reply.get("error", "").startswith("ValueError"), (
                f"{what}: no configuration fits, so it should raise ValueError; got "
                f"{reply.get('error') or 'a result'} (for {inputs})")
            continue
        got = dict_of(result_of(reply, what, inputs), what, E.PAR_KEYS, inputs)
        types = {k: ("bool" if k == "checkpoint" else "str" if k == "schedule" else "int")
                 for k in E.PAR_KEYS}
        values = {k: got[k].get("v") if got[k].get("t") == types[k] else got[k].get("t")
                  for k in E.PAR_KEYS}
        expected = NOT_SHOWN if hidden else f"expected {want}"
        assert values == want, (
            f"{what} is {values}; {expected} (the fastest that fits; equal times to the "
            "smallest max memory, then pp, tp, micro_batches, zero, checkpoint, schedule) "
            f"(for {inputs}; best_config runs with your own per_rank_memory and step_time: "
            "where their checks fail, fix those first)")


@graded
def test_best_config_public_cases(student):
    cases = E.public_cases()["best_config"]
    _judge_best(student, [(c["what"], c["model_cfg"], c["hw_cfg"], c["world_size"])
                          for c in cases], [c["expected"] for c in cases])


@graded
def test_best_config_hidden_cases(student):
    key = _key()
    cases = key.hidden_best_cases()
    _judge_best(student, cases, [key.best_config(model, hw, world)
                                 for _, model, hw, world in cases], hidden=True)


# ---------------------------------------------------------------------------- train_3d

def _train_run(student):
    """``(seed, reply)`` of the one 8-process run, shared by train_3d's checks."""
    def run():
        _, seed = fresh_generator()
        reply = student.call(probe_train, seed)
        assert isinstance(reply, dict) and isinstance(reply.get("replies"), dict), \
            "the probe's reply was tampered with"
        return seed, reply
    return student.shared("train_3d", run)


def _where(run, r) -> str:
    p, d, t = R.coordinates(run.dims, r)
    return f"train_3d with {run.label}, rank {r} (stage p={p}, d={d}, t={t})"


def _tol64(want: torch.Tensor) -> dict:
    """Float64 rounding of a result of this size: a few thousand ulps of its largest entry (the
    reference, summing over tp shards, micro-batches and dp in its own order, strays by ~16:
    0.4% of this over 5 seeds; a wrong gradient moves a parameter by 1e-3 or more)."""
    scale = want.abs().max().item() if want.numel() else 1.0
    return dict(rtol=0, atol=4096 * EPS * max(1.0, scale))


def _text(exc: AssertionError) -> str:
    """An assertion's message without pytest's explanation of the comparison."""
    return str(exc).split("\nassert ")[0]


def _judge_run(seed, i, replies, part):
    """``part`` (:func:`_judge_losses` or :func:`_judge_state`) on every rank of run ``i``
    against one process; its communication named where it fails."""
    run = R.RUNS[i]
    want_losses, want_state = E.one_process_training(seed)
    for r, reply in enumerate(replies):
        try:
            part(run, r, reply, want_losses if part is _judge_losses else want_state, seed)
        except AssertionError as exc:
            bad = R.violations(run.dims, r, reply["calls"])
            raise AssertionError(_text(exc) + (f"\n(it made {bad[0]})" if bad else "")) \
                from None


def _judge_losses(run, r, reply, want_losses, seed):
    where, pp, dp = _where(run, r), run.dims[0], run.dims[1]
    losses = reply["losses"]
    if R.coordinates(run.dims, r)[0] != pp - 1:
        assert losses.get("kind") == "plain" and losses.get("value") is None, (
            f"{where}: losses should be None on every stage but the last (the loss is computed "
            "on the last stage only)")
        return
    assert losses.get("kind") in ("list", "tuple") and len(losses["items"]) == R.STEPS, (
        f"{where}: losses should be a list of {R.STEPS} Python floats")
    values = [item.get("value") for item in losses["items"]]
    assert all(type(v) is float for v in values), \
        f"{where}: losses should be a list of {R.STEPS} Python floats; got {values}"
    for step, (v, w) in enumerate(zip(values, want_losses)):
        if math.isfinite(v) and abs(v - w) <= 4096 * EPS * max(1.0, abs(w)):
            continue
        hint = next((f" ({k} times the full batch's mean loss: {why}?)" for k, why in
                     ((run.micro_batches, "is each micro-batch's loss scaled by "
                       "1/micro_batches"), (dp, "is the loss averaged over dp"))
                     if k > 1 and math.isclose(v, k * w, rel_tol=1e-9)), "")
        raise AssertionError(f"{where}: the loss before update {step} is {v!r}; one process "
                             f"on the full batch had {w!r}{hint} (seed {seed})")


def _judge_state(run, r, reply, want_state, seed):
    where, state = _where(run, r), reply["state"]
    assert isinstance(state, dict) and "kind" not in state, \
        f"{where}: state should be a dict of dense name -> full tensor"
    names = R.owned(run.dims, r)
    assert set(state) == set(names), (
        f"{where}: state has the names {sorted(state)}; expected {names} (exactly the "
        "parameters its stage owns, under their dense names)")
    for name in names:
        got, want = tensor(state[name], f"{where}: state['{name}']")["value"], want_state[name]
        assert_close(got, want, f"{where}: state['{name}'] after {R.STEPS} steps (the full "
                     "tensor, vs one process on the full batch)", seed=seed, **_tol64(want))


def _judge_runs(student, runs, judge):
    """``judge(seed, i, replies)`` on each of ``runs`` that every rank finished (a run that did
    not finish fails); every failure reported."""
    seed, reply = _train_run(student)
    failures = []
    for i in runs:
        if i not in reply["replies"]:
            failures.append(reply["error"] or f"train_3d with {R.RUNS[i].label} did not finish")
            continue
        replies = reply["replies"][i]
        assert isinstance(replies, list) and len(replies) == len(R.RUNS[i].ranks) and all(
            isinstance(x, dict) for x in replies), "the ranks' reply was tampered with"
        try:
            judge(seed, i, replies)
        except AssertionError as exc:
            failures.append(_text(exc))
    assert not failures, "\n".join(dict.fromkeys(failures))


def _states(seed, i, replies):
    _judge_run(seed, i, replies, _judge_state)


def _losses(seed, i, replies):
    _judge_run(seed, i, replies, _judge_losses)


@graded
def test_train_3d_state_on_pp2_dp2_tp2_8_ranks_matches_one_process(student):
    _judge_runs(student, [0], _states)


@graded
def test_train_3d_state_on_three_meshes_of_4_ranks_matches_one_process(student):
    _judge_runs(student, range(1, len(R.RUNS)), _states)


@graded
def test_train_3d_losses_match_one_process(student):
    _judge_runs(student, range(len(R.RUNS)), _losses)


def _groups(seed, i, replies):
    """Each rank's calls: none where they should not go; each mode of size above 1 on its own
    group at least once a step (whatever the values)."""
    run = R.RUNS[i]
    pp, dp, tp = run.dims
    for r, reply in enumerate(replies):
        where, calls = _where(run, r), reply["calls"]
        bad = R.violations(run.dims, r, calls)
        assert not bad, f"{where} made {bad[0]}" + (
            f", and {len(bad) - 1} more call(s) where it should not" if bad[1:] else "")
        groups = R.groups_of(run.dims, r)
        for mode, size in (("tp", tp), ("dp", dp)):
            n = sum(op in HOOKED_COLLECTIVES and set(ranks) == set(groups[mode])
                    for ranks, op, _, _, _ in calls)
            assert size == 1 or n >= R.STEPS, (
                f"{where}: {n} collective(s) on its {mode} group (ranks "
                f"{list(groups[mode])}) in {R.STEPS} steps; {mode} = {size} should use it "
                "at least once a step")
        n = sum(op in ("SEND", "RECV") for _, op, _, _, _ in calls)
        assert pp == 1 or n >= R.STEPS, (
            f"{where}: {n} send(s)/recv(s) with its neighbouring stages in {R.STEPS} steps; "
            f"pp = {pp} should pass activations and their gradients between stages")


@graded
def test_train_3d_each_mode_on_its_own_group(student):
    _judge_runs(student, range(len(R.RUNS)), _groups)
