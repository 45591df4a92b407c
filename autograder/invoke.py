"""Running the grader's CLI in a fresh process and reading back its JSON report: the one way
``check()`` in a notebook, folder grading, nbgrader and the tests call the grader.

A fresh process, because a notebook's kernel (or a grading loop) must not share its state with
the grading; on a timeout the whole process tree is killed (escaped processes included). Warm
by default: forked from a template that imported torch and the grader (:mod:`.warm`), else a
new interpreter."""
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
    error_output: str | None = None  # stderr apart, where the caller asked for it so
    note: str = ""             # one line when a warm grading had to start cold


def grader_env(env: dict | None = None) -> dict:
    """The grader's environment: ``env`` (default: this process's), this checkout first on
    PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_grader(args: list[str], *, timeout: float, env: dict | None = None,
               extra_outputs: dict[str, Path] | None = None, cpus: list[int] | None = None,
               on_start=None, warm: bool = True, separate: bool = False,
               progress=None) -> GraderRun:
    """``python -m autograder <args> --report <tmp>``; ``extra_outputs`` name more files the
    caller reads itself afterwards (they are written by the CLI as asked in ``args``).

    ``cpus``: pin the grader and all it starts to these cores (folder grading's jobs);
    ``on_start(pid)`` is called once the process runs, so that a caller can stop it.
    ``warm``: forked from this process's grader template (:mod:`.warm`; a fresh process all the
    same), else, or where that fails, a cold ``python -m autograder``. ``separate``: stderr in
    ``error_output``, apart from ``output``. ``progress(result)``: called with each check's
    result (a dict) as the grading reports it (``--progress``), before the report is read."""
    from .warm import run_warm

    env = grader_env(env)
    note = ""
    with tempfile.TemporaryDirectory(prefix="grader-progress-") as progress_dir:
        tick = None
        if progress is not None:
            reader = _ProgressReader(Path(progress_dir, "progress.jsonl"), progress)
            args, tick = [*args, "--progress", str(reader.path)], reader.poll
        if warm:
            fields, note = run_warm(args, timeout=timeout, env=env, cpus=cpus,
                                    on_start=on_start, separate=separate, tick=tick)
            if fields is not None:
                if tick is not None:
                    tick()
                return GraderRun(**fields, note=note)
        run = _run_cold(args, timeout, env, cpus, on_start, separate, tick)
    run.note = note
    return run


class _ProgressReader:
    """Hands each complete JSON line that a grading appended to ``path`` to ``callback``."""

    def __init__(self, path: Path, callback) -> None:
        self.path, self.callback, self.offset = path, callback, 0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        done = data[:data.rfind(b"\n") + 1]
        self.offset += len(done)
        for line in done.splitlines():
            try:
                self.callback(json.loads(line))
            except ValueError:
                pass


def _run_cold(args: list[str], timeout: float, env: dict, cpus, on_start, separate: bool,
              tick) -> GraderRun:
    """A new interpreter: ``python -m autograder <args> --report <tmp>``; ``tick()`` a few
    times a second while it runs."""
    import psutil

    from .sandbox.isolation import kill_tree
    from .warm import PIN

    with tempfile.TemporaryDirectory(prefix="grader-run-") as tmp:
        report_path = Path(tmp, "report.json")
        spare = {p.pid for p in psutil.Process().children(recursive=True)}
        start = time.monotonic()
        cmd = [sys.executable, "-m", "autograder", *args, "--report", str(report_path)]
        if cpus:
            cmd = [sys.executable, "-c", PIN, ",".join(map(str, cpus)), *cmd[1:]]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if separate else subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        if on_start is not None:
            on_start(proc.pid)
        deadline = start + timeout
        while True:
            try:
                output, errors = proc.communicate(
                    timeout=max(min(deadline - time.monotonic(), 0.25 if tick else timeout), 0))
                timed_out = False
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    kill_tree(proc.pid, spare)  # its group, every descendant, escaped ones too
                    output, errors = proc.communicate()
                    timed_out = True
                    break
                if tick is not None:
                    tick()
        if tick is not None:
            tick()
        try:
            report = json.loads(report_path.read_text())
            report = report if isinstance(report, dict) else None
        except (OSError, ValueError):
            report = None
    return GraderRun(report, output or "", proc.returncode, timed_out, time.monotonic() - start,
                     error_output=(errors or "") if separate else None)
