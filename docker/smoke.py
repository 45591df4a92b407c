#!/usr/bin/env python3
"""Smoke test of the built course image (`make docker-smoke`): what tests/ cannot do without an engine.

It builds the image (the GPU variant where nvidia-smi lists a GPU, else the CPU one), then runs
the commands of docs/instructor.md, as they are written there (tests/test_docker.py checks that
they are), on a temporary folder:

- grade every assignment's released stub and reference solution: 0 points and full points;
- the same with the reference mounted: the report must say "solutions/ absent" (bubblewrap), same scores;
  without it the hidden checks of every assignment with an answer key are reserved ("checked
  when your instructor grades"), with it (the keys in solutions/) every one of them runs;
- the image holds no answer key (no ``answer_key.py`` anywhere in it);
- the student's lab on a work folder made from the student edition: healthy, the token is
  required, no solution is served, no instructor extension and no config warning in its log;

and removes what it started. Without a Docker engine it prints why and exits 0 (skipped).
Standard library only: it runs before `make install`.
"""
from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "course-lab"
TOKEN = "smoke-test-token"
KEY_FILE = "answer_key.py"  # autograder/keys.py (this script runs before make install)

# The commands of docs/instructor.md, for a CPU-only host (run from the repository root, with
# SUBMISSIONS, GRADES and COURSE_WORK_DIR set as the docs set them). On a GPU host the smoke test
# adds `--gpus all` and takes the :gpu image, as the docs' GPU sections do.
GRADE_RUN = (
    'docker run --rm --user "$(id -u):$(id -g)" --network none --cpus "$(nproc)" --memory 8g '
    '--pids-limit 4096 --shm-size 2g --read-only --tmpfs /tmp:size=4g -e HOME=/tmp '
    '-e COURSE_OFFLINE=1 --cap-drop ALL --security-opt no-new-privileges '
    '-v "$SUBMISSIONS":/submissions:ro -v "$GRADES":/grades scale-pytorch:cpu grade /submissions /grades')
REFERENCE_OPTIONS = (
    '--cap-add SETFCAP --security-opt seccomp=docker/seccomp-grade.json '
    '--security-opt systempaths=unconfined --security-opt apparmor=unconfined '
    '-v "$PWD/solutions":/opt/course/solutions:ro ')
GRADE_REFERENCE_RUN = GRADE_RUN.replace('-v "$SUBMISSIONS"', REFERENCE_OPTIONS + '-v "$SUBMISSIONS"')
LAB_RUN = (
    'docker run -d --name course-lab --user "$(id -u):$(id -g)" --cap-drop ALL '
    '--security-opt no-new-privileges --shm-size 2g -p 127.0.0.1:8888:8888 -e JUPYTER_TOKEN '
    '-v "$COURSE_WORK_DIR":/home/student/work scale-pytorch:cpu')
DOC_COMMANDS = {"grade": GRADE_RUN, "grade with the reference": GRADE_REFERENCE_RUN, "lab": LAB_RUN}

#: student: (notebook, assignment, full marks?): every assignment's released stub (zero) and
#: reference (full marks), so that each assignment's checks are proven inside the image.
SUBMISSIONS = {
    f"{a.name.split('_')[0]}_{kind}": (str(nb.relative_to(REPO)), a.name, kind == "solution")
    for a in sorted((REPO / "solutions").iterdir()) if a.is_dir()
    for kind, root in (("stub", "assignments"), ("solution", "solutions"))
    for nb in sorted((REPO / root / a.name).glob("*.ipynb"))[:1]
}


