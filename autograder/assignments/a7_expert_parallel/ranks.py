"""What each process of Assignment 7's checks runs, and the inputs, groups and weights it shares
with the grader (the answer key rebuilds them from the same seeds for the hidden checks), and
the public checks' per-token truth: :func:`per_token_layer`, the dense layer as a plain loop over
tokens and kept choices, routed by the same functions the graded code calls (the student's
own), with its float64 gradients
(:func:`layer_truth`), and one process training the dense model (:func:`train_one_process`).

Trusted harness code: a probe starts these on 4 fresh processes with
:func:`autograder.checking.ranks.run_ranks`. One run covers every group size: each rank tries
the student's code on every group of :data:`GROUPS` it belongs to (the whole world with
``group=None``, two pairs, the second without global rank 0, and a group of 1 per rank), which
the harness creates itself before any student code runs. What a rank sends is seen by a
pre-hook on every process group (point-to-point calls included). Every rank imports this
module, so it imports nothing heavier than torch.
"""
from __future__ import annotations

import ast
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autograder.checking.collectives import calls_on_every_group
from autograder.checking.probes import describe

F64 = torch.float64
WORLD = 4
#: ``(label, global ranks)`` of every group a run uses, in the order each rank visits those it
#: belongs to (the order makes the waits between groups acyclic).
GROUPS = [("the whole world of 4 processes (group=None)", (0, 1, 2, 3)),
          ("a group of global ranks [0, 1]", (0, 1)),
          ("a group of global ranks [2, 3] (without rank 0)", (2, 3)),
          *((f"a group of 1 process (global rank {g})", (g,)) for g in range(WORLD))]

#: The layer of the expert-parallel checks: d_model, hidden, experts (divisible by 1, 2, 4), k.
D, HID, E, K = 4, 6, 8, 2
#: The coefficient of aux in every checked loss: (y * g).sum() + C_AUX * aux.
C_AUX = 0.7
#: Expert-parallel cases: (capacity_factor, skewed routing). Skewed: expert 0 is popular (it
#: drops tokens) and the experts of the group's last rank are never chosen (it receives no row).
EP_CASES = [(1.25, False), (1.0, True), (4.0, False)]
#: Experts that 4 and 2 ranks cannot split (ValueError), with k = 1.
BAD_EXPERTS = {4: 6, 2: 3}


def randn(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64)


def tokens_of(r: int) -> int:
    """How many tokens group rank ``r`` holds (different on every rank: uneven splits)."""
    return 5 + 3 * r


# ---------------------------------------------------------------------------- weights, inputs

def moe_state(seed: int, num_experts: int = E, d: int = D, hidden: int = HID, *,
              dead: tuple = (), popular: bool = False) -> dict:
    """A MoE layer's float64 weights by name (``router.weight``, ``experts.{j}.0.weight``, ...).
    ``dead`` experts get a router row that no token of :func:`tokens` (skewed) can choose;
    ``popular`` makes expert 0 the first choice of most such tokens."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    state = {"router.weight": draw(num_experts, d)}
    for j in range(num_experts):
        state[f"experts.{j}.0.weight"] = draw(hidden, d, scale=d ** -0.5)
        state[f"experts.{j}.0.bias"] = draw(hidden, scale=0.3)
        state[f"experts.{j}.2.weight"] = draw(d, hidden, scale=hidden ** -0.5)
        state[f"experts.{j}.2.bias"] = draw(d, scale=0.3)
    router = state["router.weight"]
    for j in dead:
        router[j, 0] = -20.0
    if popular:
        router[0, 0] = 3.0
    return state


def ep_state(seed: int, n: int, c: int) -> dict:
    """The dense layer of expert-parallel case ``c`` on ``n`` ranks."""
    skewed = EP_CASES[c][1]
    dead = tuple(range(E - E // max(n, 2), E)) if skewed else ()
    return moe_state(seed + 1000 * c + n, dead=dead, popular=skewed)


def ep_inputs(seed: int, n: int, c: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, g)``: group rank ``r``'s tokens and the upstream gradient of y."""
    x = randn(seed + 1000 * c + 10 * n + r + 1, tokens_of(r), D)
    if EP_CASES[c][1]:
        x[:, 0] = 2.0 + x[:, 0].abs()  # with the dead experts' router rows: never chosen
    return x, randn(seed + 1000 * c + 10 * n + r + 5, tokens_of(r), D)


