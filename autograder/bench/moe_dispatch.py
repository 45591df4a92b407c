"""The mixture-of-experts layer that ``python -m autograder.bench a7_expert_parallel`` measures,
and what counts its bytes (the benchmark itself, its runs, table and plot:
:mod:`autograder.bench.a7_expert_parallel`).

- :func:`route` (softmax over all experts, top-k by a stable sort: ties to the lower index,
  weights renormalised over the k), :func:`expert_capacity` (exact, the factor taken as the
  decimal it prints as), :func:`keep_mask` (first choices of every token before any second
  choice), :func:`load_balancing_loss` (Switch Transformer eq. 4 for k choices);
- :func:`make_moe`: a layer (``router``: Linear(d, E, bias=False); ``experts``: E MLPs
  Linear(d, h), GELU, Linear(h, d)); :func:`dense_forward`: it on one process, expert by expert;
- :func:`shard_experts` and :func:`ep_forward`: expert parallelism. Every rank keeps the whole
  router and E/n experts (rank r: experts [r E/n, (r+1) E/n)); per forward one all-to-all of
  per-expert counts (E integers per rank), then the kept assignments' token rows go to the
  ranks that own their experts and the experts' outputs come back, with
  ``all_to_all_single_autograd`` and uneven splits (no padding to capacity, dropped
  assignments never sent), whose backward is the reverse exchange. The rows a rank routes to
  its own experts never enter the all-to-all (split 0 to itself): what the process group sees
  is what leaves the rank;
- :func:`traffic`: a pre-hook on a ``ProcessGroup`` (``register_pre_hook``) that logs every
  collective issued on it, forward and backward: its name, dtype and input bytes;
- :func:`train_router`: a few Adam steps on the load-balancing loss alone (the benchmark's
  "balanced" router).

This is Assignment 7's answer (students write routing, capacity, the dense layer and the
expert-parallel one), so the student edition leaves this module out, as it does the benchmark
(``NEVER`` in ``autograder/integrations/edition.py``). Torch is imported inside the functions:
importing this module is cheap.
"""
from __future__ import annotations

import contextlib
from fractions import Fraction

#: Pre-hook id of :func:`traffic` (the grader's counters use others).
HOOK_ID = 474747


# ----------------------------------------------------------------------------- routing

