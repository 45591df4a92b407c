"""``python -m autograder.bench a7_expert_parallel [--procs 1 2 4] [--experts 4 8 16]
[--tokens T] [--skew S] [--capacity C] [--out DIR]``: what expert parallelism costs on this machine, and how
the router's balance sets it, for module 7 (lesson 15, Assignment 7).

One mixture-of-experts layer (float32; d = 256, experts Linear(d, 512), GELU, Linear(512, d);
top-2 routing, capacity factor ``--capacity`` 1.25; the gradient of the output is random, plus 0.01 times the
load-balancing loss), forward and backward (the tokens' gradient included, as for a layer
inside a model), on ``--tokens`` tokens per process (the processes
are data-parallel too: each routes its own tokens, so the work per rank stays the same as n
grows), for E = ``--experts`` experts on n = ``--procs`` processes (E % n == 0): rank r keeps
the whole router and experts [r E/n, (r+1) E/n). Per forward one all-to-all of per-expert counts
(E integers a rank), then one of token rows to the experts' ranks and one back (uneven splits:
one row per kept assignment, no padding to capacity, dropped assignments never sent; the rows
a rank routes to its own experts stay in memory); the backward is the two token exchanges in
reverse. The layer is :mod:`autograder.bench.moe_dispatch` (Assignment 7's answer, so the
student edition leaves both modules out, ``autograder/integrations/edition.py``).

Two routers per E, both on the same tokens. The tokens are ``N(0, I) + m`` with one shared
mean ``m`` of norm ``--skew * sqrt(d)`` (1: as long as a token's noise), as hidden states are
not centred:

- **random**: the router as initialised (``nn.Linear``'s uniform init), untrained: its rows
  that happen to point along ``m`` win for most tokens, so a few experts get most tokens (with
  ``--skew 0`` it is near balanced);
- **balanced**: that router after 100 Adam steps (lr 1e-3) on the load-balancing loss alone
  (Switch Transformer eq. 4), on 4096 other tokens from the same distribution. It is trained for
  balance only, not for a task: it shows what the balancing loss does to the load, no more.

What is measured, per (router, E, n), in one fresh set of processes per n (``course.launch``):

- **time**: median over ``--repeats`` steps of the slowest rank's forward+backward, each step
  started from a barrier, after ``--warmup`` untimed steps and the (untimed) step whose bytes
  are recorded; the fastest rank's median is kept too;
- **load**: over every rank's tokens, the most-loaded expert's routed assignments (before
  capacity) / the mean, the most-loaded rank's kept rows (what its experts compute) / the mean,
  and the share of assignments dropped by the capacity;
- **bytes sent per rank**, forward and backward, counted at the process group: a pre-hook
  (``ProcessGroup.register_pre_hook``) logs every collective issued on it with its input bytes;
  the float32 all-to-alls' inputs are the rows that leave the rank (the count exchange, int64,
  is counted apart as a call). Next to them the formula: every kept assignment's row of d
  elements goes out and comes back, minus what stays local: forward = backward = 4 d (rows of
  this rank's tokens kept for another rank's experts + rows of other ranks' tokens kept for
  this rank's experts), from the dense routing of every rank's tokens;
- **correctness**: before timing, each n checks the expert-parallel layer against the dense one
  on a small float64 problem (output, loss, gradients of the tokens, the router and every
  expert, summed over ranks for an expert): the largest difference.

Processes are CPU processes on gloo with one thread each (GPUs on NCCL where there is one per
process). On fewer cores than processes they wait for each other's cores. Prints a table and
saves ``expert_parallel.png`` in ``--out``.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from .moe_dispatch import (dense_forward, ep_forward, expected_rows, loads, make_moe,
                           shard_experts, traffic, train_router)

PROCS = [1, 2, 4]
EXPERTS = [4, 8, 16]
TOKENS, D_MODEL, HIDDEN, K, CAPACITY = 512, 256, 512, 2, 1.25
SKEW, AUX = 1.0, 0.01
ROUTERS = ["random", "balanced"]


# ----------------------------------------------------------------------------- the ranks

def check_rank(rank: int, world_size: int, experts: int = 8, d: int = 6, hidden: int = 10,
               capacity_factor=1.0) -> float:
    """The expert-parallel layer against the dense one, float64, on uneven token counts: the
    largest difference of y, aux and the gradients (tokens, router; each local expert's against
    the sum over ranks of the dense layer's)."""
    import torch

    moe = make_moe(d, hidden, experts, K, capacity_factor, seed=1, dtype=torch.float64)
    dense = make_moe(d, hidden, experts, K, capacity_factor, seed=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(9 + s, d, generator=g, dtype=torch.float64) for s in range(world_size)]
    gs = [torch.randn(9 + s, d, generator=g, dtype=torch.float64) for s in range(world_size)]
    for s in range(world_size):  # experts' gradients add up over the chunks
        x = xs[s].clone().requires_grad_()
        dense.router.weight.grad = None
        y, aux = dense_forward(dense, x)
        ((y * gs[s]).sum() + 0.3 * aux).backward()
        if s == rank:
            want = [y.detach(), aux.detach(), x.grad, dense.router.weight.grad.clone()]
    ep = shard_experts(moe)
    x = xs[rank].clone().requires_grad_()
    y, aux = ep_forward(ep, x)
    ((y * gs[rank]).sum() + 0.3 * aux).backward()
    diffs = [(a - b).abs().max().item()
             for a, b in zip([y, aux, x.grad, ep.router.weight.grad], want)]
    for i, expert in enumerate(ep.experts):
        for p, q in zip(expert.parameters(), dense.experts[ep.first + i].parameters()):
            diffs.append(p.grad.abs().max().item() if q.grad is None and p.grad is not None
                         else 0.0 if q.grad is None else (p.grad - q.grad).abs().max().item())
    return max(diffs)


def tokens(world_size: int, count: int, d: int, skew: float, seed: int = 0):
    """Every rank's tokens (a list of n (count, d) tensors) and 4096 more to train a router on,
    all ``N(0, I) + m`` with one shared mean m of norm skew * sqrt(d)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=g)
    mean = mean / mean.norm() * skew * d ** 0.5
    chunks = [torch.randn(count, d, generator=g) + mean for _ in range(world_size)]
    return chunks, torch.randn(4096, d, generator=g) + mean


def rank_worker(rank: int, world_size: int, experts: list[int], routers: list[str], count: int,
                skew: float, warmup: int, repeats: int, d: int = D_MODEL, hidden: int = HIDDEN,
                capacity_factor=CAPACITY) -> dict:
    """Every (E, router) in turn on this rank: step times, bytes counted and by the formula,
    collectives per step, the load; and the float64 check's largest difference."""
    import time

    import torch
    import torch.distributed as dist
    from course.devices import synchronize
    from course.launch import device_for

    device = device_for(rank)
    check = check_rank(rank, world_size, experts=max(8, world_size))
    chunks, train = tokens(world_size, count, d, skew)
    rows = []
    for e in experts:
        for router in routers:
            moe = make_moe(d, hidden, e, K, capacity_factor, seed=e)
            if router == "balanced":
                train_router(moe, train)
            out_rows, in_rows = expected_rows(moe, chunks, rank, world_size)
            load = loads(moe, chunks, world_size)
            ep = shard_experts(moe.requires_grad_()).to(device)
            x = chunks[rank].to(device).requires_grad_()  # as from the layer below
            dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).to(device)

            def step(mark=None):
                ep.zero_grad(set_to_none=True)
                x.grad = None
                y, aux = ep_forward(ep, x)
                if mark is not None:
                    mark.append(len(log))
                ((y * dy).sum() + AUX * aux).backward()

            log: list = []
            for _ in range(warmup):
                step()
            synchronize([device])
            dist.barrier()
            mark: list = []
            with traffic() as log:
                step(mark)
            synchronize([device])
            fwd, bwd = log[:mark[0]], log[mark[0]:]

            def rows_bytes(part):
                return sum(b for op, dtype, b in part if op == "ALLTOALL" and "float" in dtype)

            mine = []
            for _ in range(repeats):
                synchronize([device])
                dist.barrier()
                start = time.perf_counter()
                step()
                synchronize([device])
                mine.append(time.perf_counter() - start)
            dist.barrier()
            per_row = d * x.element_size()
            rows.append({"experts": e, "router": router, "seconds": mine, "load": load,
                         "sent": (rows_bytes(fwd), rows_bytes(bwd)),
                         "expected": ((out_rows + in_rows) * per_row,) * 2,
                         "calls": ([op for op, _, _ in fwd], [op for op, _, _ in bwd])})
    return {"rows": rows, "check": check}


