"""``python -m autograder.bench tp [--procs 2 4] [--hidden 256 512 ...] [--out DIR]``: what
tensor parallelism costs and saves on this machine, for Assignment 5 (lesson 13; ``make bench``
runs it).

One transformer-style MLP block, ``Linear(d, 4d), GELU, Linear(4d, d)``, forward and backward
on a global batch of ``--tokens`` rows whose input requires a gradient (as for a block inside a
stack), three ways:

- **dense**: the whole block and batch on one process, with one thread, and with n threads
  (torch's intra-op parallelism: the same cores as n processes, sharing memory, no messages);
- **TP** on n processes: torch's own tensor parallelism (``parallelize_module`` with
  ``ColwiseParallel`` for the first Linear and ``RowwiseParallel`` for the second on a 1-D
  ``init_device_mesh("cpu" or "cuda", (n,))``), every rank on the whole batch with 1/n of the
  weights: one all-reduce of a (tokens, d) activation forward, one backward;
- **DP** on the same n processes: every rank the whole block on tokens/n rows, then the
  gradients averaged with one all-reduce of all of them (as DDP does with a single bucket and no
  overlap with the backward).

TP and DP do the same arithmetic per rank (1/n of the dense block's). What differs is what
they send: TP ``2 x tokens x d`` elements per block per step, on the critical path (the next
layer waits for each all-reduce); DP ``8 d^2 + 5 d`` elements per step, once. Bytes are counted
from the calls themselves (a dispatch mode that sees every c10d operator, the backward's
included) as the bytes of the tensors handed to the collectives per rank and step; a ring
all-reduce moves about ``2 (n - 1) / n`` times that over each link. Times: median over
``--repeats`` steps, each from a barrier to a barrier, so a step lasts as long as its slowest
rank. It needs no solution (this is not A5's code) and prints a table and saves
``tp_vs_dp.png`` in ``--out``.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

HIDDEN = [256, 512, 1024, 2048]
TOKENS = 512


def make_block(d: int, seed: int = 0):
    """The dense MLP block, identical on every rank (same seed)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def comm_counter():
    """A dispatch mode that adds up, per c10d operator, calls and bytes of the tensors handed
    to it (functional collectives as DTensor uses them, and the in-place ones of
    ``torch.distributed``, forward and backward alike; not waits, barriers or the private
    helpers such as ``_wrap_tensor_autograd``). ``.calls`` and ``.bytes`` are dicts."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    import torch

    class CommBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict[str, int] = {}
            self.bytes: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            space = func.namespace
            name = func.name().split("::")[-1].split(".")[0]
            if (space in ("_c10d_functional", "c10d") and not name.startswith("_")
                    and not any(word in name for word in ("wait", "barrier"))):
                size = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor))
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + size
            return func(*args, **kwargs)

    return CommBytes()


def _steps(mode: str, d: int, tokens: int, rank: int, world: int, device):
    """A function running one forward+backward of ``mode`` on this rank."""
    import torch
    import torch.distributed as dist

    block = make_block(d).to(device)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(tokens, d, generator=g).to(device)
    if mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        block = parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = x_full
    else:
        x = x_full.tensor_split(world)[rank]
    params = [p for p in block.parameters()]

    def step():
        for p in params:
            p.grad = None
        inp = x.detach().requires_grad_()
        out = block(inp)
        out.float().pow(2).mean().backward()
        if mode == "dp" and world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
    return step, local


def rank_worker(rank, world, mode, hidden, tokens, warmup, repeats):
    """Every hidden size in turn on this rank: (d, median seconds, per-rank comm calls and bytes,
    parameters held by this rank)."""
    import time

    import torch
    import torch.distributed as dist
    from course.devices import synchronize
    from course.launch import device_for

    device = device_for(rank)
    rows = []
    for d in hidden:
        step, local_params = _steps(mode, d, tokens, rank, world, device)
        counter = comm_counter()
        with counter:
            step()
        for _ in range(warmup):
            step()
        times = []
        for _ in range(repeats):
            synchronize([device]); dist.barrier()
            start = time.perf_counter()
            step()
            synchronize([device]); dist.barrier()
            times.append(time.perf_counter() - start)
        rows.append({"hidden": d, "seconds": statistics.median(times),
                     "calls": sum(counter.calls.values()), "bytes": sum(counter.bytes.values()),
                     "params": local_params})
    return rows


def measure(procs: list[int], hidden: list[int], tokens: int, warmup: int, repeats: int,
            timeout: float = 600.0) -> list[dict]:
    """One row per (how, processes, hidden size), every rank's figures from rank 0's return
    (the steps end in a barrier, so rank 0's time is the slowest rank's)."""
    from course.launch import launch

    runs = [("dense", 1, 1)] + [run for n in procs
                                for run in (("dense", 1, n), ("tp", n, 1), ("dp", n, 1))]
    from course.launch import LaunchError

    rows = []
    for mode, n, threads in runs:
        how = f"{mode.upper()} x{n}" if mode != "dense" else f"dense {threads}t"
        try:
            result = launch(rank_worker, n, mode, hidden, tokens, warmup, repeats, quiet=True,
                            timeout=timeout, collective_timeout=120.0, threads=threads)
        except (LaunchError, TimeoutError) as e:  # a busy machine: keep the other runs
            print(f"{how}: no figures ({str(e).splitlines()[0]})", flush=True)
            continue
        print(f"{how}: done", flush=True)
        for row in result[0]:
            rows.append({"how": how, "mode": mode, "processes": n, "threads": threads, **row})
    return rows


def plot(rows: list[dict], out: Path, where: str, tokens: int) -> Path:
    from .common import pyplot, save

    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 3.8))
    styles = {"dense": ("black", ":"), "tp": ("tab:blue", "-"), "dp": ("tab:orange", "--")}
    markers = {1: "o", 2: "s", 4: "^", 8: "D"}
    for how in dict.fromkeys(r["how"] for r in rows):
        mine = [r for r in rows if r["how"] == how]
        colour, line = styles[mine[0]["mode"]]
        marker = markers.get(max(mine[0]["processes"], mine[0]["threads"]), "o")
        if mine[0]["mode"] == "dense":
            colour = "black" if mine[0]["threads"] == 1 else "gray"
        hs = [r["hidden"] for r in mine]
        left.plot(hs, [r["seconds"] * 1e3 for r in mine], color=colour, linestyle=line,
                  marker=marker, label=how)
        if mine[0]["mode"] != "dense":
            right.plot(hs, [r["bytes"] / 2**20 for r in mine], color=colour, linestyle=line,
                       marker=marker, label=how)
    for ax in (left, right):
        ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.set_xlabel("hidden size d")
        ax.legend(fontsize=8)
    left.set_ylabel("ms per forward+backward")
    left.set_title(f"MLP block d -> 4d -> d, {tokens} tokens\n({where})", fontsize=9)
    right.set_ylabel("MiB to collectives, per rank and step")
    right.set_title("TP: 2 x tokens x d, DP: all gradients\n(the same for 2 and 4 processes)",
                    fontsize=9)
    return save(fig, out / "tp_vs_dp.png")


def main(argv: list[str] | None = None) -> int:
    from .common import introduce, parser

    p = parser("tp", "Dense vs tensor-parallel (torch's parallelize_module) vs data-parallel "
                     "MLP block: forward+backward time and communicated bytes per hidden size.",
               repeats=7, out="the PNG plot")
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts (2 4)")
    p.add_argument("--hidden", type=int, nargs="+", default=HIDDEN, help="hidden sizes d")
    p.add_argument("--tokens", type=int, default=TOKENS,
                   help=f"rows of the global batch ({TOKENS})")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (600)")
    args = p.parse_args(argv)
    if any(args.tokens % n for n in args.procs):
        p.error("--tokens must divide by every process count (DP splits the batch evenly)")

    where = introduce(max(args.procs))
    rows = measure(args.procs, args.hidden, args.tokens, args.warmup, args.repeats, args.timeout)
    print(f"\nMLP block d -> 4d -> d, GELU, {args.tokens} tokens, float32, forward+backward "
          f"(median of {args.repeats} steps):")
    print(f"{'how':>8} {'d':>5} {'ms/step':>9} {'vs dense':>9} {'collectives':>11} "
          f"{'MiB sent/rank':>13} {'params/rank':>12}")
    dense = {r["hidden"]: r["seconds"] for r in rows if r["how"] == "dense 1t"}
    nan = float("nan")
    for r in rows:
        print(f"{r['how']:>8} {r['hidden']:>5} {r['seconds'] * 1e3:>9.2f} "
              f"{dense.get(r['hidden'], nan) / r['seconds']:>8.2f}x {r['calls']:>11} "
              f"{r['bytes'] / 2**20:>13.2f} {r['params']:>12,}")
    print(f"saved {plot(rows, Path(args.out), where, args.tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
