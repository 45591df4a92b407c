"""Train a small CNN with DistributedDataParallel: one process per GPU, started by torchrun.

Single machine, N processes (N GPUs, or N CPU processes standing in for GPUs)::

    torchrun --standalone --nproc-per-node N course/scripts/ddp_train.py [--epochs 2 ...]

Several machines: run the same command on every node with a rendezvous endpoint
(see ``multinode_torchrun.sh`` and ``slurm_ddp.sbatch`` next to this file)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id job42 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 course/scripts/ddp_train.py --data fashion --epochs 10

torchrun starts the processes and gives each of them its identity in the environment:
``RANK`` (0..WORLD_SIZE-1 over all nodes), ``WORLD_SIZE``, ``LOCAL_RANK`` (0..N-1 on this
node, which picks the GPU), ``LOCAL_WORLD_SIZE``, and ``MASTER_ADDR``/``MASTER_PORT`` (where
the process group's store lives). This script reads them, joins the process group with a
timeout, shards the data with ``DistributedSampler``, wraps the model in DDP, and lets rank 0
alone write the checkpoint. Defaults are quick (a small synthetic data set, 2 epochs), so the
script finishes in seconds on a laptop CPU; ``--data fashion --limit 0`` trains on all of
Fashion-MNIST.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

# Make `course` importable even where the repository is not pip-installed (e.g. on a cluster).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64,
                   help="examples per process per step (the global batch is this x WORLD_SIZE)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--limit", type=int, default=2048,
                   help="use only the first LIMIT training examples (0: all of them)")
    p.add_argument("--data", choices=["synthetic", "fashion"], default="synthetic",
                   help="synthetic: made-up images, no download; fashion: Fashion-MNIST "
                        "(rank 0 downloads it into COURSE_DATA or data/ first)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                   help="rank 0 writes ddp_train.pt here after every epoch")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --checkpoint-dir if there is one")
    p.add_argument("--timeout", type=float, default=120,
                   help="seconds a rank waits for the others (joining or in a collective) "
                        "before it fails instead of hanging")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def lenet() -> nn.Module:
    """LeNet for 1x28x28 images, as an nn.Module (DDP wraps modules, not parameter lists)."""
    return nn.Sequential(
        nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
        nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))


def setup(timeout_s: float) -> tuple[int, int, int, torch.device]:
    """Join the process group from torchrun's environment; return (rank, world, local, device).

    NCCL with one GPU per process when this node has a GPU for every local process; gloo on
    CPU processes otherwise (they stand in for GPUs: correct, but not faster).
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        # Share the cores: one process per core would otherwise start one thread per core each.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
        dist.init_process_group("gloo", timeout=timeout)
    return rank, world_size, local_rank, device


def datasets(kind: str, limit: int):
    """(train, test) datasets. Rank 0 downloads first; the others wait at a barrier, then read."""
    from course.data import fashion_mnist_datasets, synthetic_fashion_mnist

    if kind == "synthetic":
        # One draw, split in two: train and test must share the class prototypes.
        both = synthetic_fashion_mnist(7000, seed=0)
        if dist.get_rank() == 0:
            print("data: a SYNTHETIC stand-in for Fashion-MNIST (--data fashion for the real "
                  "one): the accuracy says nothing about real images", flush=True)
        train, test = Subset(both, range(6000)), Subset(both, range(6000, 7000))
    else:
        if dist.get_rank() == 0:
            train, test, _ = fashion_mnist_datasets()
        dist.barrier()  # the files are complete before anyone else opens them
        if dist.get_rank() != 0:
            train, test, _ = fashion_mnist_datasets(download=False)
    if limit:
        train = Subset(train, range(min(limit, len(train))))
        test = Subset(test, range(min(max(limit // 5, 1), len(test))))
    return train, test


def evaluate(model, loader, device) -> float:
    """Accuracy over the test set: each rank counts its shard, all_reduce adds them up.

    DistributedSampler pads the test set to a multiple of WORLD_SIZE, so up to WORLD_SIZE - 1
    examples may count twice; evaluate on rank 0 alone when you need the exact number.
    """
    model.eval()
    counts = torch.zeros(2, device=device)  # [correct, seen]
    with torch.no_grad():
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            counts[0] += (model(X).argmax(1) == y).sum()
            counts[1] += y.numel()
    dist.all_reduce(counts)  # a metric, not gradients: DDP does those itself
    model.train()
    return (counts[0] / counts[1]).item()


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world_size, local_rank, device = setup(args.timeout)
    what = (f"{torch.cuda.get_device_name(device)}" if device.type == "cuda"
            else "CPU process standing in for a GPU")
    print(f"rank {rank}/{world_size} (local rank {local_rank}) on {device}: {what}", flush=True)
    try:
        train(args, rank, world_size, device)
        gc.collect()   # DDP's reducer (it holds the group) lives in reference cycles: free it first
        dist.barrier() # and hang up together, or gloo may abort a rank that is still talking
    finally:
        dist.destroy_process_group()


def train(args, rank: int, world_size: int, device: torch.device) -> None:
    """The training loop, as on one GPU, plus sampler, DDP wrapper and rank-0 checkpoint."""
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    train_set, test_set = datasets(args.data, args.limit)
    # Each rank reads a different 1/world_size of the (shuffled) data set every epoch.
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    pin = device.type == "cuda"  # page-locked batches: the copies to the GPU can overlap
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, pin_memory=pin)
    test_loader = DataLoader(test_set, args.batch_size, sampler=test_sampler, pin_memory=pin)
    if rank == 0:
        print(f"{len(train_set)} training examples, batch {args.batch_size} per process "
              f"x {world_size} processes = {args.batch_size * world_size} per step", flush=True)

    model = lenet().to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    checkpoint = args.checkpoint_dir / "ddp_train.pt"
    start_epoch = 0
    if args.resume and checkpoint.exists():
        # Every rank reads the same file; map_location puts rank 0's tensors on *this* device.
        state = torch.load(checkpoint, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {checkpoint} after epoch {state['epoch']}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        start, total_loss, steps = time.perf_counter(), torch.zeros((), device=device), 0
        for X, y in train_loader:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(X), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over all ranks during backward
            optimizer.step()
            total_loss += loss.detach()
            steps += 1
        dist.all_reduce(total_loss)  # for the printout: the mean loss over all ranks
        accuracy = evaluate(model.module, test_loader, device)  # no DDP needed to evaluate
        seconds = time.perf_counter() - start
        if rank == 0:
            mean_loss = total_loss.item() / (steps * world_size)
            print(f"epoch {epoch}: loss {mean_loss:.3f}, test accuracy {accuracy:.3f}, "
                  f"{len(train_set) / seconds:.0f} examples/s over {world_size} process(es)",
                  flush=True)
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(),  # .module: without DDP's wrapper
                        "optimizer": optimizer.state_dict(), "epoch": epoch,
                        "world_size": world_size}, tmp)
            tmp.replace(checkpoint)  # never leave a half-written checkpoint behind
        dist.barrier()  # nobody starts the next epoch (or exits) before the file is written
    if rank == 0:
        print(f"checkpoint: {checkpoint}", flush=True)


if __name__ == "__main__":
    main()