def route(logits, k: int):
    """(weights, experts), each (T, k): the k most probable experts per token in descending
    order (ties to the lower index), their probabilities renormalised over the k."""
    import torch

    num = logits.shape[-1]
    if not 1 <= k <= num:
        raise ValueError(f"k must be in [1, {num}], got {k}")
    probs = torch.softmax(logits, dim=-1)
    experts = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    top = probs.gather(1, experts)
    return top / top.sum(dim=-1, keepdim=True), experts


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor) -> int:
    """The smallest c >= 0 with c * num_experts >= capacity_factor * k * num_tokens, exactly."""
    factor = Fraction(str(capacity_factor))
    if num_tokens < 0 or num_experts < 1 or k < 1 or k > num_experts or factor <= 0:
        raise ValueError(f"bad capacity arguments {(num_tokens, num_experts, k, capacity_factor)}")
    need = factor * k * num_tokens
    return -(-need.numerator // (need.denominator * num_experts))


def keep_mask(experts, capacity: int):
    """(T, k) bool: an assignment is kept iff its expert has fewer than ``capacity`` kept ones
    before it, in the order: every first choice in token order, then every second choice..."""
    import torch

    t, k = experts.shape
    flat = experts.t().reshape(-1)  # choice-major order
    onehot = torch.nn.functional.one_hot(flat, int(flat.max()) + 1 if flat.numel() else 1)
    before = (onehot.cumsum(0) - onehot).gather(1, flat.unsqueeze(1)).squeeze(1)
    return (before < capacity).reshape(k, t).t()


def load_balancing_loss(logits, experts, num_experts: int):
    """num_experts * sum_i f_i P_i: f_i the share of assignments (before dropping) to expert i,
    P_i its mean probability; differentiable through P only."""
    import torch

    probs = torch.softmax(logits, dim=-1).mean(0)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    return num_experts * (counts / experts.numel() * probs).sum()


# ----------------------------------------------------------------------------- the layer

def make_moe(d: int, hidden: int, num_experts: int, k: int = 2, capacity_factor=1.25,
             seed: int = 0, dtype=None):
    """A seeded MoE layer: an ``nn.Module`` with ``router``, ``experts`` and the settings."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    moe = nn.Module()
    moe.router = nn.Linear(d, num_experts, bias=False)
    moe.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(),
                                              nn.Linear(hidden, d)) for _ in range(num_experts))
    moe.num_experts, moe.k, moe.capacity_factor, moe.group, moe.first = (
        num_experts, k, capacity_factor, None, 0)
    return moe.to(dtype) if dtype is not None else moe


def routed(moe, x):
    """What the router decides for tokens ``x``: logits, weights, experts (T, k), keep (T, k)."""
    logits = moe.router(x)
    weights, experts = route(logits, moe.k)
    cap = expert_capacity(x.shape[0], moe.num_experts, moe.k, moe.capacity_factor)
    return logits, weights, experts, keep_mask(experts, cap)


def dense_forward(moe, x):
    """(y, aux) on one process: each expert once, on all its kept tokens."""
    import torch

    logits, weights, experts, keep = routed(moe, x)
    y = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        tok, choice = torch.nonzero(keep & (experts == e), as_tuple=True)
        if tok.numel():
            y = y.index_add(0, tok, weights[tok, choice].unsqueeze(1) * expert(x[tok]))
    return y, load_balancing_loss(logits, experts, moe.num_experts)


def shard_experts(moe, group=None):
    """This rank's expert-parallel copy of ``moe``: the whole router, experts [r E/n, (r+1)
    E/n) (copies; ``moe`` untouched)."""
    import copy

    import torch.distributed as dist
    from torch import nn

    n = dist.get_world_size(group) if dist.is_initialized() else 1
    r = dist.get_rank(group) if dist.is_initialized() else 0
    if moe.num_experts % n:
        raise ValueError(f"{moe.num_experts} experts do not split over {n} ranks")
    per = moe.num_experts // n
    ep = nn.Module()
    ep.router = copy.deepcopy(moe.router)
    ep.experts = nn.ModuleList(copy.deepcopy(moe.experts[r * per + i]) for i in range(per))
    ep.num_experts, ep.k, ep.capacity_factor, ep.group, ep.first = (
        moe.num_experts, moe.k, moe.capacity_factor, group, r * per)
    return ep


def _a2a(x, out_splits, in_splits, group):
    """Differentiable uneven all-to-all along dim 0 (backward: the reverse exchange)."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits,
                                      dist.group.WORLD if group is None else group)


def _without(segments, r):
    import torch

    return torch.cat([s for j, s in enumerate(segments) if j != r])


def _exchange(rows, send, recv, r, group):
    """Rows split by ``send`` (per destination) go out; rows split by ``recv`` (per source)
    come in; the segment for this rank itself stays in memory. Returns the received rows in
    source order."""
    import torch

    segments = rows.split(send)
    if len(send) == 1:
        return rows
    send0, recv0 = [0 if j == r else s for j, s in enumerate(send)], \
        [0 if j == r else s for j, s in enumerate(recv)]
    got = list(_a2a(_without(segments, r), recv0, send0, group).split(recv0))
    got[r] = segments[r]
    return torch.cat(got)


