"""Assignment 7's expectations, computed in the grader from the released text (not from the
student's code): routing, capacity and the fill order, the load-balancing loss, the dense MoE
layer with its gradients (all in float64, the grader's own code), and one process training
TinyMoEModel (the release's set-up cell) on the same per-chunk losses."""
from __future__ import annotations

import functools
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from autograder.checking.reference import reference_cells

from . import ranks as R

#: The answer cell that defines each graded name (keep_mask is in expert_capacity's cell).
CELL_OF = {"keep_mask": "expert_capacity"}


# ---------------------------------------------------------------------------- the parts

def route(logits: torch.Tensor, k: int):
    """``(weights, experts)``: the k most probable experts (a stable descending sort: ties to
    the lower index), their probabilities renormalised over the k."""
    probs = torch.softmax(logits, dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    top = probs.gather(1, experts)
    return top / top.sum(-1, keepdim=True), experts


def capacity(num_tokens, num_experts, k, capacity_factor) -> int:
    """The smallest c >= 0 with c * E >= capacity_factor * k * T, in exact arithmetic."""
    need = Fraction(str(capacity_factor)) * k * num_tokens
    return max(0, -(-need.numerator // (need.denominator * num_experts)))


def keep_mask(experts: torch.Tensor, cap: int) -> torch.Tensor:
    """First choices in token order, then second choices, ...; kept while the expert has
    fewer than ``cap`` kept assignments."""
    T, k = experts.shape
    keep = torch.zeros(T, k, dtype=torch.bool)
    used: dict[int, int] = {}
    for j in range(k):
        for t in range(T):
            e = int(experts[t, j])
            if used.get(e, 0) < cap:
                keep[t, j] = True
                used[e] = used.get(e, 0) + 1
    return keep


def balance_loss(logits: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """E * sum_i f_i P_i: f from the counts of all k choices (before dropping)."""
    T, k = experts.shape
    P = torch.softmax(logits, dim=-1).mean(0)
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).to(logits.dtype) / (T * k)
    return num_experts * (f * P).sum()


def expert(params: list, x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def moe_forward(router_weight, experts: list, x, k, capacity_factor):
    """The dense layer: ``(y, aux, keep, chosen experts)``; an expert without kept tokens is
    not called."""
    logits = x @ router_weight.T
    weights, chosen = route(logits, k)
    keep = keep_mask(chosen, capacity(x.size(0), len(experts), k, capacity_factor))
    y = torch.zeros_like(x)
    for e, params in enumerate(experts):
        rows, cols = torch.nonzero((chosen == e) & keep, as_tuple=True)
        if rows.numel():
            y = y.index_add(0, rows, weights[rows, cols, None] * expert(params, x[rows]))
    return y, balance_loss(logits, chosen, len(experts)), keep, chosen


def _experts_of(state: dict) -> int:
    return state["router.weight"].size(0)


def dense(state: dict, x, g, k, capacity_factor, c=R.C_AUX) -> dict:
    """The dense layer on ``x`` and the gradients of (y * g).sum() + c * aux: of x, the
    router, each expert (zeros for an expert that got no token); kept assignments per expert."""
    leaves = {name: t.clone().requires_grad_() for name, t in state.items()}
    experts = [[leaves[f"experts.{j}.{p}"] for p in ("0.weight", "0.bias", "2.weight", "2.bias")]
               for j in range(_experts_of(state))]
    xl = x.clone().requires_grad_()
    y, aux, keep, chosen = moe_forward(leaves["router.weight"], experts, xl, k, capacity_factor)
    names = ["x", *leaves]
    grads = torch.autograd.grad((y * g).sum() + c * aux, [xl, *leaves.values()],
                                allow_unused=True)
    grads = {n: torch.zeros_like(t) if gr is None else gr
             for n, t, gr in zip(names, [xl, *leaves.values()], grads)}
    kept = torch.bincount(chosen[keep], minlength=len(experts))
    return {"y": y.detach(), "aux": aux.detach(), "grads": grads, "kept": kept}


@functools.lru_cache(maxsize=64)
def ep_dense(seed: int, n: int, c: int, r: int) -> dict:
    """:func:`dense` for expert-parallel case ``c`` on group rank ``r`` of ``n``."""
    x, g = R.ep_inputs(seed, n, c, r)
    return dense(R.ep_state(seed, n, c), x, g, R.K, R.EP_CASES[c][0])


def received(seed: int, n: int, c: int, r: int) -> int:
    """Rows group rank ``r`` receives in case ``c``: every rank's kept assignments to its
    experts."""
    m = R.E // n
    return sum(int(ep_dense(seed, n, c, s)["kept"][r * m:(r + 1) * m].sum()) for s in range(n))


# ---------------------------------------------------------------------------- inputs

def route_cases(g: torch.Generator) -> list[dict]:
    """Random float64 logits (k = 1, 2, E), well separated float32 ones, and hand-made ties:
    ``{"logits", "k", "upstream", "what"}``."""
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0],
                         [5.0, 1.0, 1.0, 1.0, 0.5], [0.0, 4.0, 0.0, 4.0, 0.0],
                         [-1.0, -1.0, 7.0, -1.0, 7.0]], dtype=torch.float64)
    separated = torch.stack([torch.randperm(6, generator=g) for _ in range(7)]).double() * 0.4
    cases = [(randn(9, 6) * 2, 2, "random logits (9, 6), k=2"),
             (randn(5, 4), 1, "random logits (5, 4), k=1"),
             (randn(4, 5), 5, "random logits (4, 5), k=5"),
             (randn(6, 7) * 3, 3, "random logits (6, 7), k=3"),
             (ties, 2, "hand-made ties (ties go to the lower expert index), k=2"),
             (ties, 3, "hand-made ties (ties go to the lower expert index), k=3"),
             ((separated + 0.05 * randn(7, 6)).float(), 2, "float32 logits (7, 6), k=2")]
    return [{"logits": logits, "k": k, "upstream": randn(logits.size(0), k).to(logits.dtype),
             "what": what} for logits, k, what in cases]


#: expert_capacity cases: (num_tokens, num_experts, k, capacity_factor); the first ones are
#: where float arithmetic rounds up past the exact value, whatever the order of its operations.
CAPACITY_CASES = [(50, 10, 2, 1.1), (50, 11, 1, 1.1), (100, 4, 2, 1.1), (45, 2, 2, 2.2),
                  (20, 9, 3, 1.05), (7, 4, 2, 2), (13, 8, 2, 1.25), (0, 4, 2, 1.5),
                  (9, 8, 2, 1.0), (1, 8, 1, 0.25), (8, 8, 8, 1), (12, 5, 3, 2.5)]
CAPACITY_ERRORS = [(-1, 4, 2, 1.0), (10, 0, 1, 1.0), (10, 4, 0, 1.0), (10, 4, 5, 1.0),
                   (10, 4, 2, 0.0), (10, 4, 2, -1.25)]


#: The first keep_mask cases are hand-made; the others random.
HAND_MADE_KEEP = 5


def keep_cases(g: torch.Generator) -> list[dict]:
    """Hand-made (first-choice priority, capacity 0, capacity beyond every count) and random
    routings (k distinct experts per token): ``{"experts", "capacity", "what"}``."""
    priority = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 2]])
    third = torch.tensor([[0, 1, 2], [0, 2, 1], [1, 0, 2], [0, 1, 2]])
    cases = [(priority, 2, "first choices of every token before any second choice"),
             (third, 2, "k=3: all first, then all second, then all third choices"),
             (priority, 0, "capacity 0 (drops everything)"),
             (third, 100, "capacity larger than any count (keeps everything)"),
             (torch.tensor([[3], [3], [1], [3], [3]]), 2, "k=1")]
    out = [{"experts": e, "capacity": c, "what": w} for e, c, w in cases]
    assert len(out) == HAND_MADE_KEEP
    for i, (T, E, k) in enumerate([(13, 5, 2), (20, 4, 3), (16, 8, 2), (11, 6, 1)]):
        experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if i % 2:  # skewed: expert 0 first on most tokens
            experts[::3, 0], experts[::3, 1 % k] = 0, experts[::3, 0]
            experts[::3] = torch.stack([_distinct(row, E) for row in experts[::3]])
        cap = int(torch.randint(1, max(2, T * k // E + 1), (1,), generator=g))
        out.append({"experts": experts, "capacity": cap,
                    "what": f"random experts ({T}, {k}) over {E} experts, capacity {cap}"})
    return out


def _distinct(row: torch.Tensor, E: int) -> torch.Tensor:
    """``row`` with repeated experts replaced by the lowest unused ones."""
    seen, out = set(), []
    for e in row.tolist():
        e = e if e not in seen else min(set(range(E)) - seen - set(row.tolist()))
        seen.add(e)
        out.append(e)
    return torch.tensor(out)


def balance_cases(g: torch.Generator) -> list[dict]:
    """Logits and the experts routing chose (or a skewed pick): ``{"logits", "experts",
    "num_experts", "what"}``."""
    out = []
    for T, E, k, skew in ((10, 6, 2, False), (7, 4, 1, False), (12, 8, 3, True), (9, 5, 2, True)):
        logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 1.5
        if skew:
            logits[:, 0] += 3.0
        experts = route(logits, k)[1]
        out.append({"logits": logits, "experts": experts, "num_experts": E,
                    "what": f"logits ({T}, {E}), k={k}" + (", skewed" if skew else "")})
    return out


#: MoELayer cases: (tokens, experts, k, capacity_factor, skewed); small factors drop tokens.
MOE_CASES = [(11, 4, 2, 4.0, False), (12, 6, 2, 0.75, False), (10, 4, 1, 0.5, True),
             (9, 5, 3, 1.25, True)]


def moe_cases(g: torch.Generator, seed: int) -> list[dict]:
    out = []
    for c, (T, num_experts, k, cf, skew) in enumerate(MOE_CASES):
        state = R.moe_state(seed + 10 * c, num_experts, dead=(num_experts - 1,) if skew else (),
                            popular=skew)
        x = R.randn(seed + 10 * c + 1, T, R.D)
        if skew:
            x[:, 0] = 2.0 + x[:, 0].abs()
        out.append({"state": state, "x": x, "upstream": R.randn(seed + 10 * c + 2, T, R.D),
                    "k": k, "capacity_factor": cf,
                    "c": 0.2 + torch.rand(1, generator=g, dtype=torch.float64).item(),
                    "what": f"{T} tokens, {num_experts} experts, k={k}, capacity_factor={cf}"
                            + (" (skewed: an expert gets no token)" if skew else "")})
    return out


# ---------------------------------------------------------------------------- training

def setup_source() -> str:
    """The release's set-up cell (trusted: the student's copy never reaches the grader)."""
    from ...notebook import runnable_cells
    from ...registry import get

    ((_, source),) = runnable_cells(get("a7_expert_parallel").release, ["setup"])
    return source


class GraderMoE(nn.Module):
    """The grader's MoE layer (MoELayer's attributes and parameter names, :func:`moe_forward`)."""

    def __init__(self, d_model, hidden, num_experts, k=2, capacity_factor=1.25):
        super().__init__()
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(),
                                                   nn.Linear(hidden, d_model))
                                     for _ in range(num_experts))
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor

    def forward(self, x):
        experts = [[e[0].weight, e[0].bias, e[2].weight, e[2].bias] for e in self.experts]
        return moe_forward(self.router.weight, experts, x, self.k, self.capacity_factor)[:2]


def one_process_training(seed: int, source: str, n: int):
    """``(losses, state)``: one process, the dense model, each step's loss the mean over the n
    chunks of (mse on the chunk + aux_coef * the chunk's aux), plain SGD."""
    model = R.seeded_model(source, GraderMoE, seed)
    x, y = R.train_data(seed)
    losses = []
    for _ in range(R.T_STEPS):
        model.zero_grad(set_to_none=True)
        total = 0
        for xs, ys in zip(x.tensor_split(n), y.tensor_split(n)):
            pred, aux = model(xs)
            total = total + F.mse_loss(pred, ys) + R.T_AUX * aux
        loss = total / n
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= R.T_LR * p.grad
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def helper_cells(names) -> list | None:
    """The reference's cells for the graded names a function is graded with."""
    cells = {CELL_OF.get(n, n) for n in names}
    return reference_cells("a7_expert_parallel", ["setup", *sorted(cells)]) if names else None

