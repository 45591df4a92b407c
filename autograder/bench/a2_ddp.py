"""``python -m autograder.bench a2_ddp [--max-procs N] [--ring-procs N] [--repeats R] [--out DIR]``:
what Assignment 2's reference solution achieves on this machine (``make bench`` runs it).

Measures, with the reference ``train_ddp`` and ``ring_allreduce`` of ``solutions/a2_ddp`` (so
it needs the instructor's repository) and the same ranks as the grader's speed checks
(:func:`~autograder.assignments.a2_ddp.ranks.train_server`, :func:`~autograder.assignments.a2_ddp.ranks.ring_server`
on a :class:`~autograder.checking.ranks.RankServer`, each command timed from this process):

1. **weak scaling** of ``train_ddp``: examples per second on 1..N processes (GPUs on NCCL where
   there are enough, else CPU processes on gloo with one thread each), every process training
   the same number of examples of the grader's small CNN per step; speedup = throughput on N /
   throughput on 1 (ideal: N);
2. **allreduce bandwidth** by message size, 1K to 16M float32 elements: the reference ring
   against ``dist.all_reduce``, called alternately on the same processes.

Prints both tables and saves ``weak_scaling.png`` and ``allreduce_bandwidth.png`` in ``--out``.
Use it to see what the speed checks can expect here: the grader passes a student at 80% of the
reference's figure measured in interleaved rounds of the same run. Everything else running on the machine takes
cores away from the processes, and the numbers with them.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ASSIGNMENT = "a2_ddp"
RING_SIZES = [4 ** k for k in range(5, 13)]  # 1K .. 16M elements


def reference_functions() -> dict:
    """The reference solution's cells, executed here; exits with a message without them."""
    from ..checking.reference import reference_cells, reference_namespace

    cells = reference_cells(ASSIGNMENT)
    if cells is None:
        sys.exit("the a2_ddp benchmark needs the reference solution in solutions/a2_ddp "
                 "(the instructor's repository), which this copy does not have.")
    return reference_namespace(cells)


def default_max_procs() -> int:
    from course.devices import gpu_count

    from .common import cores

    return gpu_count() if gpu_count() >= 2 else cores()


def weak_scaling(train_ddp, max_procs: int, *, repeats: int, seed: int = 0) -> list[dict]:
    """One row per process count: median seconds of a train_ddp call on every rank, examples
    per second, speedup over 1 process."""
    from ..assignments.a2_ddp.checks import scaling_args
    from ..assignments.a2_ddp.ranks import train_server
    from ..checking.ranks import RankServer
    from ..checking.speed import timed
    from course.devices import gpu_count

    backend = "nccl" if gpu_count() >= max_procs >= 2 else "gloo"
    rows = []
    for w in range(1, max_procs + 1):
        args = scaling_args(w, seed)
        server = RankServer(train_server, train_ddp, w, *args, backend=backend)
        try:
            server.run("warmup")
            seconds = statistics.median(timed(server.run, "train") for _ in range(repeats))
        finally:
            server.stop()
        _, _, n, epochs, _, _ = args
        rows.append({"processes": w, "seconds": seconds, "examples_per_s": n * epochs / seconds})
    for row in rows:
        row["speedup"] = row["examples_per_s"] / rows[0]["examples_per_s"]
    return rows


def ring_bandwidth(ring_allreduce, procs: int, sizes, *, warmup: int, repeats: int) -> list[dict]:
    """One row per size: median seconds of the ring and of dist.all_reduce (called in turn,
    each timed from here until every rank is done), and the ring's speed as a fraction of
    all_reduce's."""
    import torch

    from ..assignments.a2_ddp.ranks import ring_input, ring_server
    from ..checking.ranks import RankServer
    from ..checking.speed import timed

    server = RankServer(ring_server, ring_allreduce, procs, 0, list(sizes))
    times: dict[int, dict[str, list]] = {}
    try:
        for n in sizes:
            times[n] = {"ring": [], "all_reduce": []}
            for i in range(warmup + repeats):
                for name in times[n]:
                    seconds = timed(server.run, f"{name}-{n}")
                    if i >= warmup:
                        times[n][name].append(seconds)
    finally:
        ranks = server.stop()
    rows = []
    for k, n in enumerate(sizes):
        want = sum(ring_input(0, r, (n,), torch.float32) for r in range(procs))
        error = max((r["tensors"][k]["value"] - want).abs().max().item() if n else 0.0
                    for r in ranks)
        ring, builtin = (statistics.median(times[n][name]) for name in ("ring", "all_reduce"))
        rows.append({"elements": n, "ring_s": ring, "all_reduce_s": builtin,
                     "fraction": builtin / ring, "max_error": error})
    return rows


