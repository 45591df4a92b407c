"""What every benchmark of :mod:`autograder.bench` shares, written once: its argument parser
(named after the registry's command), where its processes run, the header that says on what
machine and under what load the figures were taken, and matplotlib without a display.

Why a header on every run: the machine's other programs take cores away from the processes,
so a figure without the load it was measured under cannot be compared with another.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

#: Where the benchmarks save their plots unless ``--out`` says otherwise (git ignores it).
OUT = "bench_results"


def parser(name: str, description: str, *, repeats: int | None = None,
           out: str | None = "the PNG plots") -> argparse.ArgumentParser:
    """The parser of ``python -m autograder.bench NAME``, with ``--repeats`` (median of that
    many timings) and ``--out`` (the plots' folder) where the benchmark has them."""
    p = argparse.ArgumentParser(prog=f"python -m autograder.bench {name}", description=description)
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats,
                       help=f"timed runs per figure, the median is reported ({repeats})")
    if out is not None:
        p.add_argument("--out", default=OUT, help=f"folder for {out} ({OUT})")
    return p


def cores() -> int:
    """CPU cores this process may run on (its affinity, where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def load() -> float:
    """The 1-minute load average: processes running or waiting for a core."""
    return os.getloadavg()[0]


def where(processes: int) -> str:
    """What ``processes`` ranks run on here: GPUs on NCCL when there is one for each."""
    from course.devices import gpu_count

    return ("GPUs on NCCL" if gpu_count() >= processes
            else "CPU processes on gloo, 1 thread each, standing in for GPUs")


def header(processes_on: str) -> None:
    """Print the hardware, what the processes run on and the load now."""
    from course.devices import hardware_summary

    print(f"Hardware: {hardware_summary()}")
    print(f"Processes: {processes_on}; {cores()} core(s) for this program; load average now "
          f"{load():.1f} (other programs running take cores away from the processes)")


def introduce(processes: int) -> str:
    """The header for a run of up to ``processes`` ranks, and a note where CPU processes
    outnumber the cores (their times then include waiting for one); returns :func:`where`."""
    on = where(processes)
    header(on)
    if on.startswith("CPU") and processes > cores():
        print(f"Note: {processes} processes on {cores()} core(s) share cores: their times "
              "include waiting for a core.")
    return on


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (its folder made if needed) and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
