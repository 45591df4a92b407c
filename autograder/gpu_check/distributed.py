"""The multi-process parts of ``make gpu-check``: Assignment 2's reference functions on an NCCL
process group, ``course/scripts/ddp_train.py`` under torchrun with NCCL, ranks of
``course.launch`` that use CUDA, and the ring's and ``dist.all_reduce``'s bandwidth.

Assignment 2's functions come from the reference notebook (``solutions/a2_ddp/ddp.ipynb``):
its set-up and answer cells are executed here, in a namespace that no rank can import, so
``course.launch`` sends the functions to the ranks by value, as it does from a notebook. The
grader is not involved: its A2 checks choose NCCL only with two GPUs or more.
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ..registry import REPO

A2_SOLUTION = REPO / "solutions" / "a2_ddp" / "ddp.ipynb"
A2_FUNCTIONS = ("average_gradients", "ring_allreduce", "make_dataloader", "train_ddp")
BANDWIDTH_SIZES = [4 ** k for k in range(5, 13)]  # 1K .. 16M float32 elements


def a2_reference_functions(path: Path = A2_SOLUTION) -> dict:
    """Execute the reference notebook's set-up and answer cells; return its four functions."""
    nb = json.loads(path.read_text())
    ns: dict = {"__name__": "__a2_reference__"}
    with contextlib.redirect_stdout(io.StringIO()):  # the set-up cell prints the hardware
        for cell in nb["cells"]:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell["cell_type"] == "code" and (meta.get("grade_id") == "setup" or meta.get("solution")):
                exec(compile("".join(cell["source"]), f"<{path.name} {meta['grade_id']}>", "exec"), ns)
    return {name: ns[name] for name in A2_FUNCTIONS}


def nccl_a2(section, gpus: int) -> None:
    """A2's functions on an NCCL group of one GPU (world size 1) and, with 2+ GPUs, of all."""
    from course.launch import launch

    from . import ranks

    fns = a2_reference_functions()
    for world in sorted({1, gpus}):
        try:
            result = launch(ranks.rank_a2_checks, world, fns,
                            backend="nccl", timeout=300, collective_timeout=60, quiet=True)
        except Exception as exc:
            section.add(f"NCCL, world size {world}", "failed", f"{type(exc).__name__}: {str(exc)[-800:]}")
            continue
        for check in result[0]:
            verdicts = [r[check] for r in result]
            ok = all(v[0] for v in verdicts)
            section.add(f"NCCL, world size {world}: {check}", "passed" if ok else "failed",
                        verdicts[0][1] if ok else "; ".join(f"rank {r}: {v[1]}"
                                                          for r, v in enumerate(verdicts) if not v[0]))
    section.notes.append("Assignment 2's reference functions, executed from "
                         "solutions/a2_ddp/ddp.ipynb, run on course.launch ranks on NCCL and are "
                         "judged by the checks of autograder/gpu_check/ranks.py (the grader's own A2 "
                         "checks use NCCL only with 2 or more GPUs).")


def torchrun(section, gpus: int, out: Path, env: dict) -> None:
    """``ddp_train.py`` under ``torchrun --standalone --nproc-per-node <gpus>`` (NCCL)."""
    exe = Path(sys.executable).parent / "torchrun"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc-per-node", str(gpus), str(REPO / "course/scripts/ddp_train.py"),
            "--epochs", "2", "--limit", "8192", "--batch-size", "128", "--timeout", "120",
            "--checkpoint-dir", str(out / "torchrun-checkpoint")]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"still running after 600 s: stopped\n{exc.stdout or ''}"
    seconds = time.monotonic() - start
    ranks = re.findall(r"rank (\d+)/\d+ .* on (cuda:\d+)", text)
    rates = [float(x) for x in re.findall(r"(\d+) examples/s", text)]
    ok = rc == 0 and len(ranks) == gpus and "epoch 1:" in text
    detail = (f"{gpus} rank(s) on {', '.join(d for _, d in sorted(ranks))}" if ok else
              f"exit code {rc}, ranks on CUDA: {ranks}; output ends:\n{text[-1200:]}")
    section.add(f"torchrun --nproc-per-node {gpus} ddp_train.py (NCCL)", "passed" if ok else "failed",
                detail, seconds=round(seconds, 1), examples_per_s_by_epoch=rates)


