"""``make wheelhouse`` and ``make gpu-check-offline`` (docs/gpu-check.md): gpu-check on a GPU
machine with its own torch and no network.

The end-to-end test does what a person does, with the network really off:

1. build the wheelhouse with ``python -m autograder.gpu_check.wheelhouse build`` (what
   ``make wheelhouse`` runs) from this machine's *local* package sources only (the ``file://``
   indexes and find-links folders in pip's configuration), inside a network namespace with no
   network (``unshare --net``). Tests never download: where pip has no local source, or the
   local sources lack a package, the test is skipped and says so (pip cannot turn installed
   packages back into wheels: a wheelhouse comes from an index);
2. stand in for the GPU machine's Python: a venv without pip over this base interpreter whose
   site-packages holds only torch, torchvision and their dependencies (symbolic links to
   another torch install of the supported range: ``$WHEELHOUSE_TEST_TORCH``, a venv-torch* of
   .ci/run's ``$COURSE_TORCH_VENVS`` or beside the clone; the pinned torch of this venv when
   there is none, which the test prints). It is itself a venv, as many images' Pythons are,
   which is the harder case: ``--system-site-packages`` alone would not reach its torch;
3. ``make gpu-check-offline`` with that Python, offline (``unshare --net``), on CPU
   (``CUDA_VISIBLE_DEVICES=""``): the start-up checks pass; the venv's torch is the machine's;
4. in that venv, a notebook runs on the gpu-check kernel and A1's solution grades 13/13,
   without jupyterlab and nbgrader: what the lessons and grading sections need.

Tier: the requirement list's test is quick (milliseconds); the end-to-end test is full (70-85 s
on the shared 2-core machine, load average 7-8).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from autograder.gpu_check import wheelhouse

REPO = Path(__file__).resolve().parents[1]
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"

# run by the other torch's Python: the top-level site-packages entries of torch, torchvision
# and every distribution they require
CLOSURE = r"""
import importlib.metadata as md, re
todo, seen, tops = ["torch", "torchvision"], set(), set()
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    todo += [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in dist.requires or []
             if "extra ==" not in r]
    tops |= {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
print("\n".join(sorted(t for t in tops if not t.endswith(".pth"))))
"""


def test_requirements_are_pyprojects_dependencies_minus_the_left_out():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {wheelhouse._name(d) for d in deps}
    assert set(wheelhouse.LEFT_OUT) <= names, "LEFT_OUT names a dependency that is gone"
    reqs = wheelhouse.requirements()
    assert reqs == [d for d in deps if wheelhouse._name(d) not in wheelhouse.LEFT_OUT]
    kept = {wheelhouse._name(r) for r in reqs}
    assert not any(wheelhouse.FORBIDDEN.match(n) for n in kept)
    # the lessons section runs notebooks (nbclient, on an ipykernel kernel); grading runs pytest
    assert {"nbclient", "ipykernel", "nbformat", "pytest", "pytest-timeout"} <= kept
    low, high = wheelhouse.supported_torch()
    assert low <= (2, 14) < high  # the pinned release is inside the range


def _local_pip_sources() -> dict:
    """PIP_* variables that point pip at the local sources of its configuration only."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    indexes, links = [], []
    for key, value in re.findall(r"^\S*?\.?([a-z-]+)='(.*)'$", out, re.M):
        for v in value.split():
            local = v.startswith("file://") or (not re.match(r"\w+://", v) and os.path.isdir(v))
            if key in ("index-url", "extra-index-url") and v.startswith("file://"):
                indexes.append(v)
            elif key == "find-links" and local:
                links.append(v)
    if not indexes and not links:
        pytest.skip("building a wheelhouse needs a package index and pip's configuration has no "
                    "local one (file:// index or find-links folder); tests never download: "
                    f"run `make wheelhouse` with network instead. pip config list:\n{out}")
    env = {"PIP_FIND_LINKS": " ".join(dict.fromkeys(links))}
    if indexes:
        env.update(PIP_INDEX_URL=indexes[0],
                   PIP_EXTRA_INDEX_URL=" ".join(dict.fromkeys(indexes[1:])))
    else:
        env["PIP_NO_INDEX"] = "1"
    return env


def _offline() -> list[str]:
    cmd = ["unshare", "--net", "--map-root-user"]
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        ok = False
    if not ok:
        pytest.skip("cannot turn the network off here (unshare --net --map-root-user failed): "
                    "the offline install is tested only without network")
    return cmd


def _other_torch_python() -> tuple[Path, str]:
    """A Python whose site-packages has a torch other than the pinned one, else this one."""
    def version(python: Path) -> str | None:
        site = python.parents[1] / "lib" / PYVER / "site-packages"
        found = sorted(site.glob("torch-*.dist-info"))
        return found[0].name[len("torch-"):-len(".dist-info")] if found else None

    pinned = version(Path(sys.executable))
    caches = [Path(os.environ.get("COURSE_TORCH_VENVS", Path.home() / ".cache" / "scale-pytorch")),
              REPO.parent]
    chosen = os.environ.get("WHEELHOUSE_TEST_TORCH")  # a Python executable, if given
    candidates = [Path(chosen)] if chosen else []
    candidates += sorted(p for c in caches for p in c.glob("venv-torch*/bin/python"))
    for python in candidates:
        v = version(python)
        if v and v != pinned:
            return python, v
    return Path(sys.executable), pinned


def _build(wh: Path, offline: list[str]) -> float:
    """Step 1: the wheelhouse, from the local sources, with no network; its build time."""
    env = {**wheelhouse.offline_pip_env(), **_local_pip_sources()}
    start = time.monotonic()
    proc = subprocess.run([*offline, sys.executable, "-m", "autograder.gpu_check.wheelhouse",
                           "build", str(wh)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode and "No matching distribution" in proc.stdout + proc.stderr:
        pytest.skip("this machine's local package sources lack a package the wheelhouse needs "
                    "(tests never download):\n" + (proc.stdout + proc.stderr)[-1500:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return time.monotonic() - start


def _machine_python(tmp_path: Path) -> tuple[Path, Path, str]:
    """Step 2: a Python (a venv without pip over the base interpreter) whose site-packages
    holds only another install's torch, torchvision and their dependencies, as links."""
    other, version = _other_torch_python()
    machine = tmp_path / "machine"
    subprocess.run([Path(sys.base_prefix) / "bin" / PYVER, "-m", "venv", "--without-pip",
                    machine], check=True)
    site = machine / "lib" / PYVER / "site-packages"
    tops = subprocess.run([other, "-c", CLOSURE], capture_output=True, text=True,
                          check=True).stdout.split()
    for top in tops:
        (site / top).symlink_to(other.parents[1] / "lib" / PYVER / "site-packages" / top)
    print(f"the machine's torch: {version}, linked from {other}"
          + (" (no other torch found: the pinned one)" if other == Path(sys.executable) else ""))
    return machine / "bin" / "python", site, version


def _in_venv(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.full
@pytest.mark.slow
def test_offline_install_over_another_torch_runs_gpu_check(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed: the test runs `make gpu-check-offline`")
    offline = _offline()
    wh = tmp_path / "wheelhouse"
    built = _build(wh, offline)
    wheels = wheelhouse.wheels(wh)
    megabytes = sum(w.stat().st_size for w in wheels) / 1e6
    assert megabytes < wheelhouse.LIMIT_MB, [w.name for w in wheels]
    names = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in wheels}
    assert {"nbclient", "ipykernel", "matplotlib", "cloudpickle"} <= names
    assert not [n for n in names if wheelhouse.FORBIDDEN.match(n) or n in wheelhouse.LEFT_OUT]
    assert json.loads((wh / "wheelhouse.json").read_text())["wheels"] == [w.name for w in wheels]

    machine, site, torch_version = _machine_python(tmp_path)

    # 3. make gpu-check-offline, network off, CPU mode
    venv, out = tmp_path / "gpu-check-venv", tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run(
        [*offline, "make", "--no-print-directory", "gpu-check-offline", f"PYTHON={machine}",
         f"WHEELHOUSE={wh}", f"GPU_CHECK_VENV={venv}", f"GPU_CHECK_ARGS=--out {out}"],
        cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
        text=True, timeout=600)
    installed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"this machine's torch: {torch_version}" in proc.stdout
    assert "No CUDA GPU found" in proc.stdout
    report = json.loads((out / "gpu-report.json").read_text())
    assert report["exit_code"] == 0 and not report["failures"]
    assert report["environment"]["torch"].split("+")[0] == torch_version
    items = next(s for s in report["sections"] if s["key"] == "start")["items"]
    assert len(items) >= 10 and {i["status"] for i in items} == {"passed"}, items
    python = venv / "bin" / "python"
    where = _in_venv(python, "-c", "import torch, importlib.util as u; print(torch.__file__); "
                     "print(u.find_spec('nbgrader') is None, u.find_spec('jupyterlab') is None)")
    where = where.stdout.split()
    assert where[0].startswith(str(site)), where  # the machine's torch, not one in the venv
    assert not list(venv.glob(f"lib/{PYVER}/site-packages/torch*"))
    assert where[1:] == ["True", "True"] or _base_has("nbgrader", "jupyterlab"), where

    # 4. a notebook on the venv's kernel (as the lessons run), and A1's solution graded there
    start = time.monotonic()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import torch, matplotlib, tqdm, course.launch\n"
        f"assert torch.__version__.split('+')[0] == {torch_version!r}, torch.__version__")])
    nbformat.write(nb, tmp_path / "probe.ipynb")
    proc = _in_venv(python, "-c", "import os; from autograder.gpu_check import cli, lessons; "
                    "os.environ.update(cli.child_env()); "
                    f"r = lessons.run_lesson(cli.Path({str(tmp_path / 'probe.ipynb')!r})); "
                    "print(r['error'], r['cells_run'], r['code_cells'])")
    assert proc.stdout.split()[-3:] == ["None", "1", "1"], proc.stdout + proc.stderr
    proc = _in_venv(python, "-m", "autograder", "grade",
                    "solutions/a1_data_parallel/data_parallel.ipynb", "--speed", "skip",
                    "--report", str(tmp_path / "a1.json"))
    a1 = json.loads((tmp_path / "a1.json").read_text())
    assert proc.returncode == 0 and a1["score"] == a1["max_score"] > 0, proc.stdout[-3000:]
    assert f"torch {torch_version}" in a1["hardware"]
    graded = time.monotonic() - start
    print(f"wheelhouse: {len(wheels)} wheels, {megabytes:.1f} MB, built in {built:.1f} s from "
          f"local sources; make gpu-check-offline (venv, install, start-up checks): "
          f"{installed:.1f} s; a notebook and A1's grading: {graded:.1f} s")


def _base_has(*modules: str) -> bool:
    """Whether the base interpreter (under the stand-in machine's Python) has any of these:
    then they are visible in the venv through --system-site-packages, not from the wheelhouse."""
    code = "import importlib.util as u, sys; print(any(u.find_spec(m) for m in sys.argv[1:]))"
    return subprocess.run([Path(sys.base_prefix) / "bin" / PYVER, "-I", "-c", code, *modules],
                          capture_output=True, text=True).stdout.strip() == "True"
