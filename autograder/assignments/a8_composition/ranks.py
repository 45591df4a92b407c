"""What each process of Assignment 8's ``train_3d`` checks runs, and the model, data and meshes
it shares with the grader (which rebuilds them from the same seed for the float64 truth).

Trusted harness code: a probe starts :func:`rank_train` on 8 fresh processes with
:func:`autograder.checking.ranks.run_ranks`. One launch covers every mesh of :data:`RUNS`, in
phases: the 8 ranks first train (pp, dp, tp) = (2, 2, 2) in the launcher's default group; then
each rank leaves it and joins a default group of 4 of its own (``init_process_group`` on a
prefix of the probe's TCPStore): ranks 0-3 train (1, 2, 2) while ranks 4-7 train (2, 1, 2);
then ranks 0-3 train (2, 2, 1). Each rank writes its reply into that store when its run is
done, so a later run that fails leaves the earlier runs' replies to be judged. Every call the
student's code makes on any process group is noted from the rank's side, with the group's
ranks and, for send and receive, the peer (:func:`autograder.checking.collectives.
calls_on_every_group`). Every rank imports this module: it imports nothing heavier than torch.
"""
from __future__ import annotations

import datetime
import functools
import os
import pickle
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autograder.checking.collectives import HOOKED_COLLECTIVES, calls_on_every_group
from autograder.checking.probes import describe

F64 = torch.float64
#: The tiny GPT of the checks (tp = 2 splits its 4 heads; pp = 2 its 4 blocks), the batch,
#: steps and learning rate of every run.
MODEL = dict(vocab=16, d_model=8, n_heads=4, n_layers=4, seq_len=6)
BATCH, STEPS, LR = 8, 3, 0.1
WORLD = 8


class Run(NamedTuple):
    label: str
    phase: int
    ranks: tuple          # global ranks of the launch that run it (its own world, in order)
    dims: tuple           # (pp, dp, tp)
    micro_batches: int


def _run(phase, ranks, dims, m):
    n = len(ranks)
    return Run(f"(pp, dp, tp) = {dims} on {n} processes, micro_batches={m}", phase,
               tuple(ranks), dims, m)


#: Every mesh of the checks; runs of one phase side by side on disjoint ranks.
RUNS = [_run(0, range(8), (2, 2, 2), 2),
        _run(1, range(4), (1, 2, 2), 2), _run(1, range(4, 8), (2, 1, 2), 4),
        _run(2, range(4), (2, 2, 1), 1)]
PHASES = 1 + max(run.phase for run in RUNS)


# ---------------------------------------------------------------------------- the model
# The notebook's set-up cell, verbatim (tests/test_grader_a8.py keeps them equal).

