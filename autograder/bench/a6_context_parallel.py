"""``python -m autograder.bench a6_context_parallel [--procs 1 2 4] [--seq 1024 2048 ...]
[--max-gib G] [--causal] [--out DIR]``: what context parallelism costs and saves on this machine, for module 6 (lesson 14,
Assignment 6).

One attention layer, forward and backward (float32, batch 1, 8 heads of 64 by default; the
gradient of the output is random), on a sequence of ``--seq`` tokens, four ways:

- **full (SDPA)**: the whole sequence on one process with ``F.scaled_dot_product_attention``
  (on a CPU a fused, flash-style kernel: it never holds the S x S scores, so its memory grows
  with S, not S^2); the baseline one device would use;
- **full (matmul)**: the whole sequence on one process, ``softmax(q k^T / sqrt(d)) v`` with
  matmuls: it holds S x S scores per head (``4 S^2 heads`` bytes each), what every ring step
  below does on its L x L block (L = S / n). A configuration whose estimated memory passes
  ``--max-gib`` (summed over its processes) is skipped, and the table says so;
- **ring** on n processes: each rank holds a contiguous 1/n of q, k and v; K and V go around
  the ring with ``batch_isend_irecv`` (the next transfer starts before the current block is
  computed), each block's partial attention is merged into the running output by its
  log-sum-exp (online softmax); a ``torch.autograd.Function`` whose backward sends K and V
  around again with the accumulators of their gradients, which travel one hop more to come
  home. With ``--causal``, blocks that are wholly masked are skipped (contiguous layout, so the
  last rank does n blocks and the first one: the slowest rank sets the step time);
- **Ulysses** on n processes: two all-to-alls (here four calls, q, k, v then the output; the
  backward mirrors them) turn sequence shards into head shards (each rank heads
  [r H/n, (r+1) H/n) of the whole sequence), SDPA on those, and back. Needs heads % n == 0.

Its own ring attention and Ulysses (Assignment 6 asks students to write them) and the dispatch
mode that counts memory and bytes are in :mod:`autograder.bench.cp_attention`; the student
edition leaves both modules out (``autograder/integrations/edition.py``), like ``a4_sharding``.

What is measured, per configuration, in a fresh set of processes (``course.launch``):

- **time**: median over ``--repeats`` steps of the slowest rank's forward+backward, each step
  started from a barrier, after ``--warmup`` untimed steps and the (untimed) step whose memory
  and bytes are recorded; the fastest rank's median is kept too, to show imbalance;
- **peak memory per rank**: a ``TorchDispatchMode`` that follows every tensor storage that an
  operator makes during one step (backward included) until it is freed (a weak reference on
  the storage), on top of the step's inputs (q, k, v shards and the output's gradient): the
  largest sum of live bytes of torch tensors on that rank, the largest rank reported. It does
  not see gloo's or the allocator's own buffers, nor memory the allocator keeps cached: for
  that, the growth of the process's peak resident set (``VmHWM`` - ``VmRSS`` before the first
  step, from ``/proc/self/status``, Linux) is printed next to it; on GPUs also
  ``torch.cuda.max_memory_allocated`` over the step;
- **bytes sent per rank**, forward and backward, counted from the calls themselves (the same
  dispatch mode sees every ``c10d`` operator: ``send`` counts its tensor, ``alltoall_base_``
  the (n-1)/n of its input that leaves the rank), next to the formulas: ring forward
  ``(n-1)(|K|+|V|)``, backward ``(2n-1)(|K|+|V|)``; Ulysses ``4 (n-1)/n |q|`` each way (q, k,
  v and the output all have |q| elements per rank).
- **correctness**: before timing, every ring and Ulysses run checks itself against full
  attention on a small float64 problem on the same ranks (output and q/k/v gradients); the
  largest difference is printed.

Processes are CPU processes on gloo with one thread each (GPUs on NCCL where there is one per
process). On a CPU with fewer cores than processes they wait for each other's cores, so n
processes cannot be n times faster: what a CPU shows is the memory per rank (ring: 1/n of the
inputs and 1/n^2 of the scores; Ulysses: 1/n) and the bytes sent. Prints a table and saves
``context_parallel.png`` in ``--out``.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from .cp_attention import (full_attention, matmul_attention, recorder, reset_peak_rss,
                           ring_attention, rss_kib, ulysses_attention)

SEQ = [1024, 2048]  # 4096 and up: minutes on 2 cores (docs/benchmarks.md)
PROCS = [1, 2, 4]
HEADS, HEAD_DIM, BATCH = 8, 64, 1
MAX_GIB = 4.0
METHODS = ["full-sdpa", "full-matmul", "ring", "ulysses"]
LABELS = {"full-sdpa": "full (SDPA)", "full-matmul": "full (matmul)", "ring": "ring",
          "ulysses": "Ulysses"}


# ----------------------------------------------------------------------------- accounting

def expected_sent(method: str, n: int, elements: int, element_size: int = 4) -> tuple[int, int]:
    """Bytes a rank sends (forward, backward) by the formulas; ``elements`` = |q| = |k| = |v|
    of the local shard."""
    if n == 1 or method.startswith("full"):
        return 0, 0
    if method == "ring":
        return (n - 1) * 2 * elements * element_size, (2 * n - 1) * 2 * elements * element_size
    share = 4 * elements * element_size * (n - 1) // n
    return share, share


def estimate_bytes(method: str, n: int, seq: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
                   batch: int = BATCH) -> int:
    """A rough per-rank peak (float32), to skip what would not fit; the table shows the
    measured figure."""
    length = seq // n
    rows = batch * heads * length * head_dim * 4  # one (B, H, L, D) tensor
    if method == "full-matmul":
        return 12 * rows + 4 * batch * heads * seq * seq * 4
    if method == "ring":
        return 16 * rows + 3 * batch * heads * length * length * 4
    return 16 * rows


# ----------------------------------------------------------------------------- the ranks

def check_rank(rank: int, world_size: int, seq: int, causal: bool, heads: int = 4,
               head_dim: int = 8, batch: int = 2) -> dict:
    """Ring and Ulysses against full attention on the whole sequence, float64: the largest
    difference of the output and of the q, k, v gradients on this rank's shard."""
    import torch
    from course.launch import device_for

    device = device_for(rank)
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.float64)
            .to(device).requires_grad_() for _ in range(3)]
    dout = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.float64).to(device)
    out = full_attention(*full, causal=causal)
    out.backward(dout)
    want = [t.chunk(world_size, 2)[rank] for t in [out, *(x.grad for x in full)]]
    diffs = {}
    for name, fn in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        if name == "ulysses" and heads % world_size:
            continue
        shards = [x.detach().chunk(world_size, 2)[rank].clone().requires_grad_() for x in full]
        o = fn(*shards, causal=causal)
        o.backward(dout.chunk(world_size, 2)[rank])
        got = [o, *(x.grad for x in shards)]
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(got, want))
    return diffs


