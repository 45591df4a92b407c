"""Gradings forked from a warm template: ``check()``, folder grading, nbgrader and the tests
stop paying for start-up (:func:`autograder.invoke.run_grader` comes here first).

A cold grading starts an interpreter, imports torch and the grader, then starts the sandbox's
worker, which imports torch again: seconds before the first line of a submission runs. Here a
process keeps a *grader template* (``python -m autograder.warm_server FOLDER``, one per
environment and set of cores), started by its first grading, which waits for it (about as long
as a cold start): the template imported torch and the grader once and holds the sandbox's own
warm template (:mod:`.sandbox.template`). Each grading is a fresh process forked from it,
running ``python -m autograder <args>`` as a cold one would, whose worker is forked fresh inside
bubblewrap.

What stays as it was: student code runs only in a worker, never in a template; each grading gets
new processes (its grader forked from a template no grading touched, its worker from a template
no student code touched), its own namespaces, ``/tmp``, ``/dev/shm``, work folder and cgroup;
the verdict is read from the report the forked grader writes. A template that does not start or
answer, died or was stopped is closed and replaced, and that grading runs cold, said in one line
(:attr:`autograder.invoke.GraderRun.note`); templates die with the process that started them
(a parent-death signal; bubblewrap's ``--die-with-parent``). ``AUTOGRADER_WARM=0`` turns the
warm path off. Memory while idle: about 0.7 GiB (PSS) per grader template with its sandbox
template (tests/test_warm_checks.py measures it and bounds it at 1.5 GiB).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack
from pathlib import Path

from .registry import REPO

WARM_ENV = "AUTOGRADER_WARM"
#: How long a check waits for a template that is still starting before it runs cold.
READY_WAIT_S = 30.0
#: Runs first in a grading process: pins it to the cores in argv[1], then becomes
#: ``python argv[2:]``; everything it starts (sandbox, ranks, a template) inherits the pinning.
#: (Not ``preexec_fn``, which is unsafe in a process with threads, as folder grading has.)
PIN = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
       "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


#: Variables that differ from one grading to the next and that nothing reads at import time:
#: a template serves gradings that differ only in these (each grading gets its own values).
VOLATILE = frozenset({"AUTOGRADER_RUN_TAG", "PYTEST_CURRENT_TEST", "TMPDIR", "_", "PWD",
                      "OLDPWD", "SHLVL", "COLUMNS", "LINES"})
#: How many grader templates a process keeps (one per environment and set of cores; folder
#: grading's jobs each have theirs). The least recently used goes first.
MAX_TEMPLATES = int(os.environ.get("AUTOGRADER_WARM_TEMPLATES", "2"))


class _Client:
    """This process's handle on one grader template: its environment, its cores."""

    def __init__(self, env: dict, cpus: list[int] | None) -> None:
        self.env = {k: v for k, v in env.items() if k not in VOLATILE}
        self.cpus = cpus
        self.lock = threading.Lock()  # one grading at a time per template
        self.folder = Path(tempfile.mkdtemp(prefix="autograder-warm-"))
        os.chmod(self.folder, 0o700)
        self.log = open(self.folder / "template.log", "wb")
        cmd = [sys.executable, "-m", "autograder.warm_server", str(self.folder)]
        if cpus:
            cmd = [sys.executable, "-c", PIN, ",".join(map(str, cpus)), *cmd[1:]]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self.ready = False

    def is_ready(self, wait: float = 0.0) -> bool:
        if not self.ready and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], wait)[0]:
                self.ready = self.proc.stdout.readline() == b"ready\n"
        return self.ready and self.proc.poll() is None

    def run(self, args: list[str], timeout: float, env: dict, on_start=None,
            separate: bool = False, tick=None) -> dict:
        """One grading (``python -m autograder <args> --report ...``) forked by the template;
        ``separate``: its stderr apart from its stdout. Raises OSError if the template fails."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="grader-run-") as tmp:
            report_path = Path(tmp, "report.json")
            paths = [Path(tmp, "stdout.txt"), Path(tmp, "stderr.txt")][:1 + separate]
            with socket.socket(socket.AF_UNIX) as conn, ExitStack() as files:
                outs = [files.enter_context(open(p, "wb")) for p in paths]
                conn.settimeout(5)
                conn.connect(str(self.folder / "grader.sock"))
                request = {"args": [*args, "--report", str(report_path)], "env": env,
                           "cwd": str(REPO)}
                fds = [outs[0].fileno(), outs[-1].fileno()]
                socket.send_fds(conn, [json.dumps(request).encode()], fds)
                pid = json.loads(_line(conn))["pid"]
                if on_start is not None:
                    on_start(pid)
                returncode, timed_out = _wait(conn, start + max(timeout, 1), tick), False
                if returncode is None:
                    _kill_grading(pid)
                    timed_out = True  # the template answers once it reaped it and killed
                    _wait(conn, time.monotonic() + 10, None)  # what its worker left
            texts = [p.read_text(errors="replace") for p in paths]
            try:
                report = json.loads(report_path.read_text())
                report = report if isinstance(report, dict) else None
            except (OSError, ValueError):
                report = None
        return {"report": report, "output": texts[0], "returncode": returncode,
                "timed_out": timed_out, "seconds": time.monotonic() - start,
                "error_output": texts[1] if separate else None}

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _wait(conn: socket.socket, deadline: float, tick) -> int | None:
    """The forked grading's exit code from its template, or None past ``deadline``;
    ``tick()`` a few times a second meanwhile."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(min(left, 0.25) if tick else left)
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            if tick is not None:
                tick()
            continue
        if not chunk:
            raise OSError("the grader template closed the connection")
        data += chunk
        if len(data) > 4096:
            raise OSError("the grader template's answer is too long")
    return json.loads(data)["returncode"]


