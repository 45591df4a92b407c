"""The grader template of :mod:`autograder.warm`: ``python -m autograder.warm_server FOLDER``.

It imports torch and the grader, starts the sandbox's template (:mod:`.sandbox.template`) and
listens on ``FOLDER/grader.sock``. Each request (arguments, environment, working folder, and
the descriptors of the grading's stdout and stderr) is one fork, which runs ``python -m
autograder <args>`` as a cold process would (:func:`_grade`); the template answers the fork's
pid, then its exit code, and when a grading ends kills whatever its worker left in the
sandbox. It dies with the process that started it (a parent-death signal), replaces a sandbox
template that died or was stopped, and never runs student code.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

#: What the grader template imports before it forks a grading.
PRELOAD = ("torch", "pytest", "autograder.cli", "autograder.checking.harness",
           "autograder.checking.probes", "autograder.sandbox", "autograder.submission")
_PR_SET_PDEATHSIG = 1


def serve(folder: Path) -> None:
    import importlib

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with its starter
    from .sandbox import template
    from .sandbox.isolation import ended_children, isolation_mode, sandbox_user

    warm_sandbox = isolation_mode() == "bwrap" and sandbox_user() is None
    tpl = template.Template(folder) if warm_sandbox else None  # first: its imports overlap ours
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
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                request = json.loads(msg)
                assert len(fds) == 2
            except (OSError, ValueError, AssertionError):
                conn.close()
                continue
            if warm_sandbox and (template.CURRENT is None or not template.CURRENT.alive()):
                if template.CURRENT is not None:  # killed or stopped by a grading: replaced
                    template.CURRENT.close()
                _use(template.Template(folder))
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(woken)
                listener.close()
                for other in waiting.values():
                    other.close()
                _grade(request, fds[0], fds[1], conn)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        for pid, status in ended_children():  # gradings, and a sandbox template that died
            conn = waiting.pop(pid, None)
            if conn is None:
                continue
            if template.CURRENT is not None:  # whatever the grading's worker left behind
                template.CURRENT.kill_workers()
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


def _grade(request: dict, out_fd: int, err_fd: int, conn: socket.socket) -> None:
    """In the forked grader: ``python -m autograder <args>`` as a cold one would run it."""
    code = 1
    try:
        conn.close()
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None  # this grading's TMPDIR, not the one the template started with
        os.chdir(request["cwd"])
        from .cli import main

        code = main(request["args"]) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - said in the output the kernel reads
        print(f"autograder.warm: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        try:  # what a process's normal exit runs: multiprocessing's clean-up of its fork
            import atexit  # server and temporary folder, logging's flush

            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
