"""Shared test helpers: tiny Fashion-MNIST files, notebook execution, grading runs.

Tests never download: the data loader is fed small IDX files written here, in the exact
format torchvision reads.
"""
from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file (the MNIST format)."""
    magic = struct.pack(">HBB", 0, 0x08, array.ndim)
    dims = struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(magic + dims + array.astype(np.uint8).tobytes())


def write_tiny_fashion_mnist(root: Path, n_train: int = 512, n_test: int = 128, seed: int = 0) -> Path:
    """Small but learnable Fashion-MNIST files under ``root/FashionMNIST/raw``."""
    rng = np.random.default_rng(seed)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prototypes = rng.integers(0, 256, size=(10, 28, 28))
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n)
        noise = rng.normal(0, 40, size=(n, 28, 28))
        images = np.clip(prototypes[labels] + noise, 0, 255)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_tiny_fashion_mnist(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def offline_env(tiny_data) -> dict:
    """Environment for running notebooks and the grader in tests: offline, tiny data, quick mode."""
    env = dict(os.environ)
    env.update(COURSE_DATA=str(tiny_data), COURSE_OFFLINE="1", COURSE_FULL="0",
               MPLBACKEND="Agg", PYTHONWARNINGS="ignore")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def grade(notebook: Path, *extra: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Grade ``notebook`` with the CLI in a fresh process; return the full JSON report."""
    out = Path(tempfile.mkdtemp(prefix="report-")) / "report.json"
    proc = subprocess.run([sys.executable, "-m", "autograder", "grade", str(notebook),
                           "--report", str(out), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if not out.exists():
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                "results": [], "score": 0}
    report = json.loads(out.read_text())
    report.update(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    return report


def points_by_function(report: dict) -> dict[str, float]:
    totals: dict[str, float] = {}
    for r in report["results"]:
        totals[r["function"]] = totals.get(r["function"], 0) + r["points"]
    return totals