def measure(procs: list[int], experts: list[int], routers: list[str] = ROUTERS, *,
            count: int = TOKENS, skew: float = SKEW, warmup: int = 1, repeats: int = 3,
            d: int = D_MODEL, hidden: int = HIDDEN, capacity_factor=CAPACITY,
            timeout: float = 900.0, echo=print) -> list[dict]:
    """One row per (router, E, processes); a row that was not run says why in ``skipped``.
    One launch per process count, every E and router in it."""
    from course.launch import LaunchError, launch

    rows = []
    for n in procs:
        mine = {}
        for e in experts:
            for router in routers:
                row = {"router": router, "experts": e, "processes": n, "skipped": None}
                rows.append(row)
                if e % n:
                    row["skipped"] = f"{e} experts % {n} != 0"
                    echo(f"{router} E={e} x{n}: skipped ({row['skipped']})")
                else:
                    mine[e, router] = row
        if not mine:
            continue
        es = list(dict.fromkeys(e for e, _ in mine))
        try:
            ranks = launch(rank_worker, n, es, routers, count, skew, warmup, repeats, d, hidden,
                           capacity_factor, quiet=True, timeout=timeout, collective_timeout=max(120.0, timeout / 2))
        except (LaunchError, TimeoutError) as err:  # a busy machine: keep the others
            for row in mine.values():
                row["skipped"] = f"failed: {str(err).splitlines()[0]}"
            echo(f"x{n}: {str(err).splitlines()[0]}")
            continue
        check = max(r["check"] for r in ranks)
        for i, got in enumerate(ranks[0]["rows"]):
            row = mine[got["experts"], got["router"]]
            per_rank = [r["rows"][i] for r in ranks]
            slowest = [max(ts) for ts in zip(*(r["seconds"] for r in per_rank))]
            fastest = [min(ts) for ts in zip(*(r["seconds"] for r in per_rank))]
            row.update(seconds=statistics.median(slowest), fastest=statistics.median(fastest),
                       load=got["load"], check=check, calls=got["calls"],
                       sent_forward=max(r["sent"][0] for r in per_rank),
                       sent_backward=max(r["sent"][1] for r in per_rank),
                       expected=(max(r["expected"][0] for r in per_rank),
                                 max(r["expected"][1] for r in per_rank)),
                       exact=all(r["sent"] == r["expected"] for r in per_rank))
            echo(f"{row['router']} E={row['experts']} x{n}: {row['seconds'] * 1e3:.0f} ms, "
                 f"rank load {row['load']['rank_kept']:.2f}")
    return rows


