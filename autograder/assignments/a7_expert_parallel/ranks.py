"""What each process of Assignment 7's checks runs, and the inputs, groups and weights it shares
with the grader (which rebuilds them from the same seeds to compute the float64 truth).

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


def ep_case(cls, moe_class, seed, n, r, group, c) -> dict:
    """From ``moe`` (the dense layer of case ``c``): ``cls.from_moe``, its attributes, one
    forward on this rank's tokens and backward of (y * g).sum() + C_AUX * aux; the outputs,
    gradients, and what each pass sent."""
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
                          for name, p in moe.named_parameters()))
    return case


def rank_ep(rank, world_size, cls, moe_class, seed):
    out = {}
    for i, group, n, r in my_groups(rank):
        for c in range(len(EP_CASES)):
            out[(i, c)] = ep_case(cls, moe_class, seed, n, r, group, c)
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
