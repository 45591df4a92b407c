"""The Docker image on real hosts, without a Docker engine (issue 16): what make picks on a
CPU-only or GPU host, root and other users, the layer order, the students' lab (no solutions,
no instructor tools), and that docs/instructor.md shows the commands `make docker-smoke` runs.

The container checks themselves are in docker/smoke.py (`make docker-smoke`), which needs an
engine.

Tier: quick: file and make-variable checks, in seconds.
"""
from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from test_docker import CPU_INDEX, DOCKER, ENTRYPOINT, _env, instructions


# ---------------------------------------------------------------- Makefile, users, layers

def _make(*args: str) -> str:
    return subprocess.run(["make", "-s", "-n", *args], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_make_picks_the_variant_and_says_which():
    for variant in ("cpu", "gpu"):
        said = subprocess.run(["make", "-s", "docker-variant", f"DOCKER_VARIANT={variant}"],
                              cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert f"{variant.upper()} variant (scale-pytorch:{variant}" in said
        # the GPU image's torch is chosen from the driver (tests/test_docker_driver.py); given here
        grade = _make("docker-grade", f"DOCKER_VARIANT={variant}", "TORCH_GPU_INDEX=https://x/cu126")
        assert ("-f docker/compose.gpu.yaml" in grade) == (variant == "gpu")
        assert ("TORCH_GPU_INDEX=https://x/cu126" in grade) == (variant == "gpu")
        assert "compose.reference.yaml" not in grade
    assert "-f docker/compose.reference.yaml" in _make("docker-grade", "REFERENCE=1")
    found = subprocess.run(["bash", "-c", "nvidia-smi -L 2>/dev/null | grep -q '^GPU'"]).returncode == 0
    assert f"DOCKER_VARIANT={'gpu' if found else 'cpu'}" in _make("docker-smoke").replace(
        "--variant ", "DOCKER_VARIANT=")


def test_make_uses_the_host_cpus_and_user_and_bakes_no_uid():
    """Issue 16.2 and 16.4: no fixed CPU count, no uid build argument (UID=0 broke useradd)."""
    grade = _make("docker-grade")
    assert f"GRADE_CPUS={os.cpu_count()}" in grade or f"GRADE_CPUS={len(os.sched_getaffinity(0))}" in grade
    assert "COURSE_UID=$(id -u) COURSE_GID=$(id -g)" in grade
    build = _make("docker-build", "DOCKER_VARIANT=cpu")
    assert "UID" not in build and f"TORCH_INDEX={CPU_INDEX}" in build
    # the GPU index is chosen from the driver (tests/test_docker_driver.py); here it is given
    assert "--build-arg TORCH_INDEX= " in _make("docker-build", "DOCKER_VARIANT=gpu", "TORCH_GPU_INDEX=")


def test_dockerfile_has_nothing_user_specific_before_the_requirements():
    """Issue 16.6: another uid must not rebuild the PyTorch layer (nor is there a uid argument)."""
    ins = instructions()
    heavy = next(i for i, (w, a) in enumerate(ins) if w == "RUN" and "requirements.txt" in a)
    assert [a for w, a in ins[:heavy] if w == "ARG"] == ['TORCH_INDEX=""']
    assert not [a for w, a in ins if w == "ARG" and a.startswith("UID")]
    assert not [w for w, a in ins[:heavy] if w == "USER" or "useradd" in a]
    assert "chmod 1777 /home/student/work /grades" in " ".join(a for w, a in ins if w == "RUN")


def test_entrypoint_gives_an_unknown_user_a_home_and_a_name(offline_env):
    env = _env(offline_env, HOME="/")
    env.pop("USER", None)
    proc = subprocess.run(["bash", str(ENTRYPOINT), "bash", "-c", 'echo "$HOME|$USER"'],
                          env=env, capture_output=True, text=True, timeout=60)
    home, user = proc.stdout.strip().split("|")
    assert proc.returncode == 0 and home == f"/tmp/home-{os.getuid()}" and user


def _fake_jupyter(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "jupyter").write_text('#!/bin/sh\necho "jupyter $*"\n')
    (bin_dir / "jupyter").chmod(0o755)
    return bin_dir


def test_entrypoint_lab_allows_root_only_for_root(offline_env, tmp_path):
    env = _env(offline_env, COURSE_WORK=str(tmp_path / "w"), HOME=str(tmp_path),
               PATH=f"{_fake_jupyter(tmp_path)}:{offline_env['PATH']}")
    out = subprocess.run(["bash", str(ENTRYPOINT), "lab"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("jupyter lab") and ("--allow-root" in out) == (os.getuid() == 0)


def test_lab_on_the_make_work_folder_serves_no_solutions(offline_env, tmp_path):
    """Issue 16.5: make docker-work fills the lab's folder from the student edition; the lab
    serves its root_dir, and nothing under it is a solution."""
    work = tmp_path / "work"
    subprocess.run(["make", "-s", "docker-work", f"COURSE_WORK_DIR={work}",
                    f"PYTHON={sys.executable}"], cwd=REPO, check=True, timeout=300,
                   capture_output=True)
    env = _env(offline_env, COURSE_WORK=str(work), HOME=str(tmp_path),
               PATH=f"{_fake_jupyter(tmp_path)}:{offline_env['PATH']}")
    out = subprocess.run(["bash", str(ENTRYPOINT), "lab"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    root = Path(re.search(r"--ServerApp.root_dir=(\S+)", out).group(1))
    served = [p.relative_to(root).as_posix() for p in root.rglob("*")]
    assert "assignments/a1_data_parallel/data_parallel.ipynb" in served
    assert not [p for p in served if "solutions" in p.split("/")]
    for nb in root.rglob("*.ipynb"):
        assert "### BEGIN SOLUTION" not in nb.read_text(), nb
    (work / "mine.txt").write_text("student work")
    subprocess.run(["make", "-s", "docker-work", f"COURSE_WORK_DIR={work}"], cwd=REPO, check=True)
    assert (work / "mine.txt").read_text() == "student work", "make must not replace their work"


def test_student_jupyter_config_turns_off_instructor_tools(tmp_path):
    """Issue 16.7: the image's config dir = pip's nbgrader.json (.d) + docker/jupyter/."""
    from jupyter_server.extension.config import ExtensionConfigManager

    conf = tmp_path / "etc-jupyter"
    (conf / "jupyter_server_config.d").mkdir(parents=True)
    (conf / "jupyter_server_config.d" / "nbgrader.json").write_text(json.dumps({"ServerApp": {
        "jpserver_extensions": {f"nbgrader.server_extensions.{e}": True for e in
                                ("formgrader", "validate_assignment", "assignment_list", "course_list")}}}))
    shutil.copytree(DOCKER / "jupyter", conf, dirs_exist_ok=True)
    enabled = ExtensionConfigManager(read_config_path=[str(conf)]).get_jpserver_extensions()
    nbg = {k.rsplit(".", 1)[1]: v for k, v in enabled.items() if k.startswith("nbgrader")}
    assert nbg == {"formgrader": False, "assignment_list": False, "course_list": False,
                   "validate_assignment": True}
    page = json.loads((conf / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"]["@jupyter/nbgrader:formgrader"] is True
    assert (conf / "nbgrader_config.py").exists()
    assert "docker/jupyter/." in " ".join(a for w, a in instructions() if w == "RUN")


# ---------------------------------------------------------------- the smoke test and the docs

def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


def test_docs_show_the_commands_the_smoke_test_runs():
    smoke = runpy.run_path(str(DOCKER / "smoke.py"))
    docs = _flat((REPO / "docs" / "instructor.md").read_text())
    for what, command in smoke["DOC_COMMANDS"].items():
        assert _flat(command) in docs, f"docs/instructor.md lacks the smoke test's {what} command"
    for host in ("CPU-only laptop", "GPU workstation", "cloud GPU instance"):
        assert host in docs
    assert "--cpus 8" not in docs and '--cpus "$(nproc)"' in docs
    assert '-v "$PWD":/home/student/work' not in docs, "the lab must not mount the repository"


def test_smoke_test_skips_without_an_engine(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    proc = subprocess.run([sys.executable, str(DOCKER / "smoke.py")], capture_output=True,
                          text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert proc.returncode == 0 and "SKIPPED: no Docker engine answers" in proc.stdout


def test_smoke_test_grades_every_assignments_reference_and_stub():
    """`make docker-smoke` proves every assignment inside the image, not only some, and forgives
    a busy host exactly the speed checks the specs declare (it reads them without torch)."""
    from autograder.checking.spec import load_spec

    smoke = runpy.run_path(str(DOCKER / "smoke.py"))
    assignments = sorted(p.name for p in (REPO / "solutions").iterdir() if p.is_dir())
    graded = {(assignment, full) for _, assignment, full in smoke["SUBMISSIONS"].values()}
    assert graded == {(a, full) for a in assignments for full in (True, False)}
    for notebook, _, _ in smoke["SUBMISSIONS"].values():
        assert (REPO / notebook).is_file(), notebook
    declared = {c.name for a in assignments for c in load_spec(a).checks if c.speed}
    assert smoke["SPEED_CHECKS"] == declared
