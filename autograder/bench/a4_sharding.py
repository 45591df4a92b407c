"""``python -m autograder.bench a4_sharding [--procs N] [--repeats R] [--out DIR]``: the figures
behind Assignment 4 (module 4: memory and sharding), measured on this machine.

1. **Memory per rank** of one model trained with AdamW (fp32) under DDP (ZeRO stage 0),
   ``ZeroRedundancyOptimizer`` (stage 1), FSDP2 ``fully_shard`` per layer (stage 3) and, when the
   reference solution ``solutions/a4_sharding`` is here, its ``ShardedOptimizer`` (stage 1) and
   ``ShardedLinear`` (stage 3): bytes of the parameters, gradients and optimizer state that each
   rank holds after a step, counted from the tensors, against the ZeRO paper's accounting
   (parameters 4 + gradients 4 + Adam 8 bytes per parameter, the sharded ones
   ``ceil(P / N)`` elements per rank). DDP's gradients are bucket views
   (``gradient_as_bucket_view=True``), so that its buckets add no copy.
2. **Step time** (forward, backward, gradients averaged) on a latency-bound model (many small
   parameters) with one all-reduce per parameter after backward, bucketed all-reduces after
   backward, and bucketed all-reduces launched during backward (overlap); DDP for comparison.

Why it is here and not in a lesson: it holds its own small bucketed all-reduce and the byte
accounting, which Assignment 4 asks students to write, so the student edition leaves this file
out (``autograder/integrations/edition.py``). Prints both tables and saves
``bench_memory.png`` in ``--out``. Other programs running on the machine take cores away from
the processes, and the step times with them.
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

ASSIGNMENT = "a4_sharding"
WIDTH, DEPTH, BATCH = 256, 4, 32               # memory model: 4 x (W -> 4W -> W) + head
SMALL_WIDTH, SMALL_DEPTH, SMALL_BATCH = 32, 48, 16  # latency-bound model: 97 small tensors
BUCKET_BYTES = 256 * 1024
#: method -> the ZeRO stage it implements
STAGES = {"DDP": 0, "ZeroRedundancyOptimizer": 1, "A4 ShardedOptimizer": 1,
          "A4 ShardedLinear": 3, "FSDP2 fully_shard": 3}


def build_model(width: int, depth: int, linear=None):
    """``depth`` x (Linear W->4W, GELU, Linear 4W->W, GELU) and a head to 10, seeded alike on
    every rank; ``linear`` replaces ``nn.Linear`` (A4's ShardedLinear)."""
    import torch
    from torch import nn

    linear = linear or nn.Linear
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Sequential(linear(width, 4 * width), nn.GELU(), linear(4 * width, width), nn.GELU())]
    return nn.Sequential(*layers, linear(width, 10))


def zero_bytes(num_params: int, world_size: int, stage: int) -> dict:
    """Per-rank bytes of fp32 Adam training by the ZeRO paper's accounting."""
    shard = math.ceil(num_params / world_size)
    return {"parameters": 4 * (shard if stage >= 3 else num_params),
            "gradients": 4 * (shard if stage >= 2 else num_params),
            "optimizer state": 8 * (shard if stage >= 1 else num_params)}


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(optimizer) -> int:
    return _local_bytes(t for s in optimizer.state.values() for t in s.values()
                        if hasattr(t, "dim") and t.dim() > 0)


