"""Running the grader's CLI in a fresh process and reading back its JSON report: the one way
``check()`` in a notebook, folder grading, nbgrader and the tests call the grader.

A fresh process, because a notebook's kernel (or a grading loop) must not share its state with
the grading; on a timeout the whole process tree is killed (escaped processes included)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .registry import REPO


@dataclass
class GraderRun:
    report: dict | None        # the JSON report, None if the grader wrote none
    output: str                # what it printed (stdout and stderr together)
    returncode: int | None
    timed_out: bool
    seconds: float


#: Runs first in the grader's process: pins it to the cores in argv[1], then becomes
#: ``python argv[2:]``; everything it starts (sandbox, ranks) inherits the pinning. (Not
#: ``preexec_fn``, which is unsafe in a process with threads, as folder grading has.)
_PIN = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def grader_env(env: dict | None = None) -> dict:
    """The grader's environment: ``env`` (default: this process's), this checkout first on
    PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_grader(args: list[str], *, timeout: float, env: dict | None = None,
               extra_outputs: dict[str, Path] | None = None, cpus: list[int] | None = None,
               on_start=None) -> GraderRun:
    """``python -m autograder <args> --report <tmp>``; ``extra_outputs`` name more files the
    caller reads itself afterwards (they are written by the CLI as asked in ``args``).

    ``cpus``: pin the grader and all it starts to these cores (folder grading's jobs);
    ``on_start(pid)`` is called once the process runs, so that a caller can stop it."""
    import psutil

    from .sandbox.isolation import kill_tree

    env = grader_env(env)
    with tempfile.TemporaryDirectory(prefix="grader-run-") as tmp:
        report_path = Path(tmp, "report.json")
        spare = {p.pid for p in psutil.Process().children(recursive=True)}
        start = time.monotonic()
        cmd = [sys.executable, "-m", "autograder", *args, "--report", str(report_path)]
        if cpus:
            cmd = [sys.executable, "-c", _PIN, ",".join(map(str, cpus)), *cmd[1:]]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
        if on_start is not None:
            on_start(proc.pid)
        try:
            output, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid, spare)  # its group, every descendant, escaped ones too
            output, _ = proc.communicate()
            timed_out = True
        try:
            report = json.loads(report_path.read_text())
            report = report if isinstance(report, dict) else None
        except (OSError, ValueError):
            report = None
    return GraderRun(report, output or "", proc.returncode, timed_out, time.monotonic() - start)
