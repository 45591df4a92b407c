"""Device discovery that never pretends.

With GPUs present, the lessons use them. Without, a lesson can ask for *stand-ins*: that many
references to the CPU, so that code written for several devices still runs. A stand-in is
labelled as such everywhere it is printed, because nothing run on stand-ins is faster for it:
they all share the same CPU cores.
"""
from __future__ import annotations

import os
import platform

import torch


def gpu_count() -> int:
    """Number of CUDA GPUs this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_devices(n: int | None = None, *, stand_ins: bool = True) -> list[torch.device]:
    """Up to ``n`` devices to spread work over (all GPUs when ``n`` is None).

    Without GPUs (or with fewer than ``n``) and ``stand_ins=True``, the list is padded with
    CPU stand-ins: ``torch.device('cpu')`` repeated. Use :func:`describe` to print it honestly.
    """
    gpus = [torch.device(f"cuda:{i}") for i in range(gpu_count())]
    if n is None:
        return gpus or [torch.device("cpu")]
    if len(gpus) >= n:
        return gpus[:n]
    if gpus and not stand_ins:
        return gpus
    if not stand_ins:
        return [torch.device("cpu")]
    # Never mix real GPUs with CPU stand-ins: a lesson with 1 GPU asking for 2 gets 2 stand-ins.
    return [torch.device("cpu")] * n


def is_stand_in(device: torch.device | str) -> bool:
    """True for a CPU device used in place of a GPU."""
    return torch.device(device).type == "cpu"


def label(device: torch.device | str, index: int | None = None) -> str:
    """A short name for printing: ``cuda:0 (NVIDIA H100)`` or ``cpu #1 (CPU stand-in for a GPU)``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    where = f"cpu #{index}" if index is not None else "cpu"
    return f"{where} (CPU stand-in for a GPU)"


def describe(devices: list[torch.device] | None = None) -> str:
    """One line per device; says plainly when the devices are CPU stand-ins."""
    devices = available_devices() if devices is None else devices
    lines = [f"  {label(d, i)}" for i, d in enumerate(devices)]
    head = f"{len(devices)} device(s):"
    if any(is_stand_in(d) for d in devices):
        head += (f" no GPU here, so {len(devices)} CPU stand-in(s) sharing "
                 f"{os.cpu_count()} CPU core(s); expect no speedup from them")
    return "\n".join([head, *lines])


def hardware_summary() -> str:
    """What a timing or a grade was measured on, for reports."""
    cpu = f"{os.cpu_count()} CPU core(s) ({platform.machine()})"
    n = gpu_count()
    if n == 0:
        return f"{cpu}, no CUDA GPU; torch {torch.__version__}"
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    return f"{cpu}, {n} CUDA GPU(s): {', '.join(names)}; torch {torch.__version__}"


def synchronize(devices=None) -> None:
    """Wait until every queued kernel on the given (or all) CUDA devices has finished.

    CUDA calls return before the GPU is done; time measured without this is the time to
    *queue* the work. A no-op on the CPU, whose operations finish before they return.
    """
    if not torch.cuda.is_available():
        return
    if devices is None:
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
        return
    for d in {torch.device(d) for d in devices}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


#: Set to "1" to make :func:`cpu_bf16_ok` say no (the lessons' no-bf16 path); read at each call.
DISABLE_CPU_BF16 = "COURSE_DISABLE_CPU_BF16"


def cpu_bf16_ok() -> bool:
    """Make bf16 matrix products safe on this CPU before any runs; True when they are.

    Why: some virtual machines advertise AMX (``amx_tile`` in /proc/cpuinfo) without letting
    processes use it, and oneDNN's bf16 kernels then die with "Illegal instruction", taking
    the notebook's kernel down. A bf16 product in a throw-away process tells; if it dies, oneDNN
    is capped below AMX (``ONEDNN_MAX_CPU_ISA``, read when oneDNN first runs, and inherited by
    the processes ``course.launch`` starts), which keeps bf16 correct, only slower. Call it
    before this process runs its first bf16 product.

    ``COURSE_DISABLE_CPU_BF16=1`` makes it return False without probing, as on a CPU where
    bf16 products die even below AMX. Why: that path (lesson 10's 16-bit cells in fp16) must
    run somewhere it can be tested, and the machines that run the tests usually have working
    bf16; the suite runs lesson 10 once with it set."""
    import subprocess
    import sys

    if os.environ.get(DISABLE_CPU_BF16) == "1":
        return False

    probe = ("import torch; a = torch.randn(64, 256, dtype=torch.bfloat16); "
             "b = torch.nn.Linear(256, 64).bfloat16(); (a @ a.T).sum(); b(a).sum().backward()")
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return True
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0
