"""``make wheelhouse`` and ``make gpu-check-offline``: ``make gpu-check`` on a GPU machine that has
its own CUDA torch (2.11 to 2.15) but no network, e.g. a GPU cloud image or an air-gapped HPC
cluster (docs/gpu-check.md).

    python -m autograder.gpu_check.wheelhouse build [DIR] [--python-version 3.12] [--glibc 2.28]
    python -m autograder.gpu_check.wheelhouse install WHEELHOUSE VENV

``build`` (on a machine with network) writes, as wheels, what gpu-check needs besides torch: the
project's dependencies in pyproject.toml minus :data:`LEFT_OUT`, with their own dependencies,
plus ``requirements.txt`` and ``wheelhouse.json`` (what it was built for). ``install`` (on the
GPU machine) makes a ``--system-site-packages`` venv over the Python that runs it, so the
machine's torch is the one used, and installs from the wheelhouse alone (``pip --no-index``,
pip's own configuration ignored). torch is never installed or changed: no torch wheel is in
the wheelhouse, and ``install`` checks that the venv's torch is the machine's before and after.

The project itself is not installed: gpu-check runs from the clone (it grades and executes
``solutions/`` and the lessons there, found next to its own files). Standard library only: it
runs before anything is installed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import site
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: dependencies in pyproject.toml that the wheelhouse leaves out, and why
LEFT_OUT = {
    "torch": "the GPU machine's own CUDA build is used, never installed",
    "torchvision": "the GPU machine's own, installed with its torch",
    "nbgrader": "instructors' tooling: gpu-check grades with python -m autograder",
    "jupyterlab": "the browser lab: gpu-check runs notebooks with nbclient and ipykernel",
}
#: wheels that must never be in a wheelhouse (they would replace the machine's torch stack)
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia[-_].*)$", re.I)
LIMIT_MB = 60  # what docs/gpu-check.md promises; tests/test_wheelhouse.py measures it


def _name(requirement: str) -> str:
    """The distribution name of a requirement string, normalised (PEP 503)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """pyproject.toml's dependencies, as written there, minus :data:`LEFT_OUT`."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if _name(d) not in LEFT_OUT]


def wheels(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.whl"))


def _megabytes(paths: list[Path]) -> float:
    return sum(p.stat().st_size for p in paths) / 1e6


def target_args(python_version: str | None, glibc: str | None) -> list[str]:
    """pip download's options for another Python or an older glibc (x86_64 Linux): binary
    wheels only, every manylinux tag that glibc runs (pip does not expand them itself)."""
    if not python_version and not glibc:
        return []
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    major, minor = (glibc or "2.28").split(".")
    args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", version,
            "--abi", "cp" + version.replace(".", "")]
    for m in range(int(minor), 4, -1):
        args += ["--platform", f"manylinux_{major}_{m}_x86_64"]
    for legacy, m in (("manylinux2014", 17), ("manylinux2010", 12), ("manylinux1", 5)):
        if int(minor) >= m:
            args += ["--platform", f"{legacy}_x86_64"]
    return args


def build(dest: Path, python_version: str | None = None, glibc: str | None = None,
          pip_args: list[str] = (), env: dict | None = None) -> list[Path]:
    """Write the wheels, requirements.txt and wheelhouse.json into ``dest``; return the wheels.
    ``pip_args`` go to pip as they are (the tests pass local indexes)."""
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / "wheelhouse.json").exists():  # an earlier build: its wheels would stay beside
        for old in wheels(dest):
            old.unlink()
    reqs = dest / "requirements.txt"
    reqs.write_text("# python -m autograder.gpu_check.wheelhouse build: pyproject.toml's "
                    f"dependencies minus {', '.join(LEFT_OUT)}\n" + "\n".join(requirements()) + "\n")
    extra = target_args(python_version, glibc)
    verb = ["download", "--dest"] if extra else ["wheel", "--wheel-dir"]  # download: --platform
    cmd = [sys.executable, "-m", "pip", *verb, str(dest), "--quiet", "--disable-pip-version-check",
           "--requirement", str(reqs), *extra, *pip_args]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    found = wheels(dest)
    bad = [w.name for w in found if FORBIDDEN.match(w.name.split("-")[0])]
    if bad:
        raise SystemExit(f"the wheelhouse must not hold the torch stack, but has {bad}: "
                         "a requirement pulled it in; remove it from the list")
    not_wheels = [p.name for p in dest.iterdir() if p.suffix in (".gz", ".zip", ".bz2")]
    if not_wheels:
        raise SystemExit(f"source archives, not wheels: {not_wheels}")
    built_for = {"python": python_version or platform.python_version(),
                 "glibc": glibc or platform.libc_ver()[1], "machine": platform.machine(),
                 "built": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "requirements": requirements(), "wheels": [w.name for w in found],
                 "megabytes": round(_megabytes(found), 1)}
    (dest / "wheelhouse.json").write_text(json.dumps(built_for, indent=1) + "\n")
    print(f"{dest}: {len(found)} wheels, {built_for['megabytes']} MB, for Python "
          f"{built_for['python']} on {built_for['machine']} with glibc {built_for['glibc']}")
    return found


def supported_torch(pyproject: Path = REPO / "pyproject.toml") -> tuple[tuple, tuple] | None:
    """The (lowest, first unsupported) torch releases of pyproject's ``torch>=A.B,<C.D``."""
    spec = next(d for d in tomllib.loads(pyproject.read_text())["project"]["dependencies"]
                if _name(d) == "torch")
    low, high = re.search(r">=\s*([\d.]+)", spec), re.search(r"<\s*([\d.]+)", spec)
    if not (low and high):
        return None
    return tuple(map(int, low.group(1).split("."))), tuple(map(int, high.group(1).split(".")))


