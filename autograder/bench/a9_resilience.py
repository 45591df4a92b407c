"""``python -m autograder.bench a9_resilience [--procs 1 2 4] [--widths 512 1024 2048]
[--restart-width 1024] [--repeats 3] [--out DIR]``: what checkpoints and restarts cost on this
machine, for module 9 (lesson 17, Assignment 9), with torch's own DCP
(``torch.distributed.checkpoint``), FSDP2's ``fully_shard`` and ``torchrun``. None of A9's
answers is in it (nothing here needs a half-written checkpoint to stay unread): the student
edition keeps it. Details and measured tables: docs/benchmarks.md.

**Save and load**: ``--depth`` ``Linear(w, w)`` layers ``fully_shard``-ed over n processes, with
AdamW after one step (``get_state_dict``: 12 bytes a parameter, split over the ranks). Per (w,
n), the slowest rank's median seconds, each from a barrier: ``dcp.save``; ``dcp.async_save``
(blocked: until it returns, the state staged; total: until written); ``dcp.load`` into another
model plus ``set_state_dict`` (then checked bit for bit); and each rank's ``.distcp`` bytes.

**Restart**: the model trains under ``torchrun --max-restarts 1``, saves at step 3; after step 4
(no save in flight: a kill during a save is A9's matter) the last rank is SIGKILLed; the agent
restarts every rank, which load the step-3 checkpoint and take a step. Seconds from the kill to
that step, in parts: to the first new process, to the process group, build + load, the step.

The ranks are CPU processes on gloo, one thread each, standing in for GPUs; the files go to the
local disk's page cache (nothing forces them to the device).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

PROCS = [1, 2, 4]
WIDTHS = [512, 1024, 2048]
DEPTH, BATCH, SAVE_AT = 4, 32, 3
RESTART_WIDTH = 1024
IMPORTED = time.time()  # a torchrun rank's start, where /proc cannot say


# ----------------------------------------------------------------------------- the ranks

def sharded_model(width: int, depth: int, world_size: int, seed: int = 0):
    """The model, FSDP2-sharded over every rank, and its AdamW after one step on random data."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer, width)
    return model, optimizer