def ep_forward(ep, x):
    """(y, aux) for this rank's tokens ``x`` (T_r, d), equal to the dense layer on them."""
    import torch
    import torch.distributed as dist

    group = ep.group
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    r = dist.get_rank(group) if dist.is_initialized() else 0
    per = len(ep.experts)
    logits, weights, experts, keep = routed(ep, x)
    tok, choice = torch.nonzero(keep, as_tuple=True)
    order = torch.sort(experts[tok, choice], stable=True).indices  # by expert, so by rank
    tok, choice = tok[order], choice[order]
    counts = torch.bincount(experts[tok, choice], minlength=ep.num_experts)
    if n > 1:  # how many rows each rank gets from me, per expert of its own
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
    else:
        recv_counts = counts
    recv_counts = recv_counts.view(n, per)  # [source, my local expert]
    send = counts.view(n, per).sum(1).tolist()
    recv = recv_counts.sum(1).tolist()
    received = _exchange(x[tok], send, recv, r, group)  # by source, then by my expert
    local = torch.arange(per).repeat(n).repeat_interleave(recv_counts.reshape(-1))
    perm = torch.sort(local, stable=True).indices  # by my expert, then by source
    grouped = received[perm].split(recv_counts.sum(0).tolist())
    outs = [expert(rows) for expert, rows in zip(ep.experts, grouped) if rows.shape[0]]
    out = torch.cat(outs) if outs else received[:0]
    out = out[torch.argsort(perm)]  # back to source order
    back = _exchange(out, recv, send, r, group)  # in the order the rows left
    y = torch.zeros_like(x).index_add(0, tok, weights[tok, choice].unsqueeze(1) * back)
    return y, load_balancing_loss(logits, experts, ep.num_experts)


# ----------------------------------------------------------------------------- accounting

def expected_rows(moe, chunks, rank: int, n: int) -> tuple[int, int]:
    """(rows rank ``rank`` sends to other ranks, rows it receives from them) in the dispatch,
    from the dense routing of every rank's tokens ``chunks``: a kept assignment of its tokens
    to another rank's expert goes out, one of another rank's tokens to its experts comes in;
    the combine sends back what came in, and backward repeats both."""
    import torch

    per = moe.num_experts // n
    out = into = 0
    with torch.no_grad():
        for s, x in enumerate(chunks):
            _, _, experts, keep = routed(moe, x)
            owner = experts[keep] // per
            if s == rank:
                out += int((owner != rank).sum())
            else:
                into += int((owner == rank).sum())
    return out, into


def loads(moe, chunks, n: int) -> dict:
    """Load over all ranks' tokens: routed assignments per expert (before capacity), kept rows
    per expert and per rank (after), and the share dropped."""
    import torch

    e = moe.num_experts
    routed_e, kept_e = torch.zeros(e), torch.zeros(e)
    with torch.no_grad():
        for x in chunks:
            _, _, experts, keep = routed(moe, x)
            routed_e += torch.bincount(experts.reshape(-1), minlength=e)
            kept_e += torch.bincount(experts[keep], minlength=e)
    kept_r = kept_e.view(n, -1).sum(1)
    return {"expert_routed": (routed_e.max() / routed_e.mean()).item(),
            "expert_kept": (kept_e.max() / kept_e.mean()).item(),
            "rank_kept": (kept_r.max() / kept_r.mean()).item(),
            "dropped": 1 - (kept_e.sum() / routed_e.sum()).item()}


@contextlib.contextmanager
def traffic(group=None):
    """While inside, every collective issued on ``group`` (None: the default group) is appended
    to the yielded list as (op name, dtype, input bytes): a pre-hook on the process group,
    which sees calls from forward and backward alike."""
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    log: list = []

    def hook(args):
        op = getattr(args.name, "name", str(args.name))
        tensors = list(args.input_tensors)
        log.append((op, str(tensors[0].dtype) if tensors else "-",
                    sum(t.numel() * t.element_size() for t in tensors)))

    pg.register_pre_hook(HOOK_ID, hook)
    try:
        yield log
    finally:
        pg.unregister_pre_hook(HOOK_ID)


def train_router(moe, x, steps: int = 100, lr: float = 1e-3) -> list[float]:
    """Adam on the router alone, with the load-balancing loss alone, on tokens ``x``; the
    losses before each step."""
    import torch

    opt = torch.optim.Adam(moe.router.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = moe.router(x)
        loss = load_balancing_loss(logits, route(logits, moe.k)[1], moe.num_experts)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses
