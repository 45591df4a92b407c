"""Assignment 8's answer key: the instructor's only (``solutions/`` never ships; see
:mod:`autograder.keys`).

The cost model in exact arithmetic (integers for bytes, fractions for seconds) and an exhaustive
``best_config`` search, written from the released text; the hidden fixed cases, the random case
generators (their expected values need the cost model) and ``best_config``'s hidden cases. The
public fixed cases and their expected values are :func:`public_cases`, stored as data in
``autograder/assignments/a8_composition/public_cases.json`` (regenerate it with ``python
solutions/a8_composition/answer_key.py``; a test keeps the two equal).

Imported only in the grader's own process (checks.py), never in the sandbox.
"""
from __future__ import annotations

import functools
import itertools
import json
from fractions import Fraction
from pathlib import Path

import torch

from autograder.assignments.a8_composition import expected as E
from autograder.assignments.a8_composition.expected import (GPT8B, GPT70B, H100, ODD, SMALL,
                                                            SMALL_NODES, TINY, TOY, par)

#: Bytes of a float32 value; the ZeRO stages and schedules the ValueError rules let pass.
BYTES, ZERO_STAGES, SCHEDULES = 4, (0, 1, 2, 3), ("1f1b", "gpipe")
#: What ZeRO shards over dp, from which stage on, and its float32 copies per parameter.
SHARDED_FROM = {"params": (3, 1), "grads": (2, 1), "optimizer": (1, 2)}


# ---------------------------------------------------------------------------- the cost model

def valid(model, par) -> bool:
    """Whether the ValueError rules let ``par`` pass."""
    dp, tp, pp, m = (par[k] for k in ("dp", "tp", "pp", "micro_batches"))
    return (min(dp, tp, pp, m) >= 1 and not model["n_heads"] % tp and not model["d_model"] % tp
            and not model["n_layers"] % pp and not model["batch"] % (dp * m)
            and par["zero"] in ZERO_STAGES and par["schedule"] in SCHEDULES)


