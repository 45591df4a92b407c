"""The warm path of ``check()``: a grader template per kernel, forked for each check.

A cold check starts an interpreter, imports torch and the grader, then starts the sandbox's
worker, which imports torch again: seconds of start-up before the first line of the submission
runs. Here the kernel keeps one *grader template* (``python -m autograder.warm FOLDER``), started
by its first ``check()`` (which waits for it: about as long as a cold check): it imported torch and
the grader once and holds the sandbox's own warm template (:mod:`.sandbox.template`). Each later
check is a fresh process forked from it, running ``python -m autograder`` as a cold one would,
whose worker is forked fresh inside bubblewrap.

What stays as it was: student code runs only in a worker, never in a template; each check gets
new processes (its grader forked from a template no check touched, its worker from a template no
student code touched), its own namespaces, ``/tmp``, ``/dev/shm``, work folder and cgroup; the
verdict is read from the report the forked grader writes. A template that does not answer, died
or was stopped is closed and replaced by a cold start, said in one line; the templates die with
the kernel (a parent-death signal; bubblewrap's ``--die-with-parent``). ``AUTOGRADER_WARM=0``
turns the warm path off. Memory while idle: about 0.7 GiB (PSS) for the two templates and
bubblewrap (tests/test_warm_checks.py measures it and bounds it at 1.5 GiB).
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .invoke import GraderRun
from .registry import REPO

WARM_ENV = "AUTOGRADER_WARM"
#: How long a check waits for a template that is still starting before it runs cold.
READY_WAIT_S = 30.0
#: What the grader template imports before it forks a grading.
PRELOAD = ("torch", "pytest", "autograder.cli", "autograder.checking.harness",
           "autograder.checking.probes", "autograder.sandbox", "autograder.submission")
_PR_SET_PDEATHSIG = 1


class _Client:
    """The kernel's handle on its grader template."""

    def __init__(self, env: dict) -> None:
        self.env = env
        self.folder = Path(tempfile.mkdtemp(prefix="autograder-warm-"))
        os.chmod(self.folder, 0o700)
        self.log = open(self.folder / "template.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autograder.warm", str(self.folder)], cwd=REPO, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
            start_new_session=True)
        self.started = time.monotonic()
        self.ready = False

    def is_ready(self, wait: float = 0.0) -> bool:
        if not self.ready and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], wait)[0]:
                self.ready = self.proc.stdout.readline() == b"ready\n"
        return self.ready and self.proc.poll() is None

    def run(self, args: list[str], timeout: float) -> GraderRun:
        """One grading, forked by the template; raises OSError if the template fails."""
        import psutil

        from .sandbox.isolation import kill_tree

        spare = {p.pid for p in psutil.Process().children(recursive=True)}
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="grader-run-") as tmp:
            report_path, out_path = Path(tmp, "report.json"), Path(tmp, "output.txt")
            with socket.socket(socket.AF_UNIX) as conn, open(out_path, "wb") as out:
                conn.settimeout(5)
                conn.connect(str(self.folder / "grader.sock"))
                request = {"args": [*args, "--report", str(report_path)], "env": self.env,
                           "cwd": str(REPO)}
                socket.send_fds(conn, [json.dumps(request).encode()], [out.fileno()])
                pid = json.loads(_line(conn))["pid"]
                conn.settimeout(max(timeout, 1))
                try:
                    returncode, timed_out = json.loads(_line(conn))["returncode"], False
                except TimeoutError:
                    kill_tree(pid, spare)  # the forked grader, its worker and their children
                    returncode, timed_out = None, True
            output = out_path.read_text(errors="replace")
            try:
                report = json.loads(report_path.read_text())
                report = report if isinstance(report, dict) else None
            except (OSError, ValueError):
                report = None
        return GraderRun(report, output, returncode, timed_out, time.monotonic() - start)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


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


_CLIENT: _Client | None = None


def run_warm(args: list[str], *, timeout: float, env: dict) -> tuple[GraderRun | None, str]:
    """The grading, forked by this process's grader template if it is ready: ``(run, note)``;
    ``(None, note)`` when the caller must run it cold (the template is starting, or was
    replaced: ``note`` says so in one line, or is empty)."""
    global _CLIENT
    if os.environ.get(WARM_ENV, "1") == "0":
        return None, ""
    note = ""
    if _CLIENT is not None and (_CLIENT.env != env or _CLIENT.proc.poll() is not None):
        note = ("grader template restarted: the environment changed" if _CLIENT.env != env
                else "grader template gone: started again")
        _CLIENT.close()
        _CLIENT = None
    if _CLIENT is None:  # its start takes about as long as a cold check; the next are fast
        _CLIENT = _Client(env)
    if not _CLIENT.is_ready(READY_WAIT_S):  # starting: it is ready sooner than a cold start
        return None, note or "grader template not ready: this check started cold"
    try:
        return _CLIENT.run(args, timeout), note
    except (OSError, ValueError, KeyError) as exc:
        _CLIENT.close()
        _CLIENT = None
        return None, f"grader template did not answer ({exc}): this check started cold"


# ------------------------------------------------------------------ the template process

def serve(folder: Path) -> None:
    import importlib

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with the kernel
    from .sandbox import template
    from .sandbox.isolation import isolation_mode, sandbox_user

    warm_sandbox = isolation_mode() == "bwrap" and sandbox_user() is None
    tpl = template.Template() if warm_sandbox else None  # first: its imports overlap ours
    for name in PRELOAD:
        importlib.import_module(name)
    _use(tpl)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / "grader.sock"))
    listener.listen(8)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    from .sandbox.zygote import wake_on_child_exit

    woken = wake_on_child_exit()  # a grading's end is answered at once
    waiting: dict[int, socket.socket] = {}
    while True:
        readable = select.select([listener, woken], [], [], 5)[0]
        if woken in readable:
            os.read(woken, 4096)
        if listener in readable:
            conn, _ = listener.accept()
            try:
                conn.settimeout(5)
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
                request = json.loads(msg)
                assert len(fds) == 1
            except (OSError, ValueError, AssertionError):
                conn.close()
                continue
            if warm_sandbox and (template.CURRENT is None or not template.CURRENT.alive()):
                if template.CURRENT is not None:  # killed or stopped by a grading: replaced
                    template.CURRENT.close()
                _use(template.Template())
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(woken)
                listener.close()
                for other in waiting.values():
                    other.close()
                _grade(request, fds[0], conn)
            os.close(fds[0])
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps(
                        {"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def _use(tpl) -> None:
    """Wait for the sandbox's template ``tpl`` and make it the one gradings fork from."""
    from .sandbox import template

    template.CURRENT = None
    if tpl is None:
        return
    try:
        tpl.wait_ready()
        template.CURRENT = tpl
    except template.TemplateUnavailable as exc:
        print(f"autograder.warm: {exc}", file=sys.stderr, flush=True)
        tpl.close()


def _grade(request: dict, out_fd: int, conn: socket.socket) -> None:
    """In the forked grader: ``python -m autograder <args>`` as a cold one would run it."""
    code = 1
    try:
        conn.close()
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from .cli import main

        code = main(request["args"]) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - said in the output the kernel reads
        print(f"autograder.warm: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