def load_moe(moe_class, state: dict, k: int, capacity_factor):
    """The namespace's MoELayer (its given ``__init__``) holding ``state``."""
    num_experts = state["router.weight"].size(0)
    hidden, d = state["experts.0.0.weight"].shape
    moe = moe_class(d, hidden, num_experts, k, capacity_factor).to(F64)
    moe.load_state_dict(state)
    return moe


# ---------------------------------------------------------------------------- per-token truth

#: An expert's parameter names (``nn.Sequential(Linear, GELU, Linear)``).
PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


def per_token_layer(parts, router_weight, experts, x, k, capacity_factor):
    """The MoE layer as the text defines it, one token and one kept choice at a time (slow,
    plain), routed by ``parts``: the namespace's ``(route, expert_capacity, keep_mask,
    load_balancing_loss)`` (the reference's where the grader has them, else the student's own).
    ``experts``: each expert's ``[w1, b1, w2, b2]``. Returns ``(y, aux, keep, chosen)``."""
    routing, capacity_of, fitting, balancing = parts
    logits = F.linear(x, router_weight)              # what nn.Linear(d, E, bias=False) computes
    weights, chosen = routing(logits, k)
    keep = fitting(chosen, capacity_of(x.size(0), len(experts), k, capacity_factor))
    aux = balancing(logits, chosen, len(experts))
    rows = []
    for t in range(x.size(0)):
        row = torch.zeros_like(x[t])
        for j in range(k):
            if bool(keep[t, j]):
                w1, b1, w2, b2 = experts[int(chosen[t, j])]
                row = row + weights[t, j] * F.linear(F.gelu(F.linear(x[t], w1, b1)), w2, b2)
        rows.append(row)
    y = torch.stack(rows) if rows else torch.zeros_like(x)
    return y, aux, torch.as_tensor(keep, dtype=torch.bool), torch.as_tensor(chosen)


def layer_truth(forward, state: dict, x, g, k, capacity_factor, c=C_AUX) -> dict:
    """``forward`` (:func:`per_token_layer`'s arguments after ``parts``) on the layer held in
    ``state`` and the gradients of (y * g).sum() + c * aux: of x, the router, each expert (zeros
    for an expert that got no token); the kept assignments per expert."""
    leaves = {name: t.clone().requires_grad_() for name, t in state.items()}
    num_experts = state["router.weight"].size(0)
    experts = [[leaves[f"experts.{j}.{p}"] for p in PARAMS] for j in range(num_experts)]
    xl = x.clone().requires_grad_()
    y, aux, keep, chosen = forward(leaves["router.weight"], experts, xl, k, capacity_factor)
    names, inputs = ["x", *leaves], [xl, *leaves.values()]
    grads = torch.autograd.grad((y * g).sum() + c * aux, inputs, allow_unused=True)
    return {"y": y.detach(), "aux": aux.detach(),
            "grads": {n: torch.zeros_like(t) if gr is None else gr
                      for n, t, gr in zip(names, inputs, grads)},
            "kept": torch.bincount(chosen[keep], minlength=num_experts)}


def per_token_truth(parts, state, x, g, k, capacity_factor, c=C_AUX) -> dict:
    """:func:`layer_truth` of :func:`per_token_layer` with ``parts``, described for the grader,
    or ``{"error": ...}`` where ``parts`` could not run (a helper not written yet)."""
    try:
        truth = layer_truth(functools.partial(per_token_layer, parts), state, x, g, k,
                            capacity_factor, c)
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        return {"error": (f"{type(exc).__name__}: {exc}" if str(exc) else
                          type(exc).__name__)[:300]}
    return {"y": describe(truth["y"]), "aux": describe(truth["aux"]),
            "grads": {n: describe(t) for n, t in truth["grads"].items()},
            "kept": describe(truth["kept"])}


class LayerModule(nn.Module):
    """MoELayer's attributes and parameter names with ``forward`` (:func:`per_token_layer`'s
    arguments after ``parts``) as its computation: ``module(x) -> (y, aux)``."""

    def __init__(self, forward, d_model, hidden, num_experts, k=2, capacity_factor=1.25):
        super().__init__()
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(),
                                                   nn.Linear(hidden, d_model))
                                     for _ in range(num_experts))
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        self.compute = forward

    def forward(self, x):
        experts = [[e[0].weight, e[0].bias, e[2].weight, e[2].bias] for e in self.experts]
        return self.compute(self.router.weight, experts, x, self.k, self.capacity_factor)[:2]