class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)   # rows [q; k; v]; head j: rows j*hd:(j+1)*hd of each
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = q.size(-1) // self.head_dim              # from the width: works on a tp shard too
        q, k, v = (t.view(B, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, d_model, n_heads, n_layers, seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


GRADER_CLASSES = ("Attention", "MLP", "Block", "TinyGPT")


def seeded_model(seed: int) -> TinyGPT:
    """``model_fn``: the same float64 TinyGPT on every call, in every process; every parameter
    drawn by name from ``seed`` (layer norms around 1, not 1 and 0: their gradients count)."""
    with torch.random.fork_rng(devices=[]):
        model = TinyGPT(**MODEL).to(F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            draw = torch.randn(p.shape, generator=g, dtype=F64)
            if p.dim() > 1:
                p.copy_(draw * p.shape[-1] ** -0.5)
            elif ".ln" in f".{name}" and name.endswith("weight"):
                p.copy_(1 + 0.2 * draw)
            else:
                p.copy_(0.2 * draw)
    return model


def train_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``: LongTensors (BATCH, seq_len), the same on every rank."""
    g = torch.Generator().manual_seed(seed + 1)
    shape = (BATCH, MODEL["seq_len"])
    return (torch.randint(MODEL["vocab"], shape, generator=g),
            torch.randint(MODEL["vocab"], shape, generator=g))


# ---------------------------------------------------------------------------- the meshes

def coordinates(dims: tuple, r: int) -> tuple[int, int, int]:
    """``(p, d, t)`` of rank ``r`` of a (pp, dp, tp) mesh (init_device_mesh's row-major order)."""
    pp, dp, tp = dims
    return r // (dp * tp), r // tp % dp, r % tp


def groups_of(dims: tuple, r: int) -> dict[str, tuple]:
    """The ranks of rank ``r``'s ``pp``, ``dp`` and ``tp`` groups."""
    pp, dp, tp = dims
    p, d, t = coordinates(dims, r)
    return {"pp": tuple(q * dp * tp + d * tp + t for q in range(pp)),
            "dp": tuple(p * dp * tp + e * tp + t for e in range(dp)),
            "tp": tuple(p * dp * tp + d * tp + u for u in range(tp))}


def owned(dims: tuple, r: int) -> list[str]:
    """The dense names of the parameters rank ``r``'s stage owns."""
    pp = dims[0]
    p = coordinates(dims, r)[0]
    L = MODEL["n_layers"]
    names = [n for n, _ in TinyGPT(**MODEL).named_parameters()]
    mine = tuple(f"blocks.{i}." for i in range(p * L // pp, (p + 1) * L // pp))
    mine += ("tok_emb.", "pos_emb.") if p == 0 else ()
    mine += ("ln_f.", "head.") if p == pp - 1 else ()
    return [n for n in names if n.startswith(mine)]



def violations(dims: tuple, r: int, calls) -> list[str]:
    """What rank ``r`` of a (pp, dp, tp) mesh sent where it should not: a collective on any
    group but its tp, dp or pp group (or itself alone), a send or receive with any rank but those
    of its neighbouring stages (same d and t). ``calls``: ``(group's ranks, op, peer, in, out)``.
    The pp group is allowed because torch's own pipelining all-reduces on it while a schedule
    sets up (2.15: the inference-mode vote and the point-to-point warm-up)."""
    groups = groups_of(dims, r)
    allowed = {frozenset(groups["tp"]), frozenset(groups["dp"]), frozenset(groups["pp"]),
               frozenset({r})}
    pp, dp, tp = dims
    peers = {q for q in (r - dp * tp, r + dp * tp) if 0 <= q < pp * dp * tp}
    bad = []
    for ranks, op, peer, _, _ in calls:
        if op in ("SEND", "RECV") and peer not in peers:
            who = "any source" if peer is None else f"rank {peer}"
            bad.append(f"a {op} with {who} (the ranks of its neighbouring stages, same d and t: "
                       f"{sorted(peers)})")
        elif op in HOOKED_COLLECTIVES and frozenset(ranks) not in allowed:
            name = "the world group" if len(ranks) == pp * dp * tp else "the group"
            article = "an" if op[0] == "A" else "a"
            bad.append(f"{article} {op} on {name} of ranks {list(ranks)} (its tp group is "
                       f"{list(groups['tp'])}, its dp group {list(groups['dp'])}, its pp group "
                       f"{list(groups['pp'])})")
    return list(dict.fromkeys(bad))


# ---------------------------------------------------------------------------- a rank's work

def violation_key(run: int, r: int) -> str:
    return f"a8/violation/{run}/{r}"


class _Noted(list):
    """The calls of one rank's run; the first that goes where it should not is also written to
    the probe's store at once, so that a run it makes fail can say why."""

    def __init__(self, store, i: int, run: Run, r: int):
        super().__init__()
        self.store, self.i, self.run, self.r, self.told = store, i, run, r, False

    def append(self, call):
        super().append(call)
        if not self.told:
            bad = violations(self.run.dims, self.r, [call])
            if bad:
                self.told = True
                p = coordinates(self.run.dims, self.r)[0]
                self.store.set(violation_key(self.i, self.r), f"train_3d with {self.run.label}, "
                               f"rank {self.r} (stage {p}) made {bad[0]}")

def reply_key(run: int, r: int) -> str:
    return f"a8/reply/{run}/{r}"


def _one_run(fn, seed: int, i: int, store) -> dict:
    """``train_3d`` on this rank of run ``i``'s world, every call on every group noted."""
    run = RUNS[i]
    pp, dp, tp = run.dims
    model_fn = functools.partial(seeded_model, seed)
    inputs, targets = train_data(seed)
    noted = _Noted(store, i, run, dist.get_rank())
    try:
        with calls_on_every_group(by_group=True, log=noted) as calls:
            result = fn(model_fn, (inputs, targets), dp=dp, tp=tp, pp=pp,
                        micro_batches=run.micro_batches, steps=STEPS, lr=LR)
    except Exception as exc:
        raise RuntimeError(f"train_3d with {run.label}, rank {dist.get_rank()}: "
                           f"{type(exc).__name__}: {exc}") from exc
    losses, state = result if isinstance(result, (tuple, list)) and len(result) == 2 \
        else (result, None)
    return {"losses": describe(losses),
            "state": ({str(k): describe(v) for k, v in state.items()}
                      if isinstance(state, dict) else describe(state)),
            "calls": [tuple(call) for call in calls]}


def rank_train(rank, world_size, fn, seed, port):
    """Every run of :data:`RUNS` this rank takes part in, phase by phase; each reply goes into
    the probe's store (at ``port``) as soon as it is ready."""
    timeout = datetime.timedelta(seconds=float(os.environ.get("LAUNCH_COLLECTIVE_TIMEOUT", 20)))
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    in_group = True                                   # the launcher's world of 8
    for phase in range(PHASES):
        mine = [(i, run) for i, run in enumerate(RUNS) if run.phase == phase and rank in run.ranks]
        if not mine:
            continue
        i, run = mine[0]
        if run.ranks != tuple(range(world_size)) or not in_group:
            if in_group:
                dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore(f"a8/run{i}", store),
                                    rank=run.ranks.index(rank), world_size=len(run.ranks),
                                    timeout=timeout)
            in_group = True
        reply = _one_run(fn, seed, i, store)
        store.set(reply_key(i, run.ranks.index(rank)), pickle.dumps(reply))
        dist.barrier()                                # the grader's, after the counting
        dist.destroy_process_group()
        in_group = False
    # the launcher ends with a barrier and destroys the default group: a world of one here
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return None
