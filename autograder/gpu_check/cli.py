"""``make gpu-check``: run every GPU path of the course and the grader on this machine, and
write what happened to ``gpu-report.md`` and ``gpu-report.json``.

    python -m autograder.gpu_check [--out build/gpu-check] [--only lessons,grading,...]

Sections, in order (the modules of this package):

- ``start``: the command can start here: imports, the grader's CLI, the Jupyter kernel,
  torchrun, the notebooks. Always run; the only section run without a GPU;
- ``lessons``: every lesson notebook in quick mode with nbclient, recording which cells used
  CUDA and the lines they printed with a timing (:mod:`.lessons`);
- ``grading``: every assignment's solution and stub through ``python -m autograder grade``,
  speed checks as the GPU count allows (:mod:`.grading`);
- ``nccl``: Assignment 2's reference functions on an NCCL group of one GPU (world size 1);
- ``torchrun``: ``course/scripts/ddp_train.py`` under torchrun with NCCL, one rank per GPU;
- ``launch``: ``course.launch`` ranks that each use CUDA, from a parent that initialised CUDA;
- ``bandwidth``: A2's reference ring and ``dist.all_reduce`` by message size on the GPUs
  (:mod:`.distributed` for these four).

Without a CUDA GPU it says so, runs ``start`` only and exits 0 if that passed. With one, it
exits 1 if anything that should work on this hardware failed. ``__main__.py`` only calls
:func:`main`: ranks started by a fork server or a fresh interpreter import the main module
again, so it must do nothing else at import.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..registry import ASSIGNMENTS, REPO

SECTIONS = {"start": "Start-up", "lessons": "Lessons in quick mode", "grading": "Grading",
            "nccl": "A2 on an NCCL process group", "torchrun": "torchrun with NCCL",
            "launch": "course.launch with CUDA ranks", "bandwidth": "Allreduce bandwidth"}
LESSONS = sorted((REPO / "course" / "lessons").glob("*.ipynb"))
NOTEBOOKS = [a.source for a in ASSIGNMENTS.values()] + [a.release for a in ASSIGNMENTS.values()]


def child_env() -> dict:
    """Quick mode, offline (synthetic data unless COURSE_DATA holds Fashion-MNIST), this
    checkout first on the module path, this Python's scripts first on PATH."""
    env = dict(os.environ)
    env.update(COURSE_FULL="0", COURSE_OFFLINE="1", MPLBACKEND="Agg", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(cmd: list[str], timeout: float = 60) -> tuple[int | None, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              env=child_env(), stdin=subprocess.DEVNULL)
        return proc.returncode, (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def environment() -> dict:
    """Versions and GPUs (torch, its CUDA, cuDNN, NCCL, the driver), and the CPUs."""
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpu_cores": os.cpu_count(), "torch": torch.__version__,
           "torch built with CUDA": torch.version.cuda or "no (a CPU-only build)",
           "cuda available": torch.cuda.is_available(),
           "gpu count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    rc, out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 30)
    env["nvidia driver"] = out.splitlines()[0] if rc == 0 and out else f"unknown ({out[:120] or rc})"
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")
    gpus = []
    if env["gpu count"]:
        env["cudnn"] = torch.backends.cudnn.version()
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        for i in range(env["gpu count"]):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gib": p.total_memory / 2 ** 30,
                         "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    env["gpus"] = gpus
    return env


def start_checks(section, out: Path) -> None:
    """What every later section needs, checked in seconds and without a GPU."""
    import importlib.util

    for module in ("course.launch", "course.devices", "course.data", "course.timing",
                   "cloudpickle", "autograder.gpu_check.lessons", "autograder.gpu_check.grading",
                   "autograder.gpu_check.distributed", "autograder.gpu_check.ranks"):
        try:
            __import__(module)
            section.add(f"import {module}", "passed")
        except Exception as exc:
            section.add(f"import {module}", "failed", f"{type(exc).__name__}: {exc}")
    # installed, not imported: importing nbformat alone takes seconds (its JSON schema checks)
    for module in ("nbformat", "nbclient", "torchvision"):
        found = importlib.util.find_spec(module) is not None
        section.add(f"{module} installed", "passed" if found else "failed",
                    "" if found else "not found by this Python")
    rc, text = _run([sys.executable, "-m", "autograder", "grade", "--help"])
    section.add("grader CLI starts (python -m autograder grade --help)",
                "passed" if rc == 0 and "--report" in text else "failed", "" if rc == 0 else text[-400:])
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        spec = KernelSpecManager().get_kernel_spec("python3")
        section.add("Jupyter kernel python3", "passed", " ".join(spec.argv[:1]))
    except Exception as exc:
        section.add("Jupyter kernel python3", "failed", f"{type(exc).__name__}: {exc}")
    exe = Path(sys.executable).parent / "torchrun"
    section.add("torchrun next to this Python", "passed" if exe.exists() else "failed", str(exe))
    bad = []
    for path in [*LESSONS, *NOTEBOOKS]:
        try:
            json.loads(path.read_text())["cells"]
        except Exception as exc:
            bad.append(f"{path.relative_to(REPO)}: {type(exc).__name__}")
    section.add(f"{len(LESSONS)} lessons and {len(NOTEBOOKS)} assignment notebooks read",
                "failed" if bad or not LESSONS else "passed", "; ".join(bad))
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("ok")
        (out / ".write-test").unlink()
        section.add(f"output folder {out} writable", "passed")
    except OSError as exc:
        section.add(f"output folder {out} writable", "failed", str(exc))


def lessons(section) -> None:
    """Every lesson in quick mode; which cells used CUDA; the timings they printed."""
    from . import lessons as runner

    saved = dict(os.environ)
    os.environ.update(child_env())  # the kernels inherit this process's environment
    try:
        for path in LESSONS:
            print(f"  lesson {path.stem} ...", flush=True)
            r = runner.run_lesson(path)
            ok = r["error"] is None and r["cells_run"] == r["code_cells"]
            section.add(path.stem, "passed" if ok else "failed",
                        r["error"] or f"{len(r['cuda_cells'])} of {r['code_cells']} code cells used CUDA",
                        cuda_cells=r["cuda_cells"], seconds=round(r["seconds"], 1),
                        rank_cuda_cells=[c["cell"] for c in r["cells"] if c["rank_cuda_allocations"]])
            if r["timings"]:
                section.add(f"{path.stem} timings", "info", "\n".join(r["timings"][:15]))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    section.notes.append("CUDA use is measured, not guessed: the CUDA allocator's allocation "
                         "count in the kernel and in every course.launch rank, before and after "
                         "each cell (autograder/gpu_check/lessons.py). Cells are numbered as in the "
                         "lesson file, from 0, markdown cells included.")


def run_section(key: str, section, gpus: int, out: Path) -> None:
    from . import distributed as dist_checks
    from . import grading

    if key == "lessons":
        lessons(section)
    elif key == "grading":
        grading.run(section, out, child_env())
    elif key == "nccl":
        dist_checks.nccl_a2(section, gpus)
    elif key == "torchrun":
        dist_checks.torchrun(section, gpus, out, child_env())
    elif key == "launch":
        dist_checks.launch_cuda_ranks(section, gpus)
    elif key == "bandwidth":
        dist_checks.bandwidth(section, gpus)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "build" / "gpu-check",
                   help="folder for gpu-report.md, gpu-report.json and the grader's reports")
    p.add_argument("--only", help=f"comma-separated sections of {', '.join(list(SECTIONS)[1:])} "
                                  "(start always runs)")
    args = p.parse_args(argv)
    wanted = set(SECTIONS) if not args.only else {"start", *args.only.split(",")}
    unknown = wanted - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")

    from .report import Report, Section, write

    env = environment()
    gpus = env["gpu count"]
    report = Report(datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    socket.gethostname(), gpus > 0, env)
    if gpus:
        print(f"{gpus} CUDA GPU(s): {', '.join(g['name'] for g in env['gpus'])}; torch "
              f"{env['torch']}, CUDA {env['torch built with CUDA']}, driver {env['nvidia driver']}")
    else:
        print(f"No CUDA GPU found (torch {env['torch']}, built with CUDA: "
              f"{env['torch built with CUDA']}; driver: {env['nvidia driver']}). Only the start-up "
              "checks run; every GPU section is reported as not run.")
    for key, title in SECTIONS.items():
        section = Section(key, title)
        report.sections.append(section)
        if key not in wanted:
            section.ran, section.why_not = False, "left out with --only"
        elif key != "start" and not gpus:
            section.ran, section.why_not = False, "no CUDA GPU found on this machine"
        else:
            print(f"[{key}] {title} ...", flush=True)
            start = time.monotonic()
            try:
                start_checks(section, args.out) if key == "start" else \
                    run_section(key, section, gpus, args.out)
            except Exception as exc:  # a section that crashed is a failure, not an abort
                section.add("section crashed", "failed", f"{type(exc).__name__}: {exc}")
            section.notes.append(f"took {time.monotonic() - start:.0f} s")
        print(f"[{key}] {section.status}", flush=True)
    md, js = write(report, args.out)
    for failure in report.failures():
        print(f"FAILED: {failure}")
    print(f"report: {md} and {js}; exit code {report.exit_code()}")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