# ---------------------------------------------------------------------------- what a rank sends

def error_of(call) -> str:
    """What ``call()`` raised, as ``"Type: message"`` ("nothing" if it returned)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]
    return "nothing"


def my_groups(rank: int):
    """``(index, group, n, r)`` for each group of :data:`GROUPS` that holds ``rank`` (every
    rank creates every group, in order; None for the world)."""
    groups = [None if len(ranks) == WORLD else dist.new_group(list(ranks))
              for _, ranks in GROUPS]
    return [(i, groups[i], len(ranks), ranks.index(rank))
            for i, (_, ranks) in enumerate(GROUPS) if rank in ranks]


# ---------------------------------------------------------------------------- ExpertParallelMoE

def _params(module) -> list:
    """A module's parameters by name (None where it has no such attribute)."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [(name, p) for name, p in module.named_parameters()]


def _attributes(ep, moe, group) -> dict:
    missing = object()
    get = {name: getattr(ep, name, missing) for name in
           ("router", "experts", "num_experts", "k", "capacity_factor", "group")}
    experts = get["experts"]
    return {
        "module": isinstance(ep, torch.nn.Module),
        "missing": [name for name, v in get.items() if v is missing],
        "router": describe([[n, p.detach()] for n, p in _params(get["router"])]),
        "router_shared": any(p is q for _, p in _params(get["router"])
                             for q in moe.router.parameters()),
        "experts": (describe([[[n, p.detach()] for n, p in _params(e)] for e in experts])
                    if isinstance(experts, torch.nn.ModuleList) else describe(experts)),
        "experts_shared": isinstance(experts, torch.nn.ModuleList) and any(
            p is q for e in experts for _, p in _params(e) for q in moe.experts.parameters()),
        "plain": describe([get[n] if get[n] is not missing else None
                           for n in ("num_experts", "k", "capacity_factor")]),
        "group": get["group"] is group,
    }


def ep_case(cls, moe_class, parts, seed, n, r, group, c) -> dict:
    """From ``moe`` (the dense layer of case ``c``): ``cls.from_moe``, its attributes, one
    forward on this rank's tokens and backward of (y * g).sum() + C_AUX * aux; the outputs,
    gradients, and what each pass sent; the per-token truth on this rank's tokens."""
    capacity_factor = EP_CASES[c][0]
    state = ep_state(seed, n, c)
    moe = load_moe(moe_class, state, K, capacity_factor)
    ep = cls.from_moe(moe, group)
    case = {"attributes": _attributes(ep, moe, group)}
    x, g = ep_inputs(seed, n, c, r)
    leaf = x.clone().requires_grad_()
    with calls_on_every_group() as forward:
        result = ep(leaf)
    y, aux = result if isinstance(result, (tuple, list)) and len(result) == 2 else (result, None)
    ran = all(isinstance(t, torch.Tensor) for t in (y, aux)) and y.shape == g.shape and \
        aux.numel() == 1 and (y.requires_grad or aux.requires_grad)
    with calls_on_every_group() as backward:
        if ran:
            ((y * g).sum() + C_AUX * aux.sum()).backward()
    experts = ep.experts if isinstance(getattr(ep, "experts", None), torch.nn.ModuleList) else []
    router = getattr(ep, "router", None)
    case.update(
        y=describe(y), aux=describe(aux), backward_ran=ran, forward=forward,
        backward=backward, x_grad=describe(leaf.grad),
        router_grad=describe([None if p.grad is None else p.grad for _, p in _params(router)]),
        expert_grads=describe([[[name, p.grad] for name, p in _params(e)] for e in experts]),
        moe_untouched=all(torch.equal(p.detach(), state[name]) and p.grad is None
                          for name, p in moe.named_parameters()),
        truth=per_token_truth(parts, state, x, g, K, capacity_factor))
    return case


def rank_ep(rank, world_size, cls, moe_class, seed, parts):
    out = {}
    for i, group, n, r in my_groups(rank):
        for c in range(len(EP_CASES)):
            out[(i, c)] = ep_case(cls, moe_class, parts, seed, n, r, group, c)
    return out


