"""What each process of Assignment 5's checks runs, and the models and inputs it shares with
the grader (which rebuilds them from the same seeds to compute the dense float64 truth).

Trusted harness code: a probe starts these on 4 fresh processes (or runs them here as a world
of one) with :func:`autograder.checking.ranks.run_ranks`. Each rank tries the student's code on
two kinds of group: the whole world (``group=None``) and, on 4 ranks, the ``tp`` groups of 2 of
a (2, 2) mesh that the harness builds itself; it counts the collectives on those groups from
its side (:func:`autograder.checking.collectives.traffic_on_groups`) and returns plain data.
Every rank imports this module, so it imports nothing heavier than torch.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from autograder.checking.collectives import traffic_on_groups
from autograder.checking.probes import describe, error_of

F64 = torch.float64
#: Layer sizes: divisible by 1, 2 and 4 ranks where they are split.
IN, HIDDEN, OUT, LEADING = 5, 8, 6, (3, 2)
#: The leading dimensions of the layers' inputs: "any leading dimensions", tried 3-D and 4-D.
LAYER_LEADINGS = ((3, 2), (2, 1, 3))


def randn(seed: int, *shape, dtype=F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def dense_linear(seed: int, fin: int, fout: int) -> nn.Linear:
    """A float64 nn.Linear with weights from ``seed`` (the same in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(fin, fout).to(F64)


def dense_mlp(seed: int, fin: int = IN, hidden: int = HIDDEN) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(fin, hidden), nn.GELU(), nn.Linear(hidden, fin)).to(F64)


def two_block_model(seed: int) -> nn.Sequential:
    """``model_fn`` of train_2d (with functools.partial): two Linear-GELU-Linear blocks with
    replicated layers around them, float64. The second block's input needs a gradient, so a
    column layer that does not all-reduce it trains the first block wrong."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), nn.Tanh(),
                             nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), nn.Linear(4, 2)).to(F64)


def train_data(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(seed, n, 4), randn(seed + 1, n, 2)


def groups_of(rank: int, world_size: int) -> list[tuple[str, object, int, int]]:
    """``(label, group, n, r)`` for each group the layer checks use on this rank: the world
    (group None) and, on 4 ranks, this rank's ``tp`` group of a (2, 2) mesh (ranks {0, 1} and
    {2, 3}). The grader calls it with the same arguments (without a process group) for n, r."""
    cases = [("the whole world (group=None)", None, world_size, rank)]
    if world_size == 4:
        group = None
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh
            group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).get_group("tp")
        cases.append(("a tp group of 2 of a (2, 2) mesh on 4 processes", group, 2, rank % 2))
    return cases


def _grads(*tensors):
    return describe([None if t is None or t.grad is None else t.grad for t in tensors])


def _params(module) -> dict:
    return {name: describe(p.detach()) for name, p in module.named_parameters()}


# ---------------------------------------------------------------------------- the two layers

def _run_layer(layer, x, upstream) -> dict:
    """Forward ``x``; backward ``upstream`` (dL/d output) where the output's shape allows;
    what the grader compares: the parameters, the output and the gradients."""
    y = layer(x)
    if y.shape == upstream.shape:
        (y * upstream).sum().backward()
    return {"params": _params(layer), "output": describe(y),
            "grads": _grads(x, getattr(layer, "weight", None), getattr(layer, "bias", None))}


def _dense_state(linear) -> dict:
    """What must stay as it was in the dense layer after each ``from_linear``."""
    return {name: {"value": describe(p.detach()), "requires_grad": bool(p.requires_grad)}
            for name, p in linear.named_parameters()}


def layer_inputs(seed: int, leading, fin: int, fout: int):
    """``(x, upstream)`` of a layer run: the full input and dL/d(full output), the same on
    every rank (the grader rebuilds them for the dense layer)."""
    return randn(seed + 2, *leading, fin), randn(seed + 1, *leading, fout)


def _layer_runs(layer_of, linear, modes, local_input, local_upstream, fin, fout, seed):
    """One run per mode and leading shape, every layer built by ``layer_of(mode)`` from the
    same dense ``linear`` (the grader calls ``from_linear`` more than once on one dense layer,
    as the text says), with the dense layer's state noted after each call."""
    runs = []
    for mode in modes:
        for leading in LAYER_LEADINGS:
            layer = layer_of(mode)
            dense_after = _dense_state(linear)
            x, upstream = layer_inputs(seed, leading, fin, fout)
            x = local_input(x, mode).clone().requires_grad_()
            runs.append({"mode": mode, "leading": leading, "dense_after": dense_after,
                         **_run_layer(layer, x, local_upstream(upstream, mode))})
    return runs


