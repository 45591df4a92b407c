"""The GPU image's torch build follows the host's NVIDIA driver (issue 33.3).

PyPI's torch wheels carry CUDA 13.0 (driver >= 580.65.06); many cloud hosts run 535-570.
`make docker-build` asks docker/cuda_variant.py, which reads `nvidia-smi`, and passes the chosen
wheel index as the TORCH_INDEX build argument, or stops and says what to pass. Here a fake
`nvidia-smi` on PATH plays each host, and `make -n` shows the docker command without Docker.

Tier: quick: make dry runs and one small script, in seconds.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "docker" / "cuda_variant.py"
CU126 = "https://download.pytorch.org/whl/cu126"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = ""


def _load():
    spec = importlib.util.spec_from_file_location("cuda_variant", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cuda_variant = _load()


def fake_nvidia_smi(bin_dir: Path, driver: str, caps: list[str] | None, fails: bool = False) -> None:
    """An `nvidia-smi` answering the three questions make and the script ask, one line a GPU.
    caps=None: an nvidia-smi too old to know the compute_cap field (as before R510)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    gpus = caps or ["8.0"]
    listing = "\n".join(f"GPU {i}: NVIDIA Fake (UUID: GPU-{i})" for i in range(len(gpus)))
    if fails:
        body = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA '
                'driver."; exit 9')
    else:
        cap_answer = ("printf '%s\\n' " + " ".join(caps) if caps else
                      'echo \'Field "compute_cap" is not a valid field to query.\'; exit 2')
        body = f"""case "$*" in
  -L) printf '%s\\n' "{listing}" ;;
  *driver_version*) for g in {' '.join(['x'] * len(gpus))}; do echo "{driver}"; done ;;
  *compute_cap*) {cap_answer} ;;
  *) exit 2 ;;
esac"""
    path = bin_dir / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def make_build(path: str, *args: str) -> subprocess.CompletedProcess:
    """`make -n docker-build` with this PATH: what would run, and what make said."""
    env = {**os.environ, "PATH": path}
    env.pop("TORCH_GPU_INDEX", None)
    env.pop("DOCKER_VARIANT", None)
    return subprocess.run([shutil.which("make"), "-s", "-n", "docker-build",
                           f"PYTHON={sys.executable}", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def built_with(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    found = re.findall(r"docker build .*?--build-arg TORCH_INDEX=(\S*) \.", result.stdout, re.S)
    assert len(found) == 1, result.stdout
    return found[0]


@pytest.mark.parametrize("driver, caps, index", [
    ("535.183.01", ["8.6"], CU126),          # A10G on a common cloud image
    ("550.54.15", ["8.0", "8.0"], CU126),    # two A100s
    ("570.133.20", ["8.9"], CU126),          # L4: runs the 8.6 kernels
    ("580.95.05", ["9.0"], PYPI),            # H100 on a CUDA 13 driver: PyPI's wheels
    ("580.65.06", ["12.0"], PYPI),           # exactly CUDA 13.0's driver; Blackwell
    ("580.95.05", ["7.0"], CU126),           # V100: CUDA 13 has no Volta kernels
    ("550.90.07", None, CU126),              # nvidia-smi without the compute_cap field
])
def test_make_picks_the_index_the_driver_runs(tmp_path, driver, caps, index):
    fake_nvidia_smi(tmp_path / "bin", driver, caps)
    result = make_build(f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert "-t scale-pytorch:gpu" in result.stdout, "nvidia-smi -L lists a GPU: the GPU variant"
    assert built_with(result) == index
    assert f"NVIDIA driver {driver}" in result.stderr, "make says what it read"


@pytest.mark.parametrize("driver, caps", [
    ("470.256.02", ["8.6"]),    # too old for any CUDA 12 build
    ("525.60.12", ["8.6"]),     # one patch below CUDA 12's floor
    ("570.133.20", ["12.0"]),   # Blackwell: only CUDA 13 has its kernels, and 570 cannot run it
])
def test_make_stops_and_names_the_driver_and_the_way_out(tmp_path, driver, caps):
    fake_nvidia_smi(tmp_path / "bin", driver, caps)
    result = make_build(f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert result.returncode != 0 and "docker build" not in result.stdout
    assert f"NVIDIA driver {driver}" in result.stderr
    assert "TORCH_GPU_INDEX=<index>" in result.stderr and "DOCKER_VARIANT=cpu" in result.stderr
    assert "docker: stopped" in result.stderr, "make itself stops, not only the script"


def test_no_nvidia_smi_stops_a_gpu_build_and_leaves_the_cpu_build_alone(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = make_build(str(empty), "DOCKER_VARIANT=gpu")
    assert result.returncode != 0 and "docker build" not in result.stdout
    assert "nvidia-smi is not on PATH" in result.stderr and "TORCH_GPU_INDEX=<index>" in result.stderr
    cpu = make_build(str(empty), "DOCKER_VARIANT=cpu")
    assert "-t scale-pytorch:cpu" in cpu.stdout and built_with(cpu) == CPU_INDEX
    assert "nvidia-smi" not in cpu.stderr and "CUDA" not in cpu.stderr, \
        "the CPU variant never asks about a driver"


def test_a_failing_nvidia_smi_stops_with_its_message(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", "", None, fails=True)
    result = make_build(f"{tmp_path / 'bin'}:{os.environ['PATH']}", "DOCKER_VARIANT=gpu")
    assert result.returncode != 0 and "docker build" not in result.stdout
    assert "couldn't communicate with the NVIDIA driver" in result.stderr


def test_the_user_can_always_choose(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", "470.256.02", ["8.6"])
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    chosen = make_build(path, f"TORCH_GPU_INDEX={CU126}")
    assert built_with(chosen) == CU126 and "no CUDA build" not in chosen.stderr
    assert built_with(make_build(path, "TORCH_GPU_INDEX=")) == PYPI
    assert built_with(make_build(path, "DOCKER_VARIANT=cpu")) == CPU_INDEX


def test_choice_at_the_boundaries():
    choose = cuda_variant.choose
    assert choose("580.65.06").cuda == "13.0" and choose("580.65.05").cuda == "12.6"
    assert choose("525.60.13").cuda == "12.6" and choose("525.60.12") is None
    assert choose("600.10", ["7.0", "9.0"]).cuda == "12.6", "every GPU must have kernels"
    assert choose("600.10", ["8.0", "12.0"]).cuda == "13.0"
    assert choose("600.10", ["6.1", "12.0"]) is None, "no build has kernels for both"
    assert choose("600.10", ["5.2"]).cuda == "12.6" and choose("600.10", ["3.7"]) is None


def test_the_script_answers_for_another_host_without_nvidia_smi():
    out = subprocess.run([sys.executable, str(SCRIPT), "--driver", "550.54.15",
                          "--compute-cap", "8.6"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == f"index={CU126}\n"


def test_table_is_for_the_pinned_torch_and_matches_the_docs():
    """The table is only true for one torch release: a new pin must re-check it."""
    with open(REPO / "pyproject.toml", "rb") as f:
        pinned = tomllib.load(f)["project"]["optional-dependencies"]["pinned"]
    assert f"torch=={cuda_variant.TORCH}" in pinned, "update docker/cuda_variant.py's table"
    docs = (REPO / "docs" / "docker.md").read_text()
    rows = [line for line in docs.splitlines() if re.match(r"\|\s*\d{3}\.\d+\.\d+", line)]
    assert len(rows) == len(cuda_variant.BUILDS)
    for row, build in zip(rows, cuda_variant.BUILDS):
        assert build.min_driver in row and f"CUDA {build.cuda}" in row
        assert f"`TORCH_INDEX={build.index}`" in row
        assert f"{build.sass[0]}" in row