def memory_rank(rank: int, world_size: int, method: str, a4_cells):
    """One AdamW step of the memory model under ``method``; this rank's bytes after it."""
    import torch
    from torch import nn

    ns = {}
    if method.startswith("A4"):
        from autograder.checking.reference import reference_namespace

        ns = reference_namespace(a4_cells)
    linear = ns["ShardedLinear"] if method == "A4 ShardedLinear" else None
    model = build_model(WIDTH, DEPTH, linear)
    owner = model
    if method in ("DDP", "ZeroRedundancyOptimizer"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        owner = DDP(model, gradient_as_bucket_view=True)
    if method == "FSDP2 fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in list(model)[:-1]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    if method == "ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
        inner = optimizer.optim
    elif method == "A4 ShardedOptimizer":
        optimizer = ns["ShardedOptimizer"](params, torch.optim.AdamW, lr=1e-3)
        inner = optimizer.optimizer
    else:
        optimizer = inner = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    nn.functional.cross_entropy(owner(x), y).backward()
    optimizer.step()
    grads = [p.grad for p in params]  # A4's ShardedOptimizer (stage 1) sets them to None
    return {"parameters": _local_bytes(params), "gradients": _local_bytes(grads),
            "optimizer state": _state_bytes(inner),
            "num_params": sum(p.numel() for p in build_model(WIDTH, DEPTH).parameters())}


def _buckets(params, bucket_bytes):
    """Buckets of parameter indices, last parameter first, each closed before it would exceed
    ``bucket_bytes`` (this bench's own rule)."""
    buckets, size = [[]], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def step_time_rank(rank: int, world_size: int, repeats: int):
    """Median seconds of forward + backward + averaged gradients, per way of averaging, and the
    largest gradient difference from per-parameter all-reduce."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(SMALL_WIDTH, SMALL_DEPTH)
    params = list(model.parameters())
    buckets = _buckets(params, BUCKET_BYTES)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(SMALL_BATCH, SMALL_WIDTH, generator=g)

    def reduce_flat(bucket, async_op=False):
        flat = torch.cat([params[i].grad.flatten() for i in bucket])
        return flat, dist.all_reduce(flat, async_op=async_op)

    def unflatten(bucket, flat):
        offset = 0
        for i in bucket:
            n = params[i].numel()
            params[i].grad.copy_(flat[offset:offset + n].view_as(params[i])).div_(world_size)
            offset += n

    def per_parameter():
        model(x).sum().backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)

    def bucketed():
        model(x).sum().backward()
        for bucket in buckets:
            flat, _ = reduce_flat(bucket)
            unflatten(bucket, flat)

    pending, launched, owner = {}, [], {i: b for b, bucket in enumerate(buckets) for i in bucket}

    def ready(param_index):
        pending[owner[param_index]] -= 1
        while len(launched) < len(buckets) and pending[len(launched)] == 0:
            launched.append(reduce_flat(buckets[len(launched)], async_op=True))

    hooks = []

    def overlapped():
        pending.update({b: len(bucket) for b, bucket in enumerate(buckets)})
        launched.clear()
        model(x).sum().backward()
        for bucket, (flat, work) in zip(buckets, launched):
            work.wait()
            unflatten(bucket, flat)

    ddp = DDP(build_model(SMALL_WIDTH, SMALL_DEPTH), bucket_cap_mb=BUCKET_BYTES / 2**20)

    def ddp_step():
        ddp(x).sum().backward()

    ways = {"per-parameter all-reduce": per_parameter, "bucketed, after backward": bucketed,
            "bucketed, overlapped": overlapped, "DDP (PyTorch)": ddp_step}
    seconds, grads = {name: [] for name in ways}, {}
    for i in range(repeats + 2):
        for name, step in ways.items():
            if name == "bucketed, overlapped":
                hooks = [p.register_post_accumulate_grad_hook(lambda p, i=k: ready(i))
                         for k, p in enumerate(params)]
            for p in list(params) + list(ddp.parameters()):
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
            for h in hooks:
                h.remove()
            hooks = []
            if name != "DDP (PyTorch)":
                grads[name] = [p.grad.clone() for p in params]
            else:
                grads[name] = [p.grad.clone() for p in ddp.parameters()]
    base = grads["per-parameter all-reduce"]
    return {"seconds": {name: ts[2:] for name, ts in seconds.items()},
            "difference": {name: max((a - b).abs().max().item() for a, b in zip(base, gs))
                           for name, gs in grads.items()},
            "buckets": len(buckets), "tensors": len(params)}


def plot(memory: dict, times: dict, out: Path, procs: int) -> Path:
    from .common import pyplot, save

    fig, (ax_mem, ax_time) = pyplot().subplots(1, 2, figsize=(12, 4))
    names = list(memory)
    for k, part in enumerate(("parameters", "gradients", "optimizer state")):
        bottoms = [sum(memory[n]["measured"][q] for q in ("parameters", "gradients", "optimizer state")[:k])
                   for n in names]
        ax_mem.bar(names, [memory[n]["measured"][part] / 2**20 for n in names], bottom=[b / 2**20 for b in bottoms],
                   color=f"C{k}", label=part)
    ax_mem.scatter(names, [sum(memory[n]["expected"].values()) / 2**20 for n in names], color="k",
                   marker="_", s=600, label="ZeRO accounting", zorder=3)
    ax_mem.set_ylabel("MiB on rank 0"); ax_mem.legend(fontsize=8)
    ax_mem.set_title(f"model states per rank, {procs} ranks, fp32 AdamW", fontsize=10)
    ax_mem.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax_time.bar(list(times), [t * 1e3 for t in times.values()], color="C4")
    ax_time.set_ylabel("ms per step (median, slowest rank)")
    ax_time.set_title(f"gradient averaging, {SMALL_DEPTH * 2 + 1} layers of width {SMALL_WIDTH}", fontsize=10)
    ax_time.tick_params(axis="x", labelrotation=20, labelsize=8)
    return save(fig, out / "bench_memory.png")


def main(argv=None) -> int:
    from .common import header, parser

    p = parser("a4_sharding", __doc__.split("\n\n")[0], repeats=10, out="bench_memory.png")
    p.add_argument("--procs", type=int, default=2, help="ranks (CPU processes on gloo)")
    args = p.parse_args(argv)

    from course.launch import launch

    from ..checking.reference import reference_cells

    header(f"{args.procs} CPU processes on gloo, 1 thread each")
    print()
    try:
        a4_cells = reference_cells(ASSIGNMENT)
    except KeyError:  # Assignment 4 is not registered in this copy yet
        a4_cells = None
    methods = [m for m in STAGES if a4_cells is not None or not m.startswith("A4")]
    if a4_cells is None:
        print(f"Assignment 4's reference (solutions/{ASSIGNMENT}) is not here: skipping A4's ShardedOptimizer and ShardedLinear\n")
    memory = {}
    for method in methods:
        ranks = launch(memory_rank, args.procs, method, a4_cells, backend="gloo", quiet=True)
        num_params = ranks[0].pop("num_params")
        memory[method] = {"measured": ranks[0], "expected": zero_bytes(num_params, args.procs, STAGES[method]),
                          "largest rank": max(sum(v for k, v in r.items() if k != "num_params") for r in ranks)}
    print(f"Model states on rank 0 of {args.procs}, model of {num_params:,} parameters, fp32 AdamW "
          f"(MiB; accounting in brackets):")
    print(f"{'method':>26} {'stage':>5} {'parameters':>18} {'gradients':>18} {'optimizer':>18} "
          f"{'total':>18} {'largest rank':>13}")
    for method, row in memory.items():
        cells = [f"{row['measured'][k] / 2**20:8.3f} ({row['expected'][k] / 2**20:7.3f})"
                 for k in ("parameters", "gradients", "optimizer state")]
        total = f"{sum(row['measured'].values()) / 2**20:8.3f} ({sum(row['expected'].values()) / 2**20:7.3f})"
        print(f"{method:>26} {STAGES[method]:>5} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} "
              f"{total:>18} {row['largest rank'] / 2**20:>13.3f}")
    print("(ZeroRedundancyOptimizer assigns whole parameters to ranks and FSDP2 pads each "
          "parameter's dim 0: both can differ a little from the flat accounting)\n")

    ranks = launch(step_time_rank, args.procs, args.repeats, backend="gloo", quiet=True, timeout=600)
    times = {name: statistics.median(max(ts) for ts in zip(*(r["seconds"][name] for r in ranks)))
             for name in ranks[0]["seconds"]}
    print(f"Step time, {ranks[0]['tensors']} parameter tensors in {ranks[0]['buckets']} buckets of at "
          f"most {BUCKET_BYTES // 1024} KiB (median of {args.repeats} steps, slowest rank):")
    for name, seconds in times.items():
        difference = max(r["difference"][name] for r in ranks)
        print(f"{name:>26}: {seconds * 1e3:8.2f} ms  (gradients differ from per-parameter by {difference:.1e})")
    print(f"\nsaved {plot(memory, times, Path(args.out), args.procs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