def _shapes_and_errors(make, make_indivisible, n: int) -> dict:
    """The parameter shapes of ``make(bias)`` with and without bias, and what constructing a
    layer whose split dimension ``n`` does not divide raises (asked only when n > 1)."""
    return {"shapes": {bias: {k: tuple(p.shape) for k, p in make(bias).named_parameters()}
                       for bias in (True, False)},
            "indivisible": error_of(make_indivisible) if n > 1 else "not asked"}


def rank_column(rank, world_size, cls, seed):
    out = []
    for label, group, n, _ in groups_of(rank, world_size):
        linear = dense_linear(seed, IN, HIDDEN)
        r, c = dist.get_rank(group), HIDDEN // n
        mine = slice(r * c, (r + 1) * c)
        runs = _layer_runs(
            lambda gather: cls.from_linear(linear, group, gather_output=gather),
            linear, (False, True), lambda x, gather: x,
            lambda up, gather: up if gather else up[..., mine], IN, HIDDEN, seed)
        out.append({"label": label, "runs": runs, **_shapes_and_errors(
            lambda bias: cls(IN, HIDDEN, bias=bias, group=group),
            lambda: cls(IN, 2 * n + 1, group=group), n)})
    return out


def rank_row(rank, world_size, cls, seed):
    out = []
    for label, group, n, _ in groups_of(rank, world_size):
        linear = dense_linear(seed, HIDDEN, OUT)
        r, c = dist.get_rank(group), HIDDEN // n
        mine = slice(r * c, (r + 1) * c)
        runs = _layer_runs(
            lambda parallel: cls.from_linear(linear, group, input_is_parallel=parallel),
            linear, (True, False), lambda x, parallel: x[..., mine] if parallel else x,
            lambda up, parallel: up, HIDDEN, OUT, seed)
        out.append({"label": label, "runs": runs, **_shapes_and_errors(
            lambda bias: cls(HIDDEN, OUT, bias=bias, group=group),
            lambda: cls(2 * n + 1, OUT, group=group), n)})
    return out


# ---------------------------------------------------------------------------- ParallelMLP

def rank_mlp(rank, world_size, cls, seed):
    out = []
    for label, group, _, _ in groups_of(rank, world_size):
        mlp = dense_mlp(seed)
        block = cls.from_mlp(mlp, group)
        x = randn(seed + 1, *LEADING, IN).requires_grad_()
        with traffic_on_groups({"group": group}) as forward:
            y = block(x)
        with traffic_on_groups({"group": group}) as backward:
            if isinstance(y, torch.Tensor) and y.shape == x.shape:
                (y * randn(seed + 2, *LEADING, IN)).sum().backward()
        layers = [getattr(block, name, None) for name in ("fc1", "fc2")]
        params = [getattr(layer, p, None) for layer in layers for p in ("weight", "bias")]
        out.append({"label": label, "output": describe(y), "grads": _grads(x, *params),
                    "forward": forward["group"], "backward": backward["group"]})
    return out


# ---------------------------------------------------------------------------- cross-entropy

#: (batch, classes per rank, logit offset, dtype) of each case.
CE_CASES = [(6, 3, 0.0, "float64"), (5, 16, 0.0, "float64"), (7, 4, 1e4, "float64"),
            (6, 5, 0.0, "float32")]


def ce_inputs(seed: int, case, vocabulary: int):
    batch, _, offset, dtype = case
    logits = 3 * randn(seed, batch, vocabulary) + offset
    g = torch.Generator().manual_seed(seed + 1)
    return logits.to(getattr(torch, dtype)), torch.randint(0, vocabulary, (batch,), generator=g)