def launch_cuda_ranks(section, gpus: int) -> None:
    """course.launch ranks that each use CUDA, from a parent that has initialised CUDA, with
    each way ranks start; and, for contrast, what a plain fork of that parent gets."""
    import torch

    from course.launch import launch

    from . import ranks

    torch.zeros(1, device="cuda")  # the parent has initialised CUDA, as a notebook would have
    cases = [("forkserver", gpus, "nccl"), ("exec", gpus, "nccl"), ("forkserver", gpus + 1, "gloo")]
    for how, world, backend in cases:
        name = f"launch({world} rank(s), {backend}), ranks started by {how}"
        saved = os.environ.get("COURSE_LAUNCH_START")
        os.environ["COURSE_LAUNCH_START"] = how
        try:
            results = launch(ranks.rank_cuda_work, world, backend=backend, timeout=180,
                             collective_timeout=60, quiet=True)
            ok = all(r["sum_ok"] and r["backend"] == backend and r["initialized_before"] in (None, False)
                     for r in results) and len({r["pid"] for r in results}) == world
            section.add(name, "passed" if ok else "failed",
                        "; ".join(f"rank {i}: {r['device']} ({r['name']}), allreduce "
                                  f"{'right' if r['sum_ok'] else 'WRONG'}" for i, r in enumerate(results)))
        except Exception as exc:
            section.add(name, "failed", f"{type(exc).__name__}: {str(exc)[-800:]}")
        finally:
            if saved is None:
                os.environ.pop("COURSE_LAUNCH_START", None)
            else:
                os.environ["COURSE_LAUNCH_START"] = saved
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=ranks.fork_child_cuda, args=(send,))
    child.start()
    send.close()
    said = receive.recv() if receive.poll(60) else "no answer within 60 s"
    child.join(10)
    if child.is_alive():
        child.kill()
    section.add("contrast: a plain fork of a parent that initialised CUDA",
                "expected failure" if "CUDA worked" not in said else "info",
                f"{said[:300]} (course.launch never forks the parent: its ranks come from a fork "
                "server that never touched CUDA, or from a fresh interpreter)")


def bandwidth(section, gpus: int) -> None:
    """The reference ring and dist.all_reduce by message size on all GPUs (NCCL)."""
    from course.launch import launch

    from . import ranks

    ring = a2_reference_functions()["ring_allreduce"]
    try:
        per_rank = launch(ranks.rank_bandwidth, gpus, ring, BANDWIDTH_SIZES,
                          2, 10, backend="nccl", timeout=600, collective_timeout=120, quiet=True)
    except Exception as exc:
        section.add("ring and all_reduce bandwidth", "failed", f"{type(exc).__name__}: {str(exc)[-800:]}")
        return
    if gpus == 1:
        section.notes.append("One GPU: a world of one sends nothing, so these figures are each "
                             "call's fixed cost, not bandwidth between GPUs.")
    bus = 2 * (gpus - 1) / gpus
    worst = 0.0
    for n in BANDWIDTH_SIZES:
        ring_s = max(r[n]["ring"] for r in per_rank)
        ar_s = max(r[n]["all_reduce"] for r in per_rank)
        worst = max(worst, *(r[n]["max_error"] for r in per_rank))
        section.add(f"{n:,} float32", "info", "ring vs dist.all_reduce, median of 10 (slowest rank)",
                    ring_ms=ring_s * 1e3, all_reduce_ms=ar_s * 1e3,
                    ring_algbw_GBps=4 * n / ring_s / 1e9, all_reduce_algbw_GBps=4 * n / ar_s / 1e9,
                    ring_busbw_GBps=bus * 4 * n / ring_s / 1e9,
                    all_reduce_busbw_GBps=bus * 4 * n / ar_s / 1e9)
    section.add("ring results equal all_reduce's", "passed" if worst < 1e-3 else "failed",
                f"largest difference {worst:.2g}")
