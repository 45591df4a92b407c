#!/usr/bin/env python3
"""Pick the CUDA build of the pinned torch that this host's NVIDIA driver can run.

PyPI's torch 2.14.1 wheels carry CUDA 13.0, which needs driver 580.65.06 or newer; many cloud
images run 535-570. PyTorch also publishes a CUDA 12.6 build of the same release, which runs on
any driver from 525.60.13 (CUDA minor version compatibility). `make docker-build` runs this for
the GPU image and passes the answer as the TORCH_INDEX build argument; docs/docker.md has the
table and its sources. Standard library only: it runs before any venv exists.

    python3 docker/cuda_variant.py                  # ask nvidia-smi; prints index=<url>
    python3 docker/cuda_variant.py --driver 550.54.15 [--compute-cap 8.6]

Prints `index=` and the wheel index (empty: PyPI's wheels) on stdout and what it read on
stderr; when no build fits, says why on stderr, prints nothing on stdout and exits 1.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass

TORCH = "2.14.1"  # pyproject.toml's `pinned` extra (tests/test_docker_driver.py checks)
OVERRIDE = "TORCH_GPU_INDEX"  # the make variable that skips this choice


@dataclass(frozen=True)
class Build:
    cuda: str
    index: str              # TORCH_INDEX build argument; "" = PyPI's wheels
    min_driver: str         # Linux x86_64 driver this CUDA needs (NVIDIA release notes)
    sass: tuple[str, ...]   # compute capabilities with native kernels (PyTorch RELEASE.md)

    def runs_on(self, cap: str) -> bool:
        """A cubin runs on the same major compute capability at an equal or newer minor. PTX
        is not counted: PyPI's build may lack it, and minor version compatibility (the 12.6
        row on a driver older than 560) cannot JIT it."""
        c = _version(cap)
        return any(_version(s)[0] == c[0] and _version(s) <= c for s in self.sass)


# Newest first; the first that fits the driver and every GPU wins.
BUILDS = (
    Build("13.0", "", "580.65.06",
          ("7.5", "8.0", "8.6", "9.0", "10.0", "12.0")),
    Build("12.6", "https://download.pytorch.org/whl/cu126", "525.60.13",
          ("5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0")),
)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.strip().split("."))


def choose(driver: str, caps: list[str] | None = None) -> Build | None:
    """The newest build that `driver` runs and that has kernels for every GPU in `caps`."""
    for build in BUILDS:
        if (_version(driver) >= _version(build.min_driver)
                and all(build.runs_on(c) for c in caps or [])):
            return build
    return None


def _query(field: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode or not lines:
        raise RuntimeError((out.stderr or out.stdout).strip() or f"exit {out.returncode}")
    return lines


def read_host() -> tuple[str, list[str] | None]:
    """(driver version, compute capabilities or None where nvidia-smi cannot say)."""
    if not shutil.which("nvidia-smi"):
        raise RuntimeError("nvidia-smi is not on PATH: no NVIDIA driver found")
    driver = _query("driver_version")[0]
    try:
        caps = _query("compute_cap")
    except (RuntimeError, subprocess.TimeoutExpired):
        caps = None  # nvidia-smi older than the compute_cap field: the driver decides
    return driver, caps


def refusal(found: str) -> str:
    rows = "\n".join(f"  CUDA {b.cuda}: driver >= {b.min_driver}, GPUs "
                     f"{b.sass[0]}-{b.sass[-1]}: "
                     f"{OVERRIDE}={b.index or ' (empty: PyPI)'}" for b in BUILDS)
    return (f"docker: no CUDA build of torch {TORCH} fits {found}.\n"
            f"The builds (docs/docker.md):\n{rows}\n"
            f"Update the NVIDIA driver, or choose: make docker-build {OVERRIDE}=<index> "
            f"(for the host that will run the image), or DOCKER_VARIANT=cpu.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--driver", help="decide for this driver version instead of asking nvidia-smi")
    p.add_argument("--compute-cap", nargs="+", metavar="X.Y", help="with --driver: the GPUs")
    args = p.parse_args(argv)
    if args.driver:
        driver, caps = args.driver, args.compute_cap
    else:
        try:
            driver, caps = read_host()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"docker: cannot read the NVIDIA driver: {e}", file=sys.stderr)
            print(refusal("a host whose driver is unknown"), file=sys.stderr)
            return 1
    found = f"NVIDIA driver {driver}" + (f" with GPUs of compute capability {', '.join(caps)}"
                                         if caps else "")
    try:
        build = choose(driver, caps)
    except ValueError:
        print(f"docker: cannot read the driver version {driver!r}", file=sys.stderr)
        print(refusal("a host whose driver is unknown"), file=sys.stderr)
        return 1
    if build is None:
        print(refusal(found), file=sys.stderr)
        return 1
    print(f"docker: {found}: torch {TORCH} with CUDA {build.cuda} "
          f"({build.index or 'PyPI'}; {OVERRIDE}=<index> to choose)", file=sys.stderr)
    print(f"index={build.index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
