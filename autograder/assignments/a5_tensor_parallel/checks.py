"""Checks for Assignment 5: tensor parallelism and 2-D meshes.

Graded: ``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP``,
``vocab_parallel_cross_entropy``, ``train_2d`` and ``cross_check`` (their contracts are in the
notebook). Each function runs once on a world of one and once on 4 processes, where the ranks
try it on the whole world (group None, 4 ranks) and on the ``tp`` groups of 2 of a (2, 2) mesh
(:mod:`.ranks`); all of the function's checks judge that one run (:func:`_run_of`). The grader
rebuilds the dense float64 layers, inputs and training from the same seeds and compares every
rank's slices, outputs and gradients with them. Collectives are counted by the ranks' harness
with a pre-hook on each group (graded on groups of 2 or more ranks only). Points: ``spec.py``.
"""
from __future__ import annotations

import math

import torch.nn.functional as F

from autograder.checking.expect import assert_close, assert_close_float32, fresh_generator, tensor
from autograder.checking.training import sgd_steps

from . import ranks as R
from .probes import probe_ranks, probe_train_2d
from .spec import SPEC

graded = SPEC.graded
#: float64 against float64: only the order of the additions differs
TIGHT = dict(rtol=1e-10, atol=1e-12)


def _run_of(student, name):
    """``(seed, [(world size, rank, label, n, r, reply)])`` of ``name`` on 1 and 4 ranks."""
    def run():
        _, seed = fresh_generator()
        cases = []
        for world in (1, 4):
            replies = student.call(probe_ranks, name, world, seed)
            assert isinstance(replies, list) and len(replies) == world, \
                "the probe's reply was tampered with"
            for rank, reply in enumerate(replies):
                groups = R.groups_of(rank, world)
                assert isinstance(reply, list), "the ranks' reply was tampered with"
                per_group = len(reply) // len(groups)
                for i, (label, _, n, r) in enumerate(groups):
                    for item in reply[i * per_group:(i + 1) * per_group]:
                        cases.append((world, rank, label, n, r, item))
        return seed, cases
    return student.shared(name, run)


def _where(world, rank, label, n, r):
    return f"{world} process(es), rank {rank}, on {label} (n={n}, group rank {r})"


def _close(desc, expected, what, seed, **tol):
    assert_close(tensor(desc, what)["value"], expected, what, seed=seed, **(tol or TIGHT))


def _judge_grads(desc, expected, names, where, seed):
    items = desc.get("items") if isinstance(desc, dict) else None
    assert isinstance(items, list) and len(items) == len(expected), \
        "the ranks' reply was tampered with"
    for item, want, name in zip(items, expected, names):
        if item.get("kind") == "plain" and item.get("value") is None:
            raise AssertionError(f"{where}: {name} got no gradient (expected one); was it "
                                 "used in the forward pass, and kept in the autograd graph?")
        _close(item, want, f"{where}: the gradient of {name}", seed)


