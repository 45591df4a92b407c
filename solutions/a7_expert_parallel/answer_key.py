"""Assignment 7's answer key: the instructor's only (``solutions/`` never ships; see
:mod:`autograder.keys`). It holds the reference implementations the hidden checks compare with
(routing, capacity and the fill order, the load-balancing loss, the dense MoE layer, one process
training the dense model), the hidden cases, and :func:`public_cases`, from which
``autograder/assignments/a7_expert_parallel/public_cases.json`` is generated (a test keeps the
two equal)::

    .venv/bin/python -c "import json, runpy; print(json.dumps(runpy.run_path(
        'solutions/a7_expert_parallel/answer_key.py')['public_cases'](), indent=1))" \\
        > autograder/assignments/a7_expert_parallel/public_cases.json
"""
from __future__ import annotations

import functools
from fractions import Fraction

import torch
import torch.nn.functional as F

from autograder.assignments.a7_expert_parallel import ranks as R

F64 = torch.float64


# ---------------------------------------------------------------------------- the parts

def route(logits: torch.Tensor, k: int):
    """``(weights, experts)``: the k most probable experts (a stable descending sort: ties to
    the lower index; contiguous, as the text promises), their probabilities renormalised over
    the k (for every k: with k = 1 the weight is 1 and carries no gradient)."""
    probs = torch.softmax(logits, dim=-1)
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
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
    """The dense layer, vectorised per expert: ``(y, aux, keep, chosen experts)``; an expert
    without kept tokens is not called."""
    logits = x @ router_weight.T
    weights, chosen = route(logits, k)
    keep = keep_mask(chosen, capacity(x.size(0), len(experts), k, capacity_factor))
    y = torch.zeros_like(x)
    for e, params in enumerate(experts):
        rows, cols = torch.nonzero((chosen == e) & keep, as_tuple=True)
        if rows.numel():
            y = y.index_add(0, rows, weights[rows, cols, None] * expert(params, x[rows]))
    return y, balance_loss(logits, chosen, len(experts)), keep, chosen


def dense(state: dict, x, g, k, capacity_factor, c=R.C_AUX) -> dict:
    """The key's layer and its gradients (:func:`autograder...ranks.layer_truth`)."""
    return R.layer_truth(moe_forward, state, x, g, k, capacity_factor, c)


@functools.lru_cache(maxsize=64)
def ep_dense(seed: int, n: int, c: int, r: int) -> dict:
    """:func:`dense` for expert-parallel case ``c`` on group rank ``r`` of ``n``."""
    x, g = R.ep_inputs(seed, n, c, r)
    return dense(R.ep_state(seed, n, c), x, g, R.K, R.EP_CASES[c][0])


#: The key's MoE layer as a module (MoELayer's attributes and parameter names).
KeyMoE = functools.partial(R.LayerModule, moe_forward)


def one_process_training(seed: int, source: str, n: int):
    """``(losses, state)`` of one process training the dense model with the key's layer."""
    return R.train_one_process(KeyMoE, seed, source, n)


# ---------------------------------------------------------------------------- hidden cases

#: expert_capacity's hidden cases (more where float arithmetic rounds the other way).
HIDDEN_CAPACITY = [(45, 2, 2, 2.2), (20, 9, 3, 1.05), (13, 8, 2, 1.25), (9, 8, 2, 1.0),
                   (1, 8, 1, 0.25), (12, 5, 3, 2.5), (30, 7, 2, 0.7), (100, 3, 1, 0.3)]


def capacity_cases(g: torch.Generator) -> list[tuple]:
    """The hidden cases and 12 random ones (capacity factors of up to two decimals, or ints)."""
    out = list(HIDDEN_CAPACITY)
    for i in range(12):
        E = int(torch.randint(1, 17, (1,), generator=g))
        k = int(torch.randint(1, E + 1, (1,), generator=g))
        T = int(torch.randint(0, 300, (1,), generator=g))
        hundredths = int(torch.randint(5, 500, (1,), generator=g))
        out.append((T, E, k, hundredths // 100 if i % 4 == 3 and hundredths >= 100
                    else round(hundredths / 100, 2)))
    return out


