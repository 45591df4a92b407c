"""How long a call into student code may take: from the reference's measured time on this
machine where it was calibrated, else the spec's default.

``python -m autograder calibrate`` grades the reference solution of each assignment and keeps,
per check, its longest single call; a later grading on the same machine (same processor count,
GPUs and torch) gives each call ``max(MIN_TIMEOUT, FACTOR x that)``. A correct submission is
within a small factor of the reference; a hung one is stopped after that, not a flat minute,
and the harness then fails the function's remaining checks at once.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .spec import Check

MIN_TIMEOUT = 5.0
FACTOR = 20.0


def calibration_file() -> Path:
    """``$AUTOGRADER_CALIBRATION``, else ``~/.cache/scale-pytorch-autograder/calibration.json``."""
    if os.environ.get("AUTOGRADER_CALIBRATION"):
        return Path(os.environ["AUTOGRADER_CALIBRATION"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "scale-pytorch-autograder" / "calibration.json"


def machine() -> str:
    """What the timings depend on: processors, GPUs, torch."""
    import torch

    from course.devices import gpu_count

    gpus = ",".join(torch.cuda.get_device_name(i) for i in range(gpu_count()))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.machine()} {cores} cores | gpus {gpus or 'none'} | torch {torch.__version__}"


def _read() -> dict:
    try:
        data = json.loads(calibration_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def calibrated(assignment: str) -> dict[str, float] | None:
    """``{check: seconds}`` measured on this machine, or None."""
    entry = _read().get(machine(), {}).get(assignment)
    return {k: float(v) for k, v in entry.items()} if isinstance(entry, dict) else None


def save(assignment: str, seconds: dict[str, float]) -> Path:
    from ..results import write_json

    data = _read()
    data.setdefault(machine(), {})[assignment] = seconds
    write_json(calibration_file(), data)
    return calibration_file()


def call_timeout(check: Check, measured: dict[str, float] | None) -> float:
    if measured and check.name in measured:
        return max(MIN_TIMEOUT, FACTOR * measured[check.name])
    return check.timeout