def plot(scaling: list[dict], bandwidth: list[dict], out: Path, where: str,
         ring_procs: int) -> list[Path]:
    from .common import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    procs = [r["processes"] for r in scaling]
    ax.plot(procs, [r["speedup"] for r in scaling], marker="o", label="reference train_ddp")
    ax.plot(procs, procs, linestyle="--", color="gray", label="ideal")
    ax.set_xlabel("processes"); ax.set_ylabel("speedup (examples/s vs 1 process)")
    ax.set_title(f"weak scaling ({where})", fontsize=9); ax.legend()
    paths = [save(fig, out / "weak_scaling.png")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = [r["elements"] for r in bandwidth]
    for key, label in (("ring_s", "reference ring_allreduce"), ("all_reduce_s", "dist.all_reduce")):
        ax.plot(sizes, [4 * r["elements"] / r[key] / 1e9 for r in bandwidth], marker="o", label=label)
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlabel("tensor size (float32 elements)"); ax.set_ylabel("GB/s (tensor bytes / time)")
    ax.set_title(f"allreduce on {ring_procs} processes ({where})", fontsize=9); ax.legend()
    return paths + [save(fig, out / "allreduce_bandwidth.png")]


def main(argv: list[str] | None = None) -> int:
    from .common import introduce, parser

    p = parser("a2_ddp", "What Assignment 2's reference solution achieves on this machine: weak "
                         "scaling of train_ddp and allreduce bandwidth by message size.", repeats=5)
    p.add_argument("--max-procs", type=int, default=None,
                   help="weak scaling on 1..N processes (default: GPUs if 2 or more, else CPU cores)")
    p.add_argument("--ring-procs", type=int, default=2, help="processes of the bandwidth runs (2)")
    args = p.parse_args(argv)

    ns = reference_functions()
    max_procs = args.max_procs or default_max_procs()
    where = introduce(max(max_procs, args.ring_procs))
    print()

    from ..assignments.a2_ddp.checks import SCALING_BATCH, SCALING_EPOCHS, SCALING_STEPS

    scaling = weak_scaling(ns["train_ddp"], max_procs, repeats=args.repeats)
    print(f"Weak scaling of train_ddp (the grader's small CNN, {SCALING_BATCH} examples per "
          f"process per step, {SCALING_STEPS * SCALING_EPOCHS} steps per call, median of "
          f"{args.repeats} calls):")
    print(f"{'processes':>9} {'s/call':>8} {'examples/s':>11} {'speedup':>8} {'ideal':>6}")
    for r in scaling:
        print(f"{r['processes']:>9} {r['seconds']:>8.3f} {r['examples_per_s']:>11,.0f} "
              f"{r['speedup']:>7.2f}x {r['processes']:>5}x")

    bandwidth = ring_bandwidth(ns["ring_allreduce"], args.ring_procs, RING_SIZES, warmup=2,
                               repeats=max(args.repeats, 5))
    print(f"\nAllreduce of float32 tensors on {args.ring_procs} processes (median of "
          f"{max(args.repeats, 5)} alternating calls):")
    print(f"{'elements':>11} {'ring ms':>9} {'all_reduce ms':>14} {'ring GB/s':>10} "
          f"{'all_reduce GB/s':>16} {'ring/all_reduce':>16}")
    for r in bandwidth:
        n = r["elements"]
        print(f"{n:>11,} {r['ring_s'] * 1e3:>9.2f} {r['all_reduce_s'] * 1e3:>14.2f} "
              f"{4 * n / r['ring_s'] / 1e9:>10.2f} {4 * n / r['all_reduce_s'] / 1e9:>16.2f} "
              f"{r['fraction']:>15.2f}x")
    worst = max(r["max_error"] for r in bandwidth)
    print(f"(largest difference between the ring's sums and all_reduce's: {worst:.2g})")

    for path in plot(scaling, bandwidth, Path(args.out), where, args.ring_procs):
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