# ---------------------------------------------------------------------------- public cases

#: expert_capacity's public cases: (num_tokens, num_experts, k, capacity_factor).
PUBLIC_CAPACITY = [(50, 10, 2, 1.1), (50, 11, 1, 1.1), (100, 4, 2, 1.1), (7, 4, 2, 2),
                   (0, 4, 2, 1.5), (8, 8, 8, 1)]
CAPACITY_ERRORS = [(-1, 4, 2, 1.0), (10, 0, 1, 1.0), (10, 4, 0, 1.0), (10, 4, 5, 1.0),
                   (10, 4, 2, 0.0), (10, 4, 2, -1.25)]


def public_cases() -> dict:
    """The public fixed cases with their values (the JSON's content, as plain data)."""
    g = torch.Generator().manual_seed(31)
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0],
                         [5.0, 1.0, 1.0, 1.0, 0.5], [-1.0, -1.0, 7.0, -1.0, 7.0]], dtype=F64)
    routes = [(torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=F64).log(), 2, "the text's example"),
              (torch.tensor([[0.3, 0.3, 0.4]], dtype=F64).log(), 2,
               "the text's tie: probabilities [0.3, 0.3, 0.4]"),
              (ties, 2, "ties (to the lower expert index), k=2"),
              (ties, 3, "ties (to the lower expert index), k=3"),
              (torch.randn(6, 5, generator=g, dtype=F64) * 2, 2, "fixed logits (6, 5), k=2"),
              (torch.randn(4, 6, generator=g, dtype=F64), 1, "fixed logits (4, 6), k=1"),
              (torch.randn(3, 4, generator=g, dtype=F64), 4, "fixed logits (3, 4), k=4")]
    route_cases = []
    for logits, k, what in routes:
        weights, experts = route(logits, k)
        route_cases.append({"what": what, "logits": logits.tolist(), "k": k,
                            "experts": experts.tolist(), "weights": weights.tolist()})
    priority = [[0, 1], [1, 0], [0, 1], [1, 0], [0, 2]]
    third = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [0, 1, 2]]
    keeps = [([[0, 1], [0, 2], [0, 1], [1, 0]], 2, "the text's example"),
             (priority, 2, "first choices of every token before any second choice"),
             (third, 2, "k=3: all first, then all second, then all third choices"),
             (priority, 0, "capacity 0 (drops everything)"),
             (third, 100, "capacity larger than any count (keeps everything)"),
             ([[3], [3], [1], [3], [3]], 2, "k=1")]
    keep_cases = [{"what": what, "experts": experts, "capacity": cap,
                   "keep": keep_mask(torch.tensor(experts), cap).tolist()}
                  for experts, cap, what in keeps]
    balances = [(torch.zeros(4, 4, dtype=F64), [[0], [1], [2], [3]], 4, "uniform: the loss is 1")]
    for T, E, k, skew in ((8, 5, 2, False), (6, 4, 1, False), (9, 6, 3, True)):
        logits = torch.randn(T, E, generator=g, dtype=F64) * 1.5
        if skew:
            logits[:, 0] += 3.0
        balances.append((logits, logits.topk(k, dim=-1).indices.tolist(), E,
                         f"fixed logits ({T}, {E}), k={k}" + (", skewed" if skew else "")))
    balance_cases = [{"what": what, "logits": logits.tolist(), "experts": experts,
                      "num_experts": E,
                      "loss": balance_loss(logits, torch.tensor(experts), E).item()}
                     for logits, experts, E, what in balances]
    return {"route": route_cases,
            "expert_capacity": [{"args": list(case), "value": capacity(*case)}
                                for case in PUBLIC_CAPACITY],
            "expert_capacity_errors": [list(case) for case in CAPACITY_ERRORS],
            "keep_mask": keep_cases,
            "load_balancing_loss": balance_cases}