def stage_params(model, par) -> list[int]:
    """Parameters one rank of each stage holds, tensor parallelism applied, before ZeRO."""
    V, h, s, L = (model[k] for k in ("vocab", "d_model", "seq_len", "n_layers"))
    tp, pp = par["tp"], par["pp"]
    block = 12 * h * h // tp + 7 * h // tp + 6 * h
    return [(L // pp) * block + (V * h + s * h if i == 0 else 0)
            + (2 * h + h * V if i == pp - 1 else 0) for i in range(pp)]


def per_rank_memory(model, par) -> dict:
    """Bytes per rank of each stage (exact ints)."""
    V, h, a, s, L, B = (model[k] for k in ("vocab", "d_model", "n_heads", "seq_len",
                                           "n_layers", "batch"))
    dp, tp, pp, m = (par[k] for k in ("dp", "tp", "pp", "micro_batches"))
    zero, ckpt = par["zero"], par["checkpoint"]
    mb = B // (dp * m)
    layer = mb * (4 * s * h + 12 * s * h // tp + 2 * (a // tp) * s * s)
    out = {k: [] for k in E.MEMORY_KEYS}
    for i, P in enumerate(stage_params(model, par)):
        held = {k: copies * BYTES * ((P + dp - 1) // dp if zero >= stage else P)
                for k, (stage, copies) in SHARDED_FROM.items()}
        in_flight = m if par["schedule"] == "gpipe" else min(pp - i, m)
        per_mb = (L // pp) * (mb * s * h if ckpt else layer) + (mb * s * V if i == pp - 1 else 0)
        held["activations"] = BYTES * (in_flight * per_mb + (layer if ckpt else 0))
        held["total"] = sum(held.values())
        for k in E.MEMORY_KEYS:
            out[k].append(held[k])
    return out


def groups(par, mode) -> list[list[int]]:
    """Every group of ``mode`` ("tp", "dp" or "pp") of the (pp, dp, tp) mesh, as global ranks."""
    dp, tp, pp = par["dp"], par["tp"], par["pp"]
    mesh = torch.arange(pp * dp * tp).view(pp, dp, tp)
    dim = ("pp", "dp", "tp").index(mode)
    return mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()


def one_node(hw, par, mode) -> bool:
    """Whether every group of ``mode`` has all of its ranks on one node (rank r's: r // node)."""
    return _one_node(hw["node_size"], par["dp"], par["tp"], par["pp"], mode)


@functools.lru_cache(maxsize=None)
def _one_node(node_size, dp, tp, pp, mode) -> bool:
    return all(len({r // node_size for r in g}) == 1
               for g in groups(dict(dp=dp, tp=tp, pp=pp), mode))


def _bandwidth(hw, par, mode) -> Fraction:
    return Fraction(hw["intra_bw"] if one_node(hw, par, mode) else hw["inter_bw"])


def step_time(model, par, hw) -> dict:
    """Seconds of one step, exact (Fractions of the float inputs)."""
    V, h, s, L, B = (model[k] for k in ("vocab", "d_model", "seq_len", "n_layers", "batch"))
    dp, tp, pp, m = (par[k] for k in ("dp", "tp", "pp", "micro_batches"))
    mb, n = B // (dp * m), L // pp
    flops = Fraction(hw["flops"])
    block = 24 * mb * s * h * h // tp + 4 * mb * s * s * h // tp
    c = max((3 * (n * block + (2 * mb * s * h * V if i == pp - 1 else 0))
             + (n * block if par["checkpoint"] else 0)) / flops for i in range(pp))
    activation = BYTES * mb * s * h
    tp_mb = Fraction(n * (6 if par["checkpoint"] else 4) * 2 * (tp - 1) * activation, tp) \
        / _bandwidth(hw, par, "tp")
    k = 3 if par["zero"] == 3 else 2
    dp_time = max(Fraction(k * (dp - 1) * BYTES * P, dp) / _bandwidth(hw, par, "dp")
                  for P in stage_params(model, par))
    pp_time = 2 * m * (pp - 1) * activation / _bandwidth(hw, par, "pp")
    t = dict(compute=m * c, bubble=(pp - 1) * (c + tp_mb), tp=m * tp_mb, dp=dp_time,
             pp=Fraction(pp_time))
    t["total"] = sum(t.values())
    return t


def candidates(model, world_size):
    """Every configuration of ``world_size`` ranks that passes the ValueError rules."""
    divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
    for tp, pp in itertools.product(divisors, divisors):
        dp = world_size // tp // pp
        if dp * tp * pp != world_size:
            continue
        for m in range(1, model["batch"] // dp + 1):
            for zero, ckpt, sched in itertools.product(ZERO_STAGES, (False, True), SCHEDULES):
                cfg = par(dp, tp, pp, m, zero, ckpt, sched)
                if valid(model, cfg):
                    yield cfg


def fitting(model, hw, world_size) -> list[tuple[Fraction, int, dict]]:
    """``(exact step time, max total memory, par)`` of every configuration that fits."""
    out = []
    for cfg in candidates(model, world_size):
        memory = max(per_rank_memory(model, cfg)["total"])
        if memory <= hw["memory"]:
            out.append((step_time(model, cfg, hw)["total"], memory, cfg))
    return out


def tie_key(memory, par):
    return (memory, par["pp"], par["tp"], par["micro_batches"], par["zero"], par["checkpoint"],
            par["schedule"])


def best_config(model, hw, world_size) -> dict | None:
    """The fastest fitting configuration (exact times: every case is checked to have no time
    within 1e-6 of the best that is not equal to it, so this is what math.isclose with
    rel_tol=1e-9 decides on floats); ties to the smallest key. None when nothing fits."""
    fits = fitting(model, hw, world_size)
    if not fits:
        return None
    best = min(t for t, _, _ in fits)
    return min((tie_key(mem, cfg), cfg) for t, mem, cfg in fits if t == best)[1]


# ---------------------------------------------------------------------------- the cases

#: (model, par, hw) of the fixed cases: every ZeRO stage, with and without checkpointing, both
#: schedules, fewer micro-batches than stages (1F1B's min), shards that do not divide; groups
#: inside a node, across, at its edge, and groups that would fit in a node but straddle two
#: (tp = 3 on nodes of 8: ranks 6, 7, 8; dp groups of a second stage). The public ones' values
#: are in public_cases.json; the hidden ones are checked with the random ones.
PUBLIC_COST_CASES = [
    (TINY, par(1, 1, 1, 1), H100),
    (TINY, par(2, 2, 2, 2, 1, False, "gpipe"), SMALL_NODES),
    (TINY, par(1, 4, 4, 2, 3, True, "1f1b"), TOY),
    (ODD, par(3, 2, 3, 5, 3, False, "1f1b"), SMALL_NODES),
    (ODD, par(5, 3, 2, 2, 1, True, "gpipe"), TOY),
    (SMALL, par(4, 2, 4, 8, 2, False, "1f1b"), TOY),
    (GPT8B, par(8, 8, 4, 8, 1, True, "1f1b"), SMALL_NODES),
    (ODD, par(2, 3, 2, 3, 2, False, "1f1b"), H100),
]
HIDDEN_COST_CASES = [
    (TINY, par(4, 1, 2, 1, 2, False, "1f1b"), H100),
    (ODD, par(1, 6, 6, 3, 2, True, "1f1b"), H100),
    (SMALL, par(8, 1, 1, 4, 3, True, "gpipe"), H100),
    (GPT8B, par(2, 4, 8, 4, 3, False, "gpipe"), TOY),
    (GPT70B, par(8, 8, 8, 8, 3, True, "1f1b"), H100),
    (GPT70B, par(4, 4, 16, 16, 0, False, "1f1b"), SMALL_NODES),
    (ODD, par(5, 3, 1, 2, 0, False, "gpipe"), H100),
    (ODD, par(3, 1, 2, 5, 1, True, "gpipe"), SMALL_NODES),
]


def random_cases(g: torch.Generator, n: int = 8) -> list[tuple[dict, dict]]:
    """``n`` random valid (model, par) pairs from ``g``."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    out = []
    while len(out) < n:
        a, hd = pick([1, 2, 3, 4, 6, 8]), pick([2, 4, 8, 16])
        model = dict(vocab=pick([7, 50, 257, 1000]), d_model=a * hd, n_heads=a,
                     n_layers=pick([1, 2, 3, 4, 6, 8]), seq_len=pick([3, 16, 33, 128]),
                     batch=pick([1, 6, 8, 12, 24, 64]))
        cfg = par(pick([1, 2, 3, 4, 8]), pick([1, 2, 3, 4]), pick([1, 2, 3, 4]),
                  pick([1, 2, 3, 4, 6]), pick(list(ZERO_STAGES)), pick([False, True]),
                  pick(list(SCHEDULES)))
        if valid(model, cfg):
            out.append((model, cfg))
    return out


def memory_cases(g: torch.Generator) -> list[tuple[dict, dict]]:
    """(model, par) of per_rank_memory's hidden check: the hidden fixed cases, random ones."""
    return [(m, p) for m, p, _ in HIDDEN_COST_CASES] + random_cases(g)


def time_cases(g: torch.Generator) -> list[tuple[dict, dict, dict]]:
    """(model, par, hw) of step_time's hidden check: the hidden fixed cases, and random ones on
    random hardware."""
    out = list(HIDDEN_COST_CASES)
    while len(out) < len(HIDDEN_COST_CASES) + 8 or not any(
            straddles(hw, p) for _, p, hw in out[len(HIDDEN_COST_CASES):]):
        for m, p in random_cases(g, 1):
            hw = dict(flops=float(torch.randint(1, 1000, (1,), generator=g)) * 1e12,
                      memory=1 << 30, node_size=int(torch.randint(1, 9, (1,), generator=g)),
                      intra_bw=float(torch.randint(50, 900, (1,), generator=g)) * 1e9,
                      inter_bw=float(torch.randint(5, 50, (1,), generator=g)) * 1e9)
            out.append((m, p, hw))
    return out


def straddles(hw, par) -> list[str]:
    """The modes of ``par`` whose groups would fit in a node (``size * stride <= node_size``)
    but not all lie on one: where 'spans few enough ranks' and 'on one node' differ. The random
    cases hold at least one."""
    strides = {"tp": 1, "dp": par["tp"], "pp": par["dp"] * par["tp"]}
    return [mode for mode, stride in strides.items() if par[mode] > 1
            and par[mode] * stride <= hw["node_size"] and not one_node(hw, par, mode)]


GiB = 2**30
#: best_config's hidden cases: (what, model, hw, world size). Most memory limits bind: ZeRO,
#: checkpointing and pipelining decide what fits, one limit equals the best's memory exactly,
#: with plenty of memory the tie-break decides among the ZeRO stages, one fits nothing; in the
#: last four a replica's batch is smaller than pp, and the best runs 1F1B with fewer
#: micro-batches than stages (a search that leaves those out answers otherwise).
BEST_CASES = [
    ("tiny model on 8 GPUs of 2 per node, 14224 bytes each (the best needs exactly that)",
     TINY, dict(TOY, memory=14224), 8),
    ("tiny model on 8 GPUs of 2 per node, 18752 bytes each", TINY, dict(TOY, memory=18752), 8),
    ("tiny model on 8 GPUs of 2 per node, plenty of memory", TINY, dict(TOY, memory=GiB), 8),
    ("GPT-2-small-like on 16 GPUs of 4 per node, 0.6 GiB each", SMALL,
     dict(SMALL_NODES, memory=int(0.6 * GiB)), 16),
    ("8B-like on 64 GPUs of 8 per node, 80 GiB each", GPT8B, H100, 64),
    ("8B-like on 64 GPUs of 8 per node, 10 GiB each", GPT8B, dict(H100, memory=10 * GiB), 64),
    ("8B-like on 16 GPUs of 4 per node, 40 GiB each", GPT8B, SMALL_NODES, 16),
    ("70B-like on 64 GPUs of 8 per node, 80 GiB each", GPT70B, H100, 64),
    ("70B-like on 8 GPUs of 8 per node, 80 GiB each (nothing fits)", GPT70B, H100, 8),
    # a replica's batch smaller than pp: fewer micro-batches than stages, 1F1B (its in-flight
    # min(pp - i, m) can be what fits)
    ("tiny model with batch 1 on 4 GPUs of 2 per node, plenty of memory", dict(TINY, batch=1),
     dict(TOY, memory=GiB), 4),
    ("GPT-2-small-like with batch 8 on 16 GPUs of 4 per node, 606071808 bytes each (the best "
     "needs exactly that)", dict(SMALL, batch=8), dict(SMALL_NODES, memory=606071808), 16),
    ("8B-like with batch 8 on 64 GPUs of 4 per node, 7894728704 bytes each",
     dict(GPT8B, batch=8), dict(SMALL_NODES, memory=7894728704), 64),
    ("odd-sized model with batch 3 on 12 GPUs of 4 per node, 3268128 bytes each",
     dict(ODD, batch=3), dict(SMALL_NODES, memory=3268128), 12),
]

def hidden_best_cases() -> list[tuple[str, dict, dict, int]]:
    """best_config's hidden cases, for its hidden check."""
    return list(BEST_CASES)


#: best_config's public cases (none of them hidden): (what, model, hw, world size).
PUBLIC_BEST_CASES = [
    ("tiny model on 4 GPUs of 2 per node, 27520 bytes each (the best needs exactly that)",
     TINY, dict(TOY, memory=27520), 4),
    ("tiny model on 4 GPUs of 2 per node, 25000 bytes each", TINY, dict(TOY, memory=25000), 4),
    ("tiny model on 4 GPUs of 2 per node, plenty of memory", TINY, dict(TOY, memory=GiB), 4),
    ("odd-sized model on 6 GPUs of 4 per node, 4 MiB each", ODD,
     dict(SMALL_NODES, memory=4 * 2**20), 6),
    ("GPT-2-small-like on 8 GPUs of 8 per node, 2 GiB each", SMALL, dict(H100, memory=2 * GiB),
     8),
    ("8B-like on 1 GPU of 80 GiB (nothing fits)", GPT8B, H100, 1),
    ("tiny model with batch 2 on 8 GPUs of 4 per node, plenty of memory (fewer micro-batches "
     "than stages)", dict(TINY, batch=2), dict(SMALL_NODES, memory=GiB), 8),
    ("tiny model with batch 4 on 8 GPUs of 8 per node, 12992 bytes each (fewer micro-batches "
     "than stages; the best needs exactly that)", dict(TINY, batch=4), dict(H100, memory=12992),
     8),
]


# ---------------------------------------------------------------------------- public values

def _time(model, cfg, hw) -> dict:
    return {k: float(v) for k, v in step_time(model, cfg, hw).items()}


def public_cases() -> dict:
    """The public fixed cases and their expected values, as stored in public_cases.json."""
    return {
        "about": ("Assignment 8's public fixed cases and their expected values (generated from "
                  "the instructor's answer key; the hidden and random cases are not here). "
                  "per_rank_memory: bytes, exact ints. step_time: the float of the exact "
                  "value, checked within 1e-12 * (|w| + 1e-3 * total). best_config: the "
                  "configuration, or null where nothing fits (ValueError)."),
        "per_rank_memory": [dict(model_cfg=m, par_cfg=p, expected=per_rank_memory(m, p))
                            for m, p, _ in PUBLIC_COST_CASES],
        "step_time": [dict(model_cfg=m, par_cfg=p, hw_cfg=hw, expected=_time(m, p, hw))
                      for m, p, hw in PUBLIC_COST_CASES],
        "best_config": [dict(what=what, model_cfg=m, hw_cfg=hw, world_size=world,
                             expected=best_config(m, hw, world))
                        for what, m, hw, world in PUBLIC_BEST_CASES],
    }


PUBLIC_CASES_PATH = E.PUBLIC_CASES_PATH


def public_cases_text() -> str:
    """public_cases.json's text: one case a line."""
    parts = []
    for key, value in public_cases().items():
        if isinstance(value, list):
            items = ",\n".join(f"  {json.dumps(case)}" for case in value)
            parts.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_public_cases(path: Path = PUBLIC_CASES_PATH) -> None:
    path.write_text(public_cases_text())


if __name__ == "__main__":
    write_public_cases()
    print(f"wrote {PUBLIC_CASES_PATH}")