def _kill_grading(pid: int) -> None:
    """A forked grading that ran out of time: its process group and descendants (its worker
    is the sandbox template's child: the template kills it when the grading has ended)."""
    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


def _line(conn: socket.socket, limit: int = 4096) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(limit)
        if not chunk:
            raise OSError("the grader template closed the connection")
        data += chunk
        if len(data) > limit:
            raise OSError("the grader template's answer is too long")
    return data


_CLIENTS: "OrderedDict[tuple, _Client]" = OrderedDict()
_CLIENTS_LOCK = threading.Lock()


def clients() -> list[_Client]:
    """This process's grader templates, the most recently used last."""
    return list(_CLIENTS.values())


def run_warm(args: list[str], *, timeout: float, env: dict, cpus: list[int] | None = None,
             on_start=None, separate: bool = False, tick=None) -> tuple[dict | None, str]:
    """``python -m autograder <args>``, forked by this process's grader template for ``env``
    and ``cpus`` (started now if there is none: the call waits for it, about as long as a cold
    start): ``(run, note)``, ``run`` the fields of :class:`autograder.invoke.GraderRun`.
    ``(None, note)`` when the caller must run it cold: the warm path
    is off (``AUTOGRADER_WARM=0``), or the template did not start or answer (``note`` says so
    in one line; a template that failed is closed, and the next call starts a new one)."""
    if os.environ.get(WARM_ENV, "1") == "0" or env.get(WARM_ENV, "1") == "0":
        return None, ""
    key = (tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE)),
           tuple(cpus or ()))
    note = ""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None and client.proc.poll() is not None:
            note = "grader template gone: started again"
            client.close()
            client = None
        if client is None:
            client = _CLIENTS[key] = _Client(env, cpus)
            while len(_CLIENTS) > max(MAX_TEMPLATES, 1):
                _CLIENTS.popitem(last=False)[1].close()
        _CLIENTS.move_to_end(key)
    with client.lock:
        if not client.is_ready(READY_WAIT_S):
            _forget(key, client)
            return None, note or "grader template did not start: this grading started cold"
        try:
            return client.run(args, timeout, env, on_start, separate, tick), note
        except (OSError, ValueError, KeyError) as exc:
            _forget(key, client)
            return None, f"grader template did not answer ({exc}): this grading started cold"


def _forget(key: tuple, client: _Client) -> None:
    with _CLIENTS_LOCK:
        if _CLIENTS.get(key) is client:
            del _CLIENTS[key]
    client.close()


def close_all() -> None:
    """Stop this process's grader templates (they also die with it)."""
    with _CLIENTS_LOCK:
        while _CLIENTS:
            _CLIENTS.popitem()[1].close()