def offline_pip_env() -> dict:
    """pip sees the wheelhouse and nothing else: no configuration file (its indexes,
    find-links and constraints, such as a cap on torch), no PIP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _torch_file(python: Path) -> str | None:
    """The torch that ``python`` would import (found, not imported: that takes seconds)."""
    code = "import importlib.util as u; s = u.find_spec('torch'); print(s.origin if s else '')"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() or None


def install(wheelhouse: Path, venv: Path) -> None:
    """A ``--system-site-packages`` venv over this Python with the wheelhouse installed."""
    reqs = wheelhouse / "requirements.txt"
    if not reqs.exists():
        raise SystemExit(f"{reqs} not found: build the wheelhouse with `make wheelhouse` on a "
                         "machine with network and copy it here (docs/gpu-check.md)")
    try:
        import torch
    except Exception as exc:  # not installed, or its CUDA libraries do not load
        raise SystemExit(f"{sys.executable} cannot import torch ({exc}): run with the Python that "
                         "has this machine's CUDA torch (make gpu-check-offline PYTHON=...)")
    print(f"this machine's torch: {torch.__version__} ({torch.__file__})", flush=True)
    bounds = supported_torch()
    release = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if bounds and not bounds[0] <= release < bounds[1]:
        print(f"warning: the course supports torch {'.'.join(map(str, bounds[0]))} up to (not "
              f"including) {'.'.join(map(str, bounds[1]))}; gpu-check runs, expect failures")
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
    if sys.prefix != sys.base_prefix:
        # this Python is itself a venv: --system-site-packages reaches only its base
        # interpreter, so its own site-packages (where torch is) go on the path after the new
        # venv's, through a .pth file
        paths = site.getsitepackages()
        if site.ENABLE_USER_SITE:
            paths.append(site.getusersitepackages())
        code = "import sysconfig; print(sysconfig.get_path('purelib'))"
        lib = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                             check=True).stdout.strip()
        (Path(lib) / "_machine_site.pth").write_text("\n".join(paths) + "\n")
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
           str(wheelhouse), "--requirement", str(reqs)]
    print(" ".join(cmd), flush=True)
    if subprocess.run(cmd, env=offline_pip_env()).returncode:
        built = wheelhouse / "wheelhouse.json"
        was = json.loads(built.read_text()) if built.exists() else {}
        raise SystemExit(
            f"pip could not install from {wheelhouse} (built for Python {was.get('python', '?')}, "
            f"glibc {was.get('glibc', '?')}; this machine: Python {platform.python_version()}, "
            f"glibc {platform.libc_ver()[1]}). Rebuild it for this machine: make wheelhouse "
            "WHEELHOUSE_ARGS='--python-version X.Y --glibc A.B' (docs/gpu-check.md)")
    now = _torch_file(python)
    if now != torch.__file__:
        raise SystemExit(f"the venv's torch is {now}, not this machine's {torch.__file__}")
    subprocess.run([str(python), "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3",
                    "--display-name", "Python 3 (gpu-check)"], check=True, stdout=subprocess.DEVNULL)
    torchrun = venv / "bin" / "torchrun"
    if not torchrun.exists():  # the machine's torchrun runs the machine's Python, not this venv
        torchrun.write_text(f"#!{python}\nimport sys\nfrom torch.distributed.run import main\n"
                            "sys.exit(main())\n")
        torchrun.chmod(0o755)
    print(f"{venv}: ready; torch {torch.__version__} from {now}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.gpu_check.wheelhouse",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the wheels (needs an index: the network)")
    b.add_argument("dest", type=Path, nargs="?", default=REPO / "build" / "wheelhouse")
    b.add_argument("--python-version", help="the GPU machine's Python, e.g. 3.12 (default: this one)")
    b.add_argument("--glibc", help="the GPU machine's glibc, e.g. 2.28 (default: this machine's "
                                   "wheels; with --python-version alone: 2.28)")
    i = sub.add_parser("install", help="make the venv and install from the wheelhouse, offline")
    i.add_argument("wheelhouse", type=Path)
    i.add_argument("venv", type=Path)
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.dest, args.python_version, args.glibc)
    else:
        install(args.wheelhouse, args.venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
