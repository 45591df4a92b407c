"""The grader's side of the sandbox's warm template (:mod:`.zygote`): start it in bubblewrap,
ask it for a worker, and treat what it forks like a process the grader started itself.

:data:`CURRENT` is set by the warm grader (:mod:`autograder.warm`) in its template process,
before it forks a grading: a :class:`~autograder.sandbox.Sandbox` started while it is set (and
bubblewrap is the isolation) takes its worker from the template, else starts one cold. A
template that does not answer within :data:`ANSWER_S` is closed and never asked again; the
sandbox then starts cold and the grading says so in one line.
"""
from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from ..registry import REPO
from .policy import bwrap_command

#: bubblewrap's ``--cap-add`` for the template (its user namespace only): to make each worker's
#: namespaces and mounts (:func:`.zygote._become_worker`), and to drop its bounding set.
CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP")
#: How long the template may take to fork a worker (it takes milliseconds).
ANSWER_S = 5.0
#: How long its start may take (an interpreter, torch and the worker's code).
START_S = 120.0
CURRENT: "Template | None" = None


class TemplateUnavailable(Exception):
    """The template did not answer; the sandbox starts a cold worker instead."""


class Template:
    """The sandbox's template process, started in bubblewrap by :meth:`start`."""

    def __init__(self, base: Path | None = None) -> None:
        """``base``: the folder for its scratch and log (default: the temporary folder); the
        warm grader gives its own, so that a grading's ``TMPDIR`` holds nothing of it."""
        self.scratch = Path(tempfile.mkdtemp(prefix="sandbox-template-", dir=base))
        os.chmod(self.scratch, 0o711)  # graded code may enter its own folder, not list others
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control = ours
        env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES",
                                          "NVIDIA_VISIBLE_DEVICES", "CUDA_HOME",
                                          "LD_LIBRARY_PATH", "TZ") if k in os.environ}
        env.update(PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1",
                   OMP_NUM_THREADS="1", HOME=str(self.scratch), MPLBACKEND="Agg")
        cmd = bwrap_command(self.scratch)
        caps = [arg for cap in CAPABILITIES for arg in ("--cap-add", cap)]
        cmd = [*cmd[:cmd.index("--cap-drop") + 2], *caps, *cmd[cmd.index("--cap-drop") + 2:]]
        cmd += [sys.executable, "-m", "autograder.sandbox.zygote", str(theirs.fileno())]
        self.log = Path(tempfile.mkdtemp(prefix="sandbox-template-log-", dir=base)) / "output.txt"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, pass_fds=(theirs.fileno(),),
                                         start_new_session=True)
        theirs.close()
        self.pid: int | None = None  # the template's pid here (the sandbox has its own)

    def wait_ready(self, timeout: float = START_S) -> None:
        self.control.settimeout(timeout)
        try:
            if self._line() != {"ready": True}:
                raise TemplateUnavailable("the sandbox's template did not start")
        except (OSError, ValueError) as exc:
            tail = self.log.read_text(errors="replace")[-300:].strip()
            raise TemplateUnavailable(f"the sandbox's template did not start ({exc}"
                                      + (f": {tail}" if tail else "") + ")") from None
        finally:
            self.control.settimeout(None)
        zygotes = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                   if p.cmdline()[1:3] == ["-m", "autograder.sandbox.zygote"]]
        if not zygotes:
            raise TemplateUnavailable("the sandbox's template is not running")
        self.pid = zygotes[0].pid

    def _line(self) -> dict:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.control.recv(4096)
            if not chunk:
                raise OSError("the template closed its socket")
            data += chunk
            if len(data) > 4096:
                raise ValueError("the template's answer is too long")
        text = data.decode().strip()
        return {"ready": True} if text == "ready" else json.loads(text)

    def alive(self) -> bool:
        """Running and not stopped (asked from the process that started it or a fork of it)."""
        if self.pid is None:
            return False
        try:
            return psutil.Process(self.pid).status() not in (
                psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, psutil.STATUS_STOPPED,
                psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            return False

    def new_work_folder(self) -> Path:
        work = self.scratch / secrets.token_hex(8)
        work.mkdir(mode=0o700)
        return work

    def spawn(self, work: Path, env: dict, out_fd: int, req_r: int, rep_w: int,
              tmpfs_bytes: int, max_output_bytes: int) -> "ForkedWorker":
        """A fresh worker forked by the template, in its own namespaces; raises
        :class:`TemplateUnavailable` if the template does not answer."""
        if not self.alive():
            raise TemplateUnavailable("the sandbox's template is gone")
        status_r, status_w = os.pipe()
        request = {"work": str(work), "env": env, "cpus": sorted(os.sched_getaffinity(0)),
                   "tmpfs_bytes": tmpfs_bytes, "max_output_bytes": max_output_bytes}
        self.control.settimeout(ANSWER_S)
        try:
            socket.send_fds(self.control, [json.dumps(request).encode()],
                            [req_r, rep_w, out_fd, status_w])
            answer = self._line()
        except (OSError, ValueError) as exc:
            os.close(status_r)
            raise TemplateUnavailable(f"the sandbox's template did not answer ({exc})") from None
        finally:
            os.close(status_w)
            if self.control.fileno() >= 0:
                self.control.settimeout(None)
        host_pid = self._host_pid(answer.get("pid"))
        if host_pid is None:
            os.close(status_r)
            raise TemplateUnavailable("the sandbox's template forked no worker")
        return ForkedWorker(host_pid, status_r)

    def _host_pid(self, sandbox_pid) -> int | None:
        """This side's pid of the template's child ``sandbox_pid`` (``NSpid`` in its status)."""
        for child in psutil.Process(self.pid).children():
            try:
                ns = Path(f"/proc/{child.pid}/status").read_text().split("NSpid:")[1].split("\n")[0]
            except (OSError, IndexError):
                continue
            if ns.split()[-1] == str(sandbox_pid):
                return child.pid
        return None

    def kill_workers(self) -> None:
        """Kill every process of the sandbox but the template (and bubblewrap's init): what a
        grading left behind, re-parented there after ``setsid`` or a double fork included."""
        if self.pid is None:
            return
        try:
            keep = {self.pid, *(p.pid for p in psutil.Process(self.pid).parents())}
        except psutil.Error:
            return
        for _ in range(50):
            try:
                inside = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                return
            victims = [p for p in inside if p.pid not in keep]
            if not victims:
                return
            for p in victims:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            psutil.wait_procs(victims, timeout=1)

    def close(self) -> None:
        try:
            self.control.close()
        except OSError:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.pid = None
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(self.log.parent, ignore_errors=True)


class ForkedWorker:
    """What :class:`~autograder.sandbox.Sandbox` needs of ``subprocess.Popen`` (``pid``,
    ``poll``, ``wait``) for a worker the template forked: its exit status comes over a pipe."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid, self._status_fd, self.returncode = pid, status_fd, None

    def poll(self):
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None):
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._status_fd], [], [], timeout)
        if not ready:
            if timeout:
                raise subprocess.TimeoutExpired("worker", timeout)
            return None
        data = os.read(self._status_fd, 4)
        os.close(self._status_fd)
        status = struct.unpack("i", data)[0] if len(data) == 4 else 0
        self.returncode = (os.waitstatus_to_exitcode(status) if len(data) == 4 else -9)
        return self.returncode