def rank_cross_entropy(rank, world_size, fn, seed):
    out = []
    for label, group, n, r in groups_of(rank, world_size):
        for i, case in enumerate(CE_CASES):
            c = case[1]
            logits, targets = ce_inputs(seed + i, case, n * c)
            local = logits[:, r * c:(r + 1) * c].clone().requires_grad_()
            with traffic_on_groups({"group": group, "world": None}, outputs=True) as traffic:
                loss = fn(local, targets.clone(), group)
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
            out.append({"label": label, "case": i, "loss": describe(loss),
                        "grad": _grads(local), "traffic": traffic})
    return out


# ---------------------------------------------------------------------------- cross_check

def _waited(t):
    """A functional collective's result (AsyncCollectiveTensor) as the plain tensor it waits
    for; anything else as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


#: Tokens of cross_check's input, divisible by 1, 2 and 4 ranks (the sequence-parallel split).
TOKENS = 8
CC_KEYS = ("ours", "tensor_parallel", "sequence_parallel")


def cc_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full ``(tokens, features)`` input and dL/d(full output), the same on every rank."""
    return randn(seed + 1, TOKENS, IN), randn(seed + 2, TOKENS, IN)


def _run_block(block, x, upstream, group) -> dict:
    """Forward ``x`` (requires grad), backward ``upstream`` where the output is a plain tensor
    of its shape; the collectives on ``group`` of each pass."""
    x = x.clone().requires_grad_()
    with traffic_on_groups({"group": group}) as forward:
        y = block(x)
        plain = _waited(y)
    with traffic_on_groups({"group": group}) as backward:
        if type(plain) is torch.Tensor and plain.shape == upstream.shape:
            (y * upstream).sum().backward()
    return {"output": describe(plain), "grad": describe([_waited(x.grad)]),
            "forward": forward["group"], "backward": backward["group"]}


def rank_cross_check(rank, world_size, fn, seed):
    """The three blocks of ``fn(mlp, group)`` on each group: ``ours`` and ``tensor_parallel``
    on the full input, every rank backpropagating the same loss; ``sequence_parallel`` on this
    rank's rows, each rank backpropagating its rows' share of that loss."""
    out = []
    for label, group, n, r in groups_of(rank, world_size):
        mlp = dense_mlp(seed)
        blocks = fn(mlp, group)
        case = {"label": label, "mlp_after": _dense_state(mlp),
                "keys": sorted(map(str, blocks)) if isinstance(blocks, dict) else None}
        if isinstance(blocks, dict) and all(callable(blocks.get(k)) for k in CC_KEYS):
            x, upstream = cc_inputs(seed)
            rows = slice(r * (TOKENS // n), (r + 1) * (TOKENS // n))
            for key in CC_KEYS:
                part = rows if key == "sequence_parallel" else slice(None)
                case[key] = _run_block(blocks[key], x[part], upstream[part], group)
        out.append(case)
    return out


# ---------------------------------------------------------------------------- train_2d

TRAIN_STEPS, TRAIN_LR = 3, 0.1


def rank_train_2d(rank, world_size, fn, seed, meshes):
    """For each (dp, tp) of ``meshes`` (dp * tp = world size): train_2d on 8 examples with
    every group watched, then, when dp > 1, on 7 (which must raise ValueError)."""
    model_fn = functools.partial(two_block_model, seed)
    out = []
    for dp, tp in meshes:
        with traffic_on_groups({tuple(range(world_size)): None}, new_groups=True) as traffic:
            result = fn(model_fn, train_data(seed + 1), dp=dp, tp=tp, steps=TRAIN_STEPS,
                        lr=TRAIN_LR)
        odd = error_of(lambda: fn(model_fn, train_data(seed + 1, 7), dp=dp, tp=tp,
                                             steps=1, lr=TRAIN_LR)) if dp > 1 else "not asked"
        losses, state = result if isinstance(result, (tuple, list)) and len(result) == 2 \
            else (None, None)
        out.append({"mesh": (dp, tp), "odd": odd, "losses": describe(losses),
                    "state": {k: describe(v) for k, v in state.items()}
                    if isinstance(state, dict) else describe(state),
                    "traffic": {k: v for k, v in traffic.items()}})
    return out
