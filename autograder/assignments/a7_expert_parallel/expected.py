"""Assignment 7's inputs and public cases: the random inputs every check draws (fresh each run),
the fixed public cases with their values (``public_cases.json``, data generated from the
instructor's answer key), and the trusted set-up cell. No expected value is computed here: the
public checks judge with invariants, finite differences and the per-token truth that the probes
bring back (:func:`.ranks.per_token_layer`); the answer key (``solutions/a7_expert_parallel/
answer_key.py``, the instructor's only) computes the rest."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from autograder.keys import answer_key

from . import ranks as R

ASSIGNMENT = "a7_expert_parallel"
#: The fixed public cases and their values (data; see the answer key's ``public_cases``).
PUBLIC_CASES = Path(__file__).with_name("public_cases.json")


def public_cases() -> dict:
    return json.loads(PUBLIC_CASES.read_text())


def key():
    """The answer key module, or None (the student edition)."""
    return answer_key(ASSIGNMENT)


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


def keep_cases(g: torch.Generator) -> list[dict]:
    """Random routings (k distinct experts per token, some skewed) and capacities:
    ``{"experts", "capacity", "what"}``."""
    out = []
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
    """Logits and the k experts of highest logit (a skewed pick where expert 0 is favoured):
    ``{"logits", "experts", "num_experts", "what"}``."""
    out = []
    for T, E, k, skew in ((10, 6, 2, False), (7, 4, 1, False), (12, 8, 3, True), (9, 5, 2, True)):
        logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 1.5
        if skew:
            logits[:, 0] += 3.0
        experts = logits.topk(k, dim=-1).indices      # no ties in random float64 logits
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