def rank_worker(rank: int, world_size: int, method: str, seqs: list[int], causal: bool,
                warmup: int, repeats: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
                batch: int = BATCH) -> dict:
    """Every sequence length of ``seqs`` in turn on this rank, for one method: per length its
    step times, peak bytes, bytes sent (forward, backward); for ring and Ulysses the float64
    check's largest difference."""
    import gc
    import time

    import torch
    import torch.distributed as dist
    from course.devices import synchronize
    from course.launch import device_for

    device = device_for(rank)
    check = None
    if method in ("ring", "ulysses"):
        check = check_rank(rank, world_size, 16 * world_size, causal)[method]
    fn = {"full-sdpa": full_attention, "full-matmul": matmul_attention, "ring": ring_attention,
          "ulysses": ulysses_attention}[method]
    rows = []
    for seq in seqs:
        g = torch.Generator().manual_seed(0)
        shape = (batch, heads, seq, head_dim)

        def shard(x):  # this rank's contiguous 1/n, in memory of its own; the whole is freed
            return x.chunk(world_size, 2)[rank].clone().to(device)

        q, k, v, dout = (shard(torch.randn(shape, generator=g)) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def step(record=None):
            for x in (q, k, v):
                x.grad = None
            out = fn(q, k, v, causal=causal)
            if record is not None:
                record["forward"] = rec.sent
            out.backward(dout)
            del out

        for _ in range(warmup):  # first calls load kernels and libraries: not the layer's memory
            rec = recorder([q, k, v, dout], world_size)  # its own first use too
            with rec:
                step({})
        for x in (q, k, v):
            x.grad = None
        gc.collect()
        synchronize([device])
        dist.barrier()
        rss_before = rss_kib() if reset_peak_rss() else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        rec, sent = recorder([q, k, v, dout], world_size), {}
        with rec:
            step(sent)
        synchronize([device])
        rss_after = rss_kib()
        growth = (rss_after[1] - rss_before[0]) * 1024 if rss_before and rss_after else None
        cuda_peak = (torch.cuda.max_memory_allocated(device) - base
                     + 4 * q.numel() * q.element_size() if device.type == "cuda" else None)
        mine = []
        for _ in range(repeats):
            synchronize([device])
            dist.barrier()
            start = time.perf_counter()
            step()
            synchronize([device])
            mine.append(time.perf_counter() - start)
        dist.barrier()
        rows.append({"seq": seq, "seconds": mine, "peak": rec.peak, "rss_growth": growth,
                     "cuda_peak": cuda_peak, "elements": q.numel(), "calls": rec.calls,
                     "sent": {"forward": sent["forward"], "backward": rec.sent - sent["forward"]}})
        del q, k, v, dout, rec
        gc.collect()
    return {"rows": rows, "check": check}


def measure(procs: list[int], seqs: list[int], methods: list[str], *, causal: bool = False,
            warmup: int = 1, repeats: int = 3, max_gib: float = MAX_GIB, heads: int = HEADS,
            head_dim: int = HEAD_DIM, batch: int = BATCH, timeout: float = 900.0,
            echo=print) -> list[dict]:
    """One row per (method, processes, sequence length); a row that was not run says why in
    ``skipped``. Full attention runs on one process only. One launch per (method, processes),
    every length in it."""
    from course.launch import LaunchError, launch

    rows = []
    for method in methods:
        for n in ([1] if method.startswith("full") else procs):
            mine = {}
            for seq in seqs:
                row = {"method": method, "processes": n, "seq": seq, "skipped": None}
                rows.append(row)
                need = estimate_bytes(method, n, seq, heads, head_dim, batch) * n
                if seq % n:
                    row["skipped"] = f"seq % {n} != 0"
                elif method == "ulysses" and heads % n:
                    row["skipped"] = f"heads % {n} != 0"
                elif need > max_gib * 2**30:
                    row["skipped"] = (f"needs ~{need / 2**30:.3g} GiB > --max-gib {max_gib:g}"
                                      f"{'' if n == 1 else ' (summed over its processes)'}")
                if row["skipped"]:
                    echo(f"{LABELS[method]} x{n} S={seq}: skipped ({row['skipped']})")
                else:
                    mine[seq] = row
            if not mine:
                continue
            try:
                ranks = launch(rank_worker, n, method, list(mine), causal, warmup, repeats,
                               heads, head_dim, batch, quiet=True, timeout=timeout,
                               collective_timeout=max(120.0, timeout / 2))
            except (LaunchError, TimeoutError) as e:  # a busy machine: keep the others
                for row in mine.values():
                    row["skipped"] = f"failed: {str(e).splitlines()[0]}"
                echo(f"{LABELS[method]} x{n}: {str(e).splitlines()[0]}")
                continue
            check = max((r["check"] for r in ranks if r["check"] is not None), default=None)
            for i, (seq, row) in enumerate(mine.items()):
                per_rank = [r["rows"][i] for r in ranks]
                slowest = [max(ts) for ts in zip(*(r["seconds"] for r in per_rank))]
                fastest = [min(ts) for ts in zip(*(r["seconds"] for r in per_rank))]
                growth = [r["rss_growth"] for r in per_rank if r["rss_growth"] is not None]
                cuda = [r["cuda_peak"] for r in per_rank if r["cuda_peak"] is not None]
                row.update(
                    seconds=statistics.median(slowest), fastest=statistics.median(fastest),
                    peak=max(r["peak"] for r in per_rank), rss_growth=max(growth, default=None),
                    cuda_peak=max(cuda, default=None),
                    sent_forward=max(r["sent"]["forward"] for r in per_rank),
                    sent_backward=max(r["sent"]["backward"] for r in per_rank),
                    calls=per_rank[0]["calls"],
                    expected=expected_sent(method, n, per_rank[0]["elements"]), check=check)
                echo(f"{LABELS[method]} x{n} S={seq}: {row['seconds'] * 1e3:.0f} ms, "
                     f"{row['peak'] / 2**20:.1f} MiB")
    return rows


# ----------------------------------------------------------------------------- output

def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    gpu = any(r.get("cuda_peak") for r in rows)
    head = (f"{'how':>14} {'n':>2} {'seq':>6} {'ms/step':>9} {'fastest':>8} {'peak MiB':>9} "
            f"{'RSS+ MiB':>9}" + (f" {'CUDA MiB':>9}" if gpu else "")
            + f" {'sent fwd/bwd MiB':>17} {'formula fwd/bwd':>16} {'check':>8}")
    lines = [head]
    for r in rows:
        first = f"{LABELS[r['method']]:>14} {r['processes']:>2} {r['seq']:>6}"
        if r["skipped"]:
            lines.append(f"{first}  skipped: {r['skipped']}")
            continue
        ef, eb = r["expected"]
        check = "-" if r["check"] is None else f"{r['check']:.0e}"
        lines.append(
            f"{first} {r['seconds'] * 1e3:>9.0f} {r['fastest'] * 1e3:>8.0f} {_mib(r['peak']):>9} "
            f"{_mib(r['rss_growth']):>9}" + (f" {_mib(r['cuda_peak']):>9}" if gpu else "")
            + f" {_mib(r['sent_forward']) + ' / ' + _mib(r['sent_backward']):>17}"
            f" {_mib(ef) + ' / ' + _mib(eb):>16} {check:>8}")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path, where: str, title: str) -> Path:
    from .common import pyplot, save

    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    colours = {"full-sdpa": "black", "full-matmul": "gray", "ring": "tab:blue",
               "ulysses": "tab:orange"}
    lines = {1: ":", 2: "--", 4: "-", 8: "-."}
    markers = {1: "o", 2: "s", 4: "^", 8: "D"}
    done = [r for r in rows if not r["skipped"]]
    for key in dict.fromkeys((r["method"], r["processes"]) for r in done):
        mine = [r for r in done if (r["method"], r["processes"]) == key]
        method, n = key
        style = dict(color=colours[method], linestyle=lines.get(n, "-"),
                     marker=markers.get(n, "o"),
                     label=LABELS[method] + ("" if method.startswith("full") else f" x{n}"))
        seqs = [r["seq"] for r in mine]
        left.plot(seqs, [r["seconds"] * 1e3 for r in mine], **style)
        right.plot(seqs, [r["peak"] / 2**20 for r in mine], **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.legend(fontsize=7)
    left.set_ylabel("ms per forward+backward (slowest rank)")
    left.set_title(f"{title}\n({where})", fontsize=9)
    right.set_ylabel("peak MiB of live tensors, largest rank")
    right.set_title("memory per rank: ring 1/n of the tokens, 1/n^2 of the scores",
                    fontsize=9)
    return save(fig, out / "context_parallel.png")


def main(argv: list[str] | None = None) -> int:
    from .common import introduce, parser

    p = parser("a6_context_parallel",
               "Full attention vs ring attention vs Ulysses: time, peak memory per rank and "
               "bytes sent, per sequence length and process count.", repeats=3,
               out="the PNG plot")
    p.add_argument("--procs", type=int, nargs="+", default=PROCS,
                   help=f"process counts for ring and Ulysses ({' '.join(map(str, PROCS))})")
    p.add_argument("--seq", type=int, nargs="+", default=SEQ,
                   help=f"sequence lengths ({' '.join(map(str, SEQ))}); each doubling makes a "
                        "step 4 times longer: 4096 adds about 3 minutes on 2 cores, 8192 and "
                        "16384 need a bigger --max-gib for full (matmul)")
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS, help="what to run")
    p.add_argument("--causal", action="store_true", help="causal attention (contiguous layout)")
    p.add_argument("--heads", type=int, default=HEADS, help=f"heads ({HEADS})")
    p.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"head_dim ({HEAD_DIM})")
    p.add_argument("--max-gib", type=float, default=MAX_GIB,
                   help=f"skip a configuration estimated to need more, summed over its "
                        f"processes ({MAX_GIB:g})")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the recorded one (1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch (900)")
    args = p.parse_args(argv)

    where = introduce(max(args.procs))
    rows = measure(args.procs, args.seq, args.methods, causal=args.causal, warmup=args.warmup,
                   repeats=args.repeats, max_gib=args.max_gib, heads=args.heads,
                   head_dim=args.head_dim, timeout=args.timeout)
    title = (f"one {'causal ' if args.causal else ''}attention layer, batch {BATCH}, "
             f"{args.heads} heads x {args.head_dim}, float32, forward+backward")
    print(f"\n{title} (median of {args.repeats} steps; ms/step: slowest rank, fastest: the "
          f"fastest rank; peak: live tensor bytes, largest rank; RSS+: growth of its peak resident "
          f"set; sent: bytes per rank, counted; formula: ring (n-1)(|K|+|V|) / (2n-1)(|K|+|V|), "
          f"Ulysses 4(n-1)/n |q| each way; check: largest difference from full attention, "
          f"float64):")
    print(table(rows))
    print(f"saved {plot(rows, Path(args.out), where, title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