# ----------------------------------------------------------------------------- output

def _kib(x) -> str:
    return f"{x / 1024:.0f}"


def table(rows: list[dict]) -> str:
    head = (f"{'router':>8} {'E':>3} {'n':>2} {'ms/step':>8} {'fastest':>8} {'expert':>7} "
            f"{'rank':>5} {'dropped':>8} {'sent fwd/bwd KiB':>17} {'formula':>13} "
            f"{'a2a fwd/bwd':>11} {'check':>6}")
    lines = [head]
    for r in rows:
        first = f"{r['router']:>8} {r['experts']:>3} {r['processes']:>2}"
        if r["skipped"]:
            lines.append(f"{first}  skipped: {r['skipped']}")
            continue
        load, (ef, eb) = r["load"], r["expected"]
        calls = "/".join(str(sum(op == "ALLTOALL" for op in part)) for part in r["calls"])
        others = sorted({op for part in r["calls"] for op in part} - {"ALLTOALL"})
        lines.append(
            f"{first} {r['seconds'] * 1e3:>8.1f} {r['fastest'] * 1e3:>8.1f} "
            f"{load['expert_routed']:>7.2f} {load['rank_kept']:>5.2f} "
            f"{load['dropped'] * 100:>7.1f}% "
            f"{_kib(r['sent_forward']) + ' / ' + _kib(r['sent_backward']):>17} "
            f"{_kib(ef) + ' / ' + _kib(eb):>13} {calls + (' +' + ','.join(others) if others else ''):>11} "
            f"{r['check']:>6.0e}" + ("" if r["exact"] else "  (counted != formula)"))
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, where: str, title: str) -> Path:
    from .common import pyplot, save

    fig, (left, middle, right) = pyplot().subplots(1, 3, figsize=(14, 4))
    colours = {"random": "tab:red", "balanced": "tab:green"}
    lines = {1: ":", 2: "--", 4: "-", 8: "-."}
    markers = {1: "o", 2: "s", 4: "^", 8: "D"}
    done = [r for r in rows if not r["skipped"]]
    for key in dict.fromkeys((r["router"], r["processes"]) for r in done):
        mine = [r for r in done if (r["router"], r["processes"]) == key]
        router, n = key
        style = dict(color=colours.get(router, "gray"), linestyle=lines.get(n, "-"),
                     marker=markers.get(n, "o"), label=f"{router} x{n}")
        es = [r["experts"] for r in mine]
        left.plot(es, [r["seconds"] * 1e3 for r in mine], **style)
        if n > 1:
            middle.plot(es, [r["load"]["rank_kept"] for r in mine], **style)
            right.plot(es, [r["sent_forward"] / 1024 for r in mine], **style)
            right.plot(es, [r["expected"][0] / 1024 for r in mine], color=style["color"],
                       linestyle="none", marker="x", markersize=9)
    for router in dict.fromkeys(r["router"] for r in done):  # the same on any n
        mine = {r["experts"]: r["load"]["expert_routed"] for r in done if r["router"] == router}
        middle.plot(list(mine), list(mine.values()), color=colours.get(router, "gray"),
                    linestyle="none", marker="*", markersize=10,
                    label=f"{router}: per expert, before capacity")
    for ax in (left, middle, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts E")
        ax.legend(fontsize=7)
    left.set_ylabel("ms per forward+backward (slowest rank)")
    left.set_title("time (fewer rows kept: less to compute)", fontsize=9)
    fig.suptitle(f"{title} ({where})", fontsize=9)
    middle.set_ylabel("max / mean")
    middle.set_title("load: kept rows per rank (lines), routed per expert (stars)", fontsize=9)
    right.set_ylabel("KiB sent per rank, forward (largest rank)")
    right.set_title("bytes: counted at the process group (lines), formula (x)", fontsize=9)
    return save(fig, out / "expert_parallel.png")


def main(argv: list[str] | None = None) -> int:
    from .common import introduce, parser

    p = parser("a7_expert_parallel",
               "A mixture-of-experts layer, expert-parallel over 1, 2, 4 processes: time, bytes "
               "sent per rank and load imbalance, per number of experts, with an untrained and "
               "a balanced router.", repeats=3, out="the PNG plot")
    p.add_argument("--procs", type=int, nargs="+", default=PROCS,
                   help=f"process counts ({' '.join(map(str, PROCS))})")
    p.add_argument("--experts", type=int, nargs="+", default=EXPERTS,
                   help=f"numbers of experts ({' '.join(map(str, EXPERTS))})")
    p.add_argument("--tokens", type=int, default=TOKENS, help=f"tokens per process ({TOKENS})")
    p.add_argument("--skew", type=float, default=SKEW,
                   help=f"norm of the tokens' shared mean / sqrt(d) ({SKEW:g}; 0: centred)")
    p.add_argument("--capacity", type=float, default=CAPACITY,
                   help=f"capacity factor ({CAPACITY:g}; 8 or more: nothing is dropped, the "
                        "busiest rank computes every row routed to it)")
    p.add_argument("--routers", nargs="+", default=ROUTERS, choices=ROUTERS, help="which routers")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the recorded one (1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch (900)")
    args = p.parse_args(argv)

    where = introduce(max(args.procs))
    rows = measure(args.procs, args.experts, args.routers, count=args.tokens, skew=args.skew,
                   warmup=args.warmup, repeats=args.repeats,
                   capacity_factor=args.capacity, timeout=args.timeout)
    title = (f"one MoE layer, {args.tokens} tokens/process, d {D_MODEL}, hidden {HIDDEN}, "
             f"top-{K}, capacity {args.capacity:g}, float32, fwd+bwd")
    print(f"\n{title} (median of {args.repeats} steps; ms/step: slowest rank, fastest: the "
          f"fastest rank; expert: routed assignments of the busiest expert / mean, before "
          f"capacity; rank: kept rows of the busiest rank / mean; dropped: by the capacity; "
          f"sent: bytes per rank counted at the process group, largest rank; formula: 4 d x "
          f"(kept rows leaving + arriving) each way; a2a: all-to-alls per forward/backward; "
          f"check: largest difference from the dense layer, float64):")
    print(table(rows))
    print(f"saved {plot(rows, Path(args.out), where, title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