def rank_ep_bad(rank, world_size, cls, moe_class, seed):
    """``from_moe`` with experts that the group cannot split (a run of its own, after
    :func:`rank_ep`'s)."""
    out = {}
    for i, group, n, r in my_groups(rank):
        if n in BAD_EXPERTS:
            bad = load_moe(moe_class, moe_state(seed + 7, BAD_EXPERTS[n]), 1, 1.0)
            out[(i, "bad")] = {"error": error_of(lambda: cls.from_moe(bad, group))}
    return out


# ---------------------------------------------------------------------------- train_ep

#: TinyMoEModel's size in the training checks, the data (N rows: uneven shares on 4 ranks),
#: steps, learning rate, aux coefficient.
MODEL = dict(d_in=3, d=4, h=5, num_experts=4, k=2, capacity_factor=1.25, d_out=2)
T_ROWS, T_STEPS, T_LR, T_AUX = 18, 3, 0.3, 0.1
TRAIN_GROUPS = (0, 1, 2, 3, 4, 5, 6)


def model_class(setup_source: str, moe_class):
    """TinyMoEModel from the trusted set-up cell's text (its class definition and the imports
    before it, not the rest of the cell), with ``moe_class`` as its MoELayer."""
    def wanted(node):
        if isinstance(node, ast.ClassDef):
            return node.name == "TinyMoEModel"
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        return bool(names) and all(m.split(".")[0] in ("torch", "math") and
                                   not m.startswith("torch.distributed") for m in names)

    keep = [node for node in ast.parse(setup_source).body if wanted(node)]
    ns: dict = {"__name__": "__a7_setup__", "MoELayer": moe_class}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "<set-up cell>", "exec"), ns)
    return ns["TinyMoEModel"]


def seeded_model(setup_source: str, moe_class, seed: int):
    """``model_fn``: the same float64 TinyMoEModel on every call, in every process, whatever
    order its MoELayer creates parameters in (each is drawn by name from ``seed``)."""
    with torch.random.fork_rng(devices=[]):
        model = model_class(setup_source, moe_class)(**MODEL).to(F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.3
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * scale)
    return model


def train_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(seed + 1, T_ROWS, MODEL["d_in"]), randn(seed + 2, T_ROWS, MODEL["d_out"])


def train_one_process(moe_class, seed: int, source: str, n: int):
    """``(losses, state)``: one process, the dense model (its MoE layer ``moe_class``), each
    step's loss the mean over the n chunks of (mse on the chunk + T_AUX * the chunk's aux),
    plain SGD: what ``train_ep`` on n ranks must reproduce."""
    model = seeded_model(source, moe_class, seed)
    x, y = train_data(seed)
    losses = []
    for _ in range(T_STEPS):
        model.zero_grad(set_to_none=True)
        total = 0
        for xs, ys in zip(x.tensor_split(n), y.tensor_split(n)):
            pred, aux = model(xs)
            total = total + F.mse_loss(pred, ys) + T_AUX * aux
        loss = total / n
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= T_LR * p.grad
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def per_token_training(parts, seed: int, source: str) -> dict:
    """:func:`train_one_process` with the per-token layer routed by ``parts``, for every group
    size, described for the grader (``{"error": ...}`` where ``parts`` could not run)."""
    layer = functools.partial(LayerModule, functools.partial(per_token_layer, parts))
    out = {}
    for n in sorted({len(members) for _, members in GROUPS}):
        try:
            losses, state = train_one_process(layer, seed, source, n)
        except Exception as exc:  # noqa: BLE001 - reported to the grader
            return {"error": (f"{type(exc).__name__}: {exc}" if str(exc) else
                              type(exc).__name__)[:300]}
        out[n] = {"losses": list(map(float, losses)),
                  "state": {k: describe(v) for k, v in state.items()}}
    return out


def rank_train(rank, world_size, fn, moe_class, seed, setup_source):
    model_fn = functools.partial(seeded_model, setup_source, moe_class, seed)
    x, y = train_data(seed)
    out = {}
    for i, group, n, r in my_groups(rank):
        result = fn(model_fn, (x.clone(), y.clone()), steps=T_STEPS, lr=T_LR, aux_coef=T_AUX,
                    group=group)
        losses, state = result if isinstance(result, (tuple, list)) and len(result) == 2 \
            else (result, None)
        out[i] = {"losses": describe(losses), "state": (
            {str(k): describe(v) for k, v in state.items()} if isinstance(state, dict)
            else describe(state))}
    return out