def _speed_checks() -> set[str]:
    """The ids of every spec's speed checks (``Check(..., speed=True)``), read from the specs'
    source: this script runs with the host's Python, without torch."""
    ids = set()
    for spec in REPO.glob("autograder/assignments/*/spec.py"):
        for node in ast.walk(ast.parse(spec.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Check" and any(
                    k.arg == "speed" and getattr(k.value, "value", False) is True
                    for k in node.keywords) and node.args and isinstance(node.args[0], ast.Constant):
                ids.add(node.args[0].value)
    return ids


#: Checks whose FAIL on a busy host says nothing about the image.
SPEED_CHECKS = _speed_checks()


class SmokeFailure(Exception):
    pass


def say(msg: str) -> None:
    print(f"docker-smoke: {msg}", flush=True)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise SmokeFailure(msg)
    say(f"ok   {msg}")


def sh(command: str, env: dict | None = None, timeout: float = 1800, quiet=False) -> str:
    """Run a shell command from the repository root; its output, or SmokeFailure."""
    if not quiet:
        say(f"$ {command}")
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if not quiet:
        print("\n".join("    " + line for line in out.strip().splitlines()[-15:]), flush=True)
    if proc.returncode not in (0, 3):  # 3: the grader says some notebook was not gradable
        raise SmokeFailure(f"exit {proc.returncode}: {command}\n{out[-3000:]}")
    return out


def engine_problem() -> str | None:
    if not shutil.which("docker"):
        return "no docker command on this host"
    proc = subprocess.run(["docker", "info"], capture_output=True, text=True)
    return None if proc.returncode == 0 else "no Docker engine answers (docker info failed)"


def adapt(command: str, variant: str, host_network: bool) -> str:
    """The docs' CPU command for this host: the GPU image and flag; host networking where the
    engine has no bridge network (then -p cannot publish: the lab listens on the host's port)."""
    if variant == "gpu":
        command = command.replace("docker run ", "docker run --gpus all ", 1)
        command = command.replace("scale-pytorch:cpu", "scale-pytorch:gpu")
    if host_network:
        command = command.replace("-p 127.0.0.1:8888:8888", "--network host -e PORT=8888")
    return command


def grade(command: str, grades: Path, env: dict, reference: bool) -> None:
    shutil.rmtree(grades, ignore_errors=True)
    grades.mkdir()
    started = time.monotonic()
    sh(command, env)
    with open(grades / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    say(f"graded {len(rows)} notebooks in {time.monotonic() - started:.0f} s")
    for student, (_, assignment, full) in SUBMISSIONS.items():
        row = rows.get(student)
        check(row is not None and row["status"] == "graded" and row["assignment"] == assignment,
              f"{student}: graded as {assignment}")
        score, top = float(row["score"]), float(row["max_score"])
        report = (grades / student / "output.txt").read_text().splitlines()
        # without the answer key (no solutions/ mounted) the hidden checks earn nothing: the
        # reference's full marks are the rest ("N more when your instructor grades")
        reserved_points = next((float(m.group(1)) for line in report if (m := re.search(
            r"(\d+(?:\.\d+)?) more when your instructor grades", line))), 0.0)
        full_marks = top - reserved_points
        want = f"{full_marks:g}/{top:g}" if full else f"0/{top:g}"
        if top <= 0 or score != (full_marks if full else 0):  # show the checks that decided it
            print("\n".join("    " + line for line in report
                            if full and " PASS " not in line or not full and " FAIL " not in line))
        if full and score < full_marks:
            # A speedup measured on a busy host can miss its threshold: that says nothing about
            # the image. Every other point must be there.
            timing = [line for line in report if " FAIL " in line
                      and line.split()[1:2] and line.split()[1] in SPEED_CHECKS]
            lost = sum(_points(line) for line in timing)
            if timing and score + lost == full_marks:
                say(f"WARN {student}: {score:g}/{top:g}: only timing checks failed (this host "
                    f"is busy): {', '.join(line.split()[1] for line in timing)}")
                score = full_marks
        check(top > 0 and score == (full_marks if full else 0),
              f"{student}: {score:g}/{top:g} (want {want})")
        reserved = reserved_points > 0
        if reference:
            check(not reserved, f"{student}: with solutions/ mounted, every hidden check ran")
        elif (REPO / "solutions" / assignment / KEY_FILE).exists():
            check(reserved, f"{student}: without the key, its hidden checks are reserved")
        isolation = [line for line in report if line.startswith("Isolation:")]
        if reference:
            check(any("solutions/ absent" in line for line in isolation),
                  f"{student}: {isolation[0] if isolation else 'no Isolation line'}")


def _points(line: str) -> float:
    """The points a check line of output.txt was worth: ``name: id   0/2   FAIL ...``."""
    match = re.search(r"\s(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)\s+(?:PASS|FAIL|SKIP)\s", line)
    return float(match.group(2)) if match else 0.0


def api(port: int, path: str, token: str | None) -> tuple[int, dict | list | None]:
    url = f"http://127.0.0.1:{port}{path}" + (f"?token={token}" if token else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, None


def served_paths(port: int, path: str = "") -> list[str]:
    """Every path the lab's contents API lists, recursively."""
    status, model = api(port, f"/api/contents/{path}", TOKEN)
    if status != 200 or not isinstance(model, dict):
        raise SmokeFailure(f"/api/contents/{path} answered {status}")
    paths = []
    for item in model.get("content") or []:
        paths.append(item["path"])
        if item["type"] == "directory":
            paths += served_paths(port, item["path"])
    return paths


def lab(command: str, work: Path, env: dict) -> None:
    sh(f"make -s docker-work COURSE_WORK_DIR={shlex.quote(str(work))}", env)
    sh(command, {**env, "JUPYTER_TOKEN": TOKEN})
    status = ""
    for _ in range(90):
        status = sh(f"docker inspect --format '{{{{.State.Health.Status}}}}' {NAME}", quiet=True).strip()
        if status in ("healthy", "unhealthy"):
            break
        time.sleep(2)
    check(status == "healthy", f"the lab container is {status or 'not running'}")
    check(api(8888, "/api/contents", None)[0] == 403, "/api/contents without the token: 403")
    paths = served_paths(8888)
    check(bool(paths) and any(p.startswith("assignments/") for p in paths),
          f"the lab serves {len(paths)} paths, the assignments among them")
    check(not [p for p in paths if "solutions" in p.split("/")], "no solutions/ folder is served")
    status, nb = api(8888, "/api/contents/assignments/a1_data_parallel/data_parallel.ipynb", TOKEN)
    text = json.dumps(nb)
    check(status == 200 and "BEGIN SOLUTION" not in text and "YOUR CODE HERE" in text,
          "the A1 notebook served is the released stub")
    log = sh(f"docker logs {NAME}", quiet=True)
    check("No nbgrader_config.py" not in log, "no 'No nbgrader_config.py file found' in the log")
    loaded = [line for line in log.splitlines() if "successfully loaded" in line]
    check(any("validate_assignment" in line for line in loaded)
          and not [line for line in loaded if "formgrader" in line or "course_list" in line],
          "nbgrader's validate_assignment loaded, no instructor extension (formgrader, course_list)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--torch-cpu-index", default="https://download.pytorch.org/whl/cpu",
                   help="where the CPU variant takes torch ('' for PyPI's wheels)")
    p.add_argument("--build-flags", default="", help="extra docker build flags")
    p.add_argument("--no-build", action="store_true", help="use the image already built")
    args = p.parse_args(argv)

    problem = engine_problem()
    if problem:
        say(f"SKIPPED: {problem}; run it on a host with Docker")
        return 0
    host_network = subprocess.run(["docker", "network", "inspect", "bridge"],
                                  capture_output=True).returncode != 0
    if host_network:
        say("this engine has no bridge network: the lab runs with --network host instead of -p")
    tmp = Path(tempfile.mkdtemp(prefix="docker-smoke-"))
    os.chmod(tmp, 0o755)
    env = {"SUBMISSIONS": str(tmp / "submissions"), "GRADES": str(tmp / "grades"),
           "COURSE_WORK_DIR": str(tmp / "work")}
    try:
        if not args.no_build:
            sh(f"make docker-build DOCKER_VARIANT={args.variant} "
               f"TORCH_CPU_INDEX={shlex.quote(args.torch_cpu_index)} "
               f"DOCKER_BUILD_FLAGS={shlex.quote(args.build_flags)}", timeout=3600)
        image = f"scale-pytorch:{args.variant}"
        # autograder/keys.py must be found (find ran), no answer key may be
        found = sh(f"docker run --rm --network none --entrypoint find {image} / -xdev "
                   f"\\( -name {KEY_FILE} -o -path '*/autograder/keys.py' \\) 2>/dev/null || true",
                   quiet=True).split()
        keys = [path for path in found if path.endswith(KEY_FILE)]
        check(any(path.endswith("autograder/keys.py") for path in found) and not keys,
              f"the image holds no answer key ({', '.join(keys) or 'none found'})")
        (tmp / "submissions").mkdir()
        for student, (notebook, _, _) in SUBMISSIONS.items():
            shutil.copy(REPO / notebook, tmp / "submissions" / f"{student}.ipynb")
        grade(adapt(GRADE_RUN, args.variant, host_network), tmp / "grades", env, reference=False)
        grade(adapt(GRADE_REFERENCE_RUN, args.variant, host_network), tmp / "grades", env,
              reference=True)
        lab(adapt(LAB_RUN, args.variant, host_network), tmp / "work", env)
    except (SmokeFailure, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {exc}")
        return 1
    finally:
        subprocess.run(["docker", "rm", "-f", NAME], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        say("removed the lab container and the temporary folder")
    say("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