def _dense(module, x, upstream):
    x = x.clone().requires_grad_()
    y = module(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad


# ---------------------------------------------------------------------------- the two layers

def _sizes(column):
    return (R.IN, R.HIDDEN) if column else (R.HIDDEN, R.OUT)


def _layer_expectation(seed, column, leading):
    fin, fout = _sizes(column)
    linear = R.dense_linear(seed, fin, fout)
    y, xg = _dense(linear, *R.layer_inputs(seed, leading, fin, fout))
    return linear, y, xg


def _judge_dense_unchanged(run, linear, name, what):
    """``from_linear`` leaves the dense layer as it was (the text: values, shapes, dtype and
    requires_grad of its parameters; the grader builds several layers from one dense layer)."""
    after = run["dense_after"]
    want = dict(linear.named_parameters())
    assert isinstance(after, dict) and set(after) == set(want), (
        f"{what}: after {name}.from_linear(linear, ...), the dense layer's parameters are "
        f"{sorted(after) if isinstance(after, dict) else after}, not {sorted(want)}: "
        "from_linear must leave `linear` unchanged")
    for key, p in want.items():
        desc = after[key]
        _close(desc["value"], p.detach(), f"{what}: the dense layer's {key} after "
               f"{name}.from_linear(linear, ...) (from_linear must leave `linear` unchanged)",
               None, rtol=0, atol=0)
        assert desc["requires_grad"] is True, (
            f"{what}: {name}.from_linear(linear, ...) set requires_grad=False on the dense "
            f"layer's {key}: from_linear must leave `linear` unchanged")


def _judge_slices(student, name, column):
    seed, cases = _run_of(student, name)
    linear = R.dense_linear(seed, *_sizes(column))
    W, b = linear.weight.detach(), linear.bias.detach()
    flag = "gather_output" if column else "input_is_parallel"
    for world, rank, label, n, r, case in cases:
        where = _where(world, rank, label, n, r)
        c = R.HIDDEN // n  # both layers split the hidden features
        part = slice(r * c, (r + 1) * c)
        want = {"weight": W[part], "bias": b[part]} if column else {"weight": W[:, part], "bias": b}
        for call, run in enumerate(case["runs"], 1):
            what = f"{where}, call {call} of from_linear on one dense layer ({flag}={run['mode']})"
            _judge_dense_unchanged(run, linear, name, what)
            params = run["params"]
            assert isinstance(params, dict) and set(params) == {"weight", "bias"}, (
                f"{what}: from_linear should give parameters named weight and bias, got "
                f"{sorted(params) if isinstance(params, dict) else params}")
            for key, w in want.items():
                _close(params[key], w, f"{what}: {name}.from_linear(...)'s {key} (this "
                       "rank's slice of the dense layer's, float64 kept)", seed, rtol=0, atol=0)
        fin, fout = _sizes(column)
        local = (c, fin) if column else (fout, c)
        expected = {True: {"weight": local, "bias": (c,) if column else (fout,)},
                    False: {"weight": local}}
        got = {k: {n_: tuple(s) for n_, s in v.items()} for k, v in case["shapes"].items()}
        assert got == expected, (f"{where}: {name}({fin}, {fout}, bias=True / False, group=...) "
                                 f"has parameters {got}, expected {expected}")
        if n > 1:
            assert case["indivisible"] == "ValueError", (
                f"{where}: a size of {2 * n + 1} features that {n} ranks cannot split should "
                f"raise ValueError; got {case['indivisible']}")


def _judge_layer_runs(student, name, column):
    seed, cases = _run_of(student, name)
    expected = {tuple(leading): _layer_expectation(seed, column, leading)
                for leading in R.LAYER_LEADINGS}
    for world, rank, label, n, r, case in cases:
        where = _where(world, rank, label, n, r)
        part = slice(r * (R.HIDDEN // n), (r + 1) * (R.HIDDEN // n))
        for run in case["runs"]:
            mode, leading = run["mode"], tuple(run["leading"])
            linear, y, xg = expected[leading]
            Wg, bg = linear.weight.grad, linear.bias.grad
            dims = f"a {len(leading) + 1}-D input {(*leading, _sizes(column)[0])}"
            if column:
                what = f"{where}, gather_output={mode}, {dims}"
                want_y, want = (y if mode else y[..., part]), [xg, Wg[part], bg[part]]
            else:
                what = f"{where}, input_is_parallel={mode}, {dims}"
                want_y, want = y, [xg[..., part] if mode else xg, Wg[:, part], bg]
            _close(run["output"], want_y, f"{what}: the output", seed)
            _judge_grads(run["grads"], want, ["the input", "weight", "bias"], what, seed)


@graded
def test_column_parallel_slices_shapes_and_errors(student):
    _judge_slices(student, "ColumnParallelLinear", column=True)


@graded
def test_column_parallel_outputs_and_gradients(student):
    _judge_layer_runs(student, "ColumnParallelLinear", column=True)


@graded
def test_row_parallel_slices_shapes_and_errors(student):
    _judge_slices(student, "RowParallelLinear", column=False)


@graded
def test_row_parallel_outputs_and_gradients(student):
    _judge_layer_runs(student, "RowParallelLinear", column=False)


# ---------------------------------------------------------------------------- ParallelMLP

@graded
def test_parallel_mlp_matches_dense_block(student):
    seed, cases = _run_of(student, "ParallelMLP")
    mlp = R.dense_mlp(seed)
    y, xg = _dense(mlp, R.randn(seed + 1, *R.LEADING, R.IN), R.randn(seed + 2, *R.LEADING, R.IN))
    fc1, fc2 = mlp[0], mlp[2]
    for world, rank, label, n, r, case in cases:
        where = _where(world, rank, label, n, r)
        part = slice(r * (R.HIDDEN // n), (r + 1) * (R.HIDDEN // n))
        _close(case["output"], y, f"{where}: ParallelMLP's output", seed)
        _judge_grads(case["grads"], [xg, fc1.weight.grad[part], fc1.bias.grad[part],
                                     fc2.weight.grad[:, part], fc2.bias.grad],
                     ["the input", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], where, seed)


def _ops(traffic, what):
    assert isinstance(traffic, list), f"{what}: the ranks' reply was tampered with"
    return [op for op, _ in traffic]


@graded
def test_parallel_mlp_one_all_reduce_each_way(student):
    _, cases = _run_of(student, "ParallelMLP")
    test_parallel_mlp_matches_dense_block(student)  # counts matter for right results only
    for world, rank, label, n, r, case in cases:
        if n < 2:
            continue
        where = _where(world, rank, label, n, r)
        for phase in ("forward", "backward"):
            ops = _ops(case[phase], where)
            assert ops == ["ALLREDUCE"], (
                f"{where}: the {phase} pass issued {ops or 'no collectives'} on the group; "
                "expected exactly one all-reduce (with an input that requires grad)")


# ---------------------------------------------------------------------------- cross-entropy

def _judge_ce(student, which):
    seed, cases = _run_of(student, "vocab_parallel_cross_entropy")
    for world, rank, label, n, r, case in cases:
        i = case["case"]
        if i not in which:
            continue
        batch, c, offset, dtype = R.CE_CASES[i]
        logits, targets = R.ce_inputs(seed + i, R.CE_CASES[i], n * c)
        full = logits.double().requires_grad_()
        loss = F.cross_entropy(full, targets)
        loss.backward()
        where = (f"{_where(world, rank, label, n, r)}, batch {batch}, {c} classes per rank, "
                 f"{dtype} logits" + (f" around {offset:g}" if offset else ""))
        got = tensor(case["loss"], f"{where}: the loss")["value"]
        assert got.shape == (), f"{where}: the loss should be a 0-dimensional tensor"
        assert math.isfinite(got.double().item()), f"{where}: the loss is not finite ({got})"
        items = case["grad"]["items"]
        assert items[0].get("kind") == "tensor", \
            f"{where}: local_logits got no gradient from backward() of the loss"
        want_grad = full.grad[:, r * c:(r + 1) * c]
        if dtype == "float32":
            small = logits.clone().requires_grad_()
            F.cross_entropy(small, targets).backward()
            assert_close_float32(got, loss.detach(), F.cross_entropy(logits, targets),
                                 f"{where}: the loss", seed=seed)
            assert_close_float32(items[0]["value"], want_grad, small.grad[:, r * c:(r + 1) * c],
                                 f"{where}: the gradient of local_logits", seed=seed)
        else:
            tol = TIGHT if not offset else dict(rtol=0, atol=1e-9)
            _close(case["loss"], loss.detach(), f"{where}: the loss (vs F.cross_entropy on the "
                   "full logits)", seed, **tol)
            _close(items[0], want_grad, f"{where}: the gradient of local_logits", seed, **tol)
    return cases


@graded
def test_vocab_parallel_cross_entropy_matches_dense(student):
    _judge_ce(student, (0, 1, 3))


@graded
def test_vocab_parallel_cross_entropy_stable_at_large_logits(student):
    _judge_ce(student, (2,))


@graded
def test_vocab_parallel_cross_entropy_communication_bound(student):
    for world, rank, label, n, r, case in _judge_ce(student, (1,)):  # right results first
        if n < 2 or case["case"] != 1:  # the case with 16 classes per rank, as the text says
            continue
        batch = R.CE_CASES[case["case"]][0]
        where = f"{_where(world, rank, label, n, r)}, batch {batch}"
        calls = [call for key in case["traffic"] for call in case["traffic"][key]]
        listed = ", ".join(f"{op} ({x} in, {y} out)" for op, x, y in calls)
        for i, verb in ((1, "took"), (2, "gave back")):
            total = sum(call[i] for call in calls)
            assert total <= 4 * batch, (
                f"{where}: the collectives of one call and its backward {verb} {total} "
                f"elements in total ({listed}); at most 4 x batch = {4 * batch} are allowed "
                f"each way, whatever the vocabulary ({n * R.CE_CASES[case['case']][1]} classes "
                "here) and the number of ranks (an all-gather gives back n times its input)")


# ---------------------------------------------------------------------------- train_2d

def _train_runs(student, world, meshes):
    def run():
        _, seed = fresh_generator()
        replies = student.call(probe_train_2d, world, seed, meshes)
        model = R.two_block_model(seed)
        x, y = R.train_data(seed + 1)
        losses, _ = sgd_steps(model, [(x, y)] * R.TRAIN_STEPS, R.TRAIN_LR, loss=F.mse_loss)
        return seed, replies, losses, model.state_dict()
    return student.shared(f"train{world}", run)


def _judge_training(student, world, meshes):
    seed, replies, losses, state = _train_runs(student, world, meshes)
    for rank, reply in enumerate(replies):
        for (dp, tp), case in zip(meshes, reply):
            where = f"train_2d with (dp, tp) = ({dp}, {tp}), rank {rank}"
            if dp > 1:
                assert case["odd"] == "ValueError", (f"{where}: 7 examples cannot be split over "
                                                     f"dp={dp}; expected ValueError, got "
                                                     f"{case['odd']}")
            got = case["losses"]
            values = [i.get("value") for i in got.get("items", [])] \
                if got.get("kind") in ("list", "tuple") else None
            assert values is not None and len(values) == R.TRAIN_STEPS and \
                all(isinstance(v, float) for v in values), \
                f"{where}: the losses should be a list of {R.TRAIN_STEPS} floats"
            for step, (v, w) in enumerate(zip(values, losses)):
                assert abs(v - w) <= 1e-10 * max(1.0, abs(w)), (
                    f"{where}: the full-batch loss before update {step} is {v!r}; one process "
                    f"training the dense model on the full batch had {w!r} (seed {seed})")
            got_state = case["state"]
            assert isinstance(got_state, dict) and set(got_state) == set(state), (
                f"{where}: the state dict should have the dense model's names {sorted(state)}")
            for key, want in state.items():
                _close(got_state[key], want, f"{where}: {key} after {R.TRAIN_STEPS} steps (vs "
                       "the dense model trained in one process)", seed)
    return replies


@graded
def test_train_2d_two_by_two_matches_dense_training(student):
    _judge_training(student, 4, [(2, 2)])


@graded
def test_train_2d_one_by_two_and_two_by_one(student):
    _judge_training(student, 2, [(1, 2), (2, 1)])


@graded
def test_train_2d_uses_the_tp_groups(student):
    for world, meshes in ((4, [(2, 2)]), (2, [(1, 2), (2, 1)])):
        replies = _judge_training(student, world, meshes)  # right results first
        for rank, reply in enumerate(replies):
            for (dp, tp), case in zip(meshes, reply):
                if tp < 2:
                    continue
                first = rank // tp * tp
                tp_ranks = tuple(range(first, first + tp))
                calls = len(case["traffic"].get(tp_ranks, []))
                assert calls >= 2 * R.TRAIN_STEPS, (
                    f"train_2d with (dp, tp) = ({dp}, {tp}), rank {rank}: {calls} collective(s) "
                    f"on its tp group (ranks {list(tp_ranks)}) in {R.TRAIN_STEPS} steps of a "
                    "model with two Linear-GELU-Linear blocks; tensor parallelism issues at "
                    "least one per block and step (is every block a ParallelMLP over the tp "
                    "group of the mesh?)")


# ---------------------------------------------------------------------------- cross_check

def _cc_cases(student):
    """cross_check's run, with what every key's block must give: the dense block's output and
    input gradient (all tokens; this rank's rows for the sequence-parallel block)."""
    seed, cases = _run_of(student, "cross_check")
    mlp = R.dense_mlp(seed)
    y, xg = _dense(mlp, *R.cc_inputs(seed))
    for world, rank, label, n, r, case in cases:
        where = _where(world, rank, label, n, r)
        keys = case["keys"]
        assert keys is not None and set(R.CC_KEYS) <= set(keys), (
            f"{where}: cross_check should return a dict with the keys {list(R.CC_KEYS)} (each "
            f"an nn.Module); got {keys if keys is not None else 'something else'}")
        for key in R.CC_KEYS:
            assert key in case, f"{where}: cross_check(...)[{key!r}] is not callable"
    return seed, cases, mlp, y, xg


def _judge_block(case, key, y, xg, where, seed):
    what = f"{where}: cross_check(mlp, group)[{key!r}]"
    _close(case[key]["output"], y, f"{what}'s output (a plain tensor, vs the dense block)", seed)
    _judge_grads(case[key]["grad"], [xg], ["its input"], what, seed)


@graded
def test_cross_check_ours_and_torch_equal_the_dense_block(student):
    seed, cases, mlp, y, xg = _cc_cases(student)
    for world, rank, label, n, r, case in cases:
        where = _where(world, rank, label, n, r)
        after = case["mlp_after"]
        assert isinstance(after, dict) and set(after) == set(dict(mlp.named_parameters())), (
            f"{where}: cross_check changed mlp's parameters (to {sorted(after)}); "
            "it must leave mlp unchanged (parallelize_module changes the module it is given)")
        for key, p in mlp.named_parameters():
            got = after[key]["value"]
            assert got.get("kind") == "tensor", (
                f"{where}: after cross_check, mlp's {key} is a {got.get('type')}: cross_check "
                "must leave mlp unchanged (parallelize_module changes the module it is given)")
            assert after[key]["requires_grad"] is True, (
                f"{where}: cross_check set requires_grad=False on mlp's {key}: it must leave "
                "mlp unchanged")
            _close(got, p.detach(), f"{where}: mlp's {key} after cross_check (it must leave "
                   "mlp unchanged)", seed, rtol=0, atol=0)
        for key in ("ours", "tensor_parallel"):
            _judge_block(case, key, y, xg, where, seed)


@graded
def test_cross_check_sequence_parallel_block(student):
    seed, cases, _, y, xg = _cc_cases(student)
    for world, rank, label, n, r, case in cases:
        where = _where(world, rank, label, n, r)
        rows = slice(r * (R.TOKENS // n), (r + 1) * (R.TOKENS // n))
        block = case["sequence_parallel"]
        _judge_block(case, "sequence_parallel", y[rows], xg[rows],
                     f"{where}, given rows {rows.start}..{rows.stop - 1} of the tokens", seed)
        if n < 2:  # counts matter for right results only, on groups of 2 or more
            continue
        for phase in ("forward", "backward"):
            ops = sorted(_ops(block[phase], where))
            assert ops == ["ALLGATHER", "REDUCE_SCATTER"], (
                f"{where}: the sequence-parallel block's {phase} pass issued "
                f"{ops or 'no collectives'} on the group; expected one all-gather and one "
                "reduce-scatter (and no all-reduce)")