def train_step(model, optimizer, width: int) -> None:
    """One step on this rank's fixed random batch (the data does not matter here)."""
    import torch
    import torch.distributed as dist

    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def local_tensors(state) -> list:
    """Every tensor of a (nested) state dict, as this rank holds it (a DTensor's local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in local_tensors(state[key])]
    if isinstance(state, DTensor):
        return [state.to_local()]
    return [state] if isinstance(state, torch.Tensor) else []


def save_load_rank(rank: int, world_size: int, widths: list[int], depth: int, folder: str,
                   warmup: int, repeats: int) -> list[dict]:
    """Every width in turn on this rank: its seconds per round and the bytes it wrote."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    async_group = dist.new_group(backend="gloo")  # DCP's thread talks on a group of its own
    rows = []
    for width in widths:
        model, optimizer = sharded_model(width, depth, world_size)
        saved = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        other, other_optimizer = sharded_model(width, depth, world_size, seed=1)
        times: dict[str, list[float]] = {k: [] for k in ("save", "blocked", "total", "load")}
        same, wrote = True, 0
        for i in range(warmup + repeats):
            base = Path(folder, f"w{width}-n{world_size}-{i}")
            dist.barrier()
            start = time.perf_counter()
            dcp.save(saved, checkpoint_id=base / "sync")
            took = {"save": time.perf_counter() - start}
            dist.barrier()
            start = time.perf_counter()
            future = dcp.async_save(saved, checkpoint_id=base / "async", process_group=async_group)
            took["blocked"] = time.perf_counter() - start
            future.result()
            took["total"] = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            state = dict(zip(("model", "optim"), get_state_dict(other, other_optimizer)))
            dcp.load(state, checkpoint_id=base / "async")
            set_state_dict(other, other_optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            took["load"] = time.perf_counter() - start
            got = dict(zip(("model", "optim"), get_state_dict(other, other_optimizer)))
            same &= all(a.equal(b) for a, b in zip(local_tensors(got), local_tensors(saved), strict=True))
            wrote = sum(f.stat().st_size for f in (base / "sync").glob(f"__{rank}_*.distcp"))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(base)
            if i >= warmup:
                for key, value in took.items():
                    times[key].append(value)
        rows.append({"width": width, "times": times, "same": same, "wrote": wrote,
                     "state": sum(t.numel() * t.element_size() for t in local_tensors(saved)),
                     "params": sum(p.numel() for p in model.parameters())})
    return rows


def restart_worker(folder: str, width: int, depth: int) -> int:
    """One rank of the job that ``torchrun`` runs (and runs again after the kill)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    began = _process_start()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    joined = time.time()
    model, optimizer = sharded_model(width, depth, world_size)
    where, step = Path(folder), 1
    if restarts == 0:
        (where / f"pid-{rank}").write_text(str(os.getpid()))
    else:
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)), step=0)
        dcp.load(state, checkpoint_id=where / "checkpoint")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        step, loaded = state["step"], time.time()
    deadline = time.time() + 600
    while time.time() < deadline:
        train_step(model, optimizer, width)
        step += 1
        if restarts:
            times = {"began": began, "joined": joined, "loaded": loaded, "stepped": time.time(),
                     "step": step}
            (where / f"restarted-{rank}.json").write_text(json.dumps(times))
            _leave(dist)
        if step == SAVE_AT:
            dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer)), step=step),
                     checkpoint_id=where / "checkpoint")
        if rank == 0:
            (where / "progress").write_text(str(step))
    return 3  # never killed


def _leave(dist) -> None:
    """End a restarted rank whose result is written: wait for the others, then skip the
    interpreter's teardown, where gloo's threads can abort a finished rank (SIGABRT, seen in CI
    on the 2-process restart), which torchrun would report as the job failing."""
    with contextlib.suppress(RuntimeError):
        dist.barrier()
    with contextlib.suppress(RuntimeError):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _process_start() -> float:
    """When this process started, wall clock, to 10 ms: Linux's start ticks since boot against
    /proc/uptime (psutil's create_time adds a boot time rounded to the second)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return IMPORTED


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


def _stop(job: subprocess.Popen) -> None:
    """Kill torchrun and its ranks (each in a session of its own), and reap them."""
    import psutil

    ranks = []
    with contextlib.suppress(psutil.Error):
        ranks = psutil.Process(job.pid).children(recursive=True)
    for proc in [*ranks, job]:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            proc.kill()
    job.wait()
    psutil.wait_procs(ranks, timeout=10)


def restart(n: int, width: int, depth: int = DEPTH, timeout: float = 300.0) -> dict:
    """Start the job on n processes, SIGKILL its last rank after step SAVE_AT + 1, and time the
    restarted job: seconds from the kill to each milestone (the slowest rank's)."""
    folder = Path(tempfile.mkdtemp(prefix="a9-restart-"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", "--max-restarts=1", "-m", "autograder.bench.a9_resilience",
               "--restart-worker", str(folder), "--width", str(width), "--depth", str(depth)]
    # the opt-out: with the rendezvous's store shared (the default), a restarted rank can read
    # the previous attempt's gloo addresses from it and fail to connect (seen on torch 2.14;
    # pytorch#135712)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    log = open(folder / "torchrun.log", "w+")
    job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    deadline, killed = time.time() + timeout, None
    try:
        while time.time() < deadline and job.poll() is None:
            if killed is None and _read_int(folder / "progress") > SAVE_AT:
                victim = _read_int(folder / f"pid-{n - 1}")
                if victim > 1:  # written before the step that progress counts
                    killed = time.time()
                    os.kill(victim, signal.SIGKILL)
            time.sleep(0.01)
        code = job.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        _stop(job)
        log.seek(0)
        tail = log.read().strip().splitlines()[-6:]
        log.close()
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("restarted-*.json"))]
    shutil.rmtree(folder, ignore_errors=True)
    if code != 0 or killed is None or len(ranks) != n:
        return {"processes": n, "width": width,
                "failed": f"exit {code}, killed: {killed is not None}, {len(ranks)}/{n} "
                          f"restarted; " + " / ".join(tail[-2:])}
    marks = [killed, min(r["began"] for r in ranks), max(r["joined"] for r in ranks),
             max(r["loaded"] for r in ranks), max(r["stepped"] for r in ranks)]
    parts = [b - a for a, b in zip(marks, marks[1:])]
    return {"processes": n, "width": width, "failed": None, "total": marks[-1] - killed,
            "parts": parts, "step": ranks[0]["step"]}


# ----------------------------------------------------------------------------- the driver

def measure(procs: list[int], widths: list[int], *, depth: int = DEPTH, warmup: int = 1,
            repeats: int = 3, timeout: float = 600.0, echo=print) -> list[dict]:
    """One row per (width, processes): medians over repeats of the slowest rank's seconds."""
    from course.launch import LaunchError, launch

    rows = []
    for n in procs:
        with tempfile.TemporaryDirectory(prefix="a9-dcp-") as folder:
            try:
                ranks = launch(save_load_rank, n, widths, depth, folder, warmup, repeats,
                               quiet=True, timeout=timeout, collective_timeout=max(120.0, timeout / 2))
            except (LaunchError, TimeoutError) as err:  # a busy machine: keep the others
                echo(f"x{n}: {str(err).splitlines()[0]}")
                rows += [{"width": w, "processes": n, "failed": str(err).splitlines()[0]}
                         for w in widths]
                continue
        for i, width in enumerate(widths):
            mine = [r[i] for r in ranks]
            row = {"width": width, "processes": n, "failed": None, "params": mine[0]["params"],
                   "wrote": max(r["wrote"] for r in mine), "state": max(r["state"] for r in mine),
                   "same": all(r["same"] for r in mine)}
            for key in mine[0]["times"]:
                row[key] = statistics.median(max(ts) for ts in zip(*(r["times"][key] for r in mine)))
            rows.append(row)
            echo(f"w={width} x{n}: save {row['save']:.3f} s, async blocked {row['blocked']:.3f} s")
    return rows


def _markdown(head: list[str], lines: list[list[str]]) -> str:
    lines = [[cell.replace("|", "/") for cell in cells] for cells in lines]
    rule = ["---" if i < 2 else "---:" for i in range(len(head))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [head, rule, *lines])


def table(rows: list[dict]) -> str:
    """The save/load rows as a markdown table (seconds; MiB per rank)."""
    head = ["width", "params", "n", "MiB/rank", "state/rank", "save s", "async blocked s",
            "async total s", "load s", "same"]
    lines = []
    for r in rows:
        first = [str(r["width"]), f"{r['params'] / 1e6:.2f}M" if "params" in r else "", str(r["processes"])]
        lines.append(first + ([f"failed: {r['failed']}"] + [""] * 6 if r["failed"] else [
            f"{r['wrote'] / 2**20:.2f}", f"{r['state'] / 2**20:.2f}", f"{r['save']:.3f}",
            f"{r['blocked']:.3f}", f"{r['total']:.3f}", f"{r['load']:.3f}",
            "yes" if r["same"] else "NO"]))
    return _markdown(head, lines)


def restart_table(rows: list[dict]) -> str:
    """The restart rows as a markdown table: the checkpoint's step the restarted job went on
    from, the seconds from the kill, and their four parts."""
    head = ["n", "width", "resumed at step", "kill to first step s", "to new process",
            "to process group", "build + load", "first step"]
    return _markdown(head, [
        [str(r["processes"]), str(r["width"])]
        + ([f"failed: {r['failed']}"] + [""] * 5 if r["failed"]
           else [str(r["step"] - 1)] + [f"{x:.2f}" for x in [r["total"], *r["parts"]]])
        for r in rows])


def main(argv: list[str] | None = None) -> int:
    from .common import OUT, introduce, parser

    p = parser("a9_resilience",
               "Checkpoints with torch.distributed.checkpoint on 1, 2, 4 processes: save and load "
               "time and bytes per rank, synchronous vs asynchronous; and the seconds from a "
               "killed rank to the restarted job's first step under torchrun.", repeats=3,
               out="the tables (a9_resilience.md)")
    p.add_argument("--procs", type=int, nargs="+", default=PROCS,
                   help=f"process counts ({' '.join(map(str, PROCS))})")
    p.add_argument("--widths", type=int, nargs="+", default=WIDTHS,
                   help=f"model widths w ({' '.join(map(str, WIDTHS))})")
    p.add_argument("--depth", type=int, default=DEPTH, help=f"Linear(w, w) layers ({DEPTH})")
    p.add_argument("--restart-width", type=int, default=RESTART_WIDTH,
                   help=f"the restarted job's width ({RESTART_WIDTH}; 0: no restart runs)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (600)")
    p.add_argument("--restart-worker", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restart_worker:  # torchrun runs this module as the restarted job's ranks
        return restart_worker(args.restart_worker, args.width, args.depth)

    introduce(max(args.procs))
    print(f"Checkpoints in {tempfile.gettempdir()} (local disk; the page cache takes most writes)")
    rows = measure(args.procs, args.widths, depth=args.depth, warmup=args.warmup,
                   repeats=args.repeats, timeout=args.timeout)
    text = (f"DCP of {args.depth} fully_shard-ed Linear(w, w) + AdamW state (median of "
            f"{args.repeats}, slowest rank; async blocked: until async_save returned, total: until "
            f"written; same: loaded == saved, bitwise):\n{table(rows)}\n")
    restarts = [restart(n, args.restart_width, args.depth, args.timeout)
                for n in (args.procs if args.restart_width else [])]
    if restarts:
        text += (f"\ntorchrun --max-restarts 1, w = {args.restart_width}, last rank SIGKILLed after "
                 f"step {SAVE_AT + 1}, restart from step {SAVE_AT} (seconds from the kill, one run "
                 f"each):\n{restart_table(restarts)}\n")
    print("\n" + text)
    out = Path(args.out or OUT)
    out.mkdir(parents=True, exist_ok=True)
    (out / "a9_resilience.md").write_text(text)
    print(f"saved {out / 'a9_resilience.md'}")
    return 0 if not any(r["failed"] for r in rows + restarts) else 1


if __name__ == "__main__":
    sys.exit(main())
