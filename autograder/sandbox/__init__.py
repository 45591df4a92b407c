"""Run untrusted student code in a child process that the grader fully controls.

The grader process (parent) never executes student code. It starts a *worker* child
(:mod:`autograder.sandbox.worker`) that executes the student's cells, then asks it to run *probes*:
small trusted functions from a check module that call a student function on inputs the parent
chose and hand back what it returned. The parent then judges those values itself.

What the parent guarantees, whatever the student code does:
- Replies are read with ``torch.load(weights_only=True)``: plain tensors, numbers, strings,
  lists, dicts. Nothing the child sends can run code in the parent or smuggle a tensor subclass.
- Each call has a timeout. On timeout, crash, exit or a resource limit, the whole process tree
  is killed (the worker's process group, every descendant, and any process that escaped with
  ``setsid``: the grader is a child subreaper, so orphans come back to it), and the next call
  starts a fresh worker.
- The child's environment is scrubbed, its working directory is an empty temporary folder,
  and its output goes to a file of which only a bounded tail is ever read.
- Replies are bounded: a frame larger than :data:`framing.MAX_REPLY_BYTES` is refused before it
  is read (:class:`BadReply`), so the grader's memory stays bounded whatever the child sends.
- The worker runs without privilege: in bubblewrap's namespaces where it runs
  (:mod:`.policy`: uid 65534, no capabilities, ``solutions/`` absent, a read-only file system
  but its scratch folder, its own PID, IPC and network namespaces), with a seccomp filter and
  ``no_new_privs`` everywhere (:mod:`.confine`, verified from outside), and in a cgroup of its
  own where the machine allows one (:mod:`.cgroup`). docs/grading.md says what each setting
  gets; the report's ``Isolation:`` line says what this one got.
"""
from __future__ import annotations

import functools
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from course.launch import PRELOAD_ENV

from ..registry import REPO
from . import cgroup as cgroups
from . import framing, template
from .framing import WARM_RANKS_ENV, decode_reply, read_frame, write_frame
from .isolation import (UNSHARE, become_subreaper, check_confinement, isolation_mode, kill_tree,
                        FORKED, note_cgroup, note_cold_start, sandbox_user)
from .policy import NEVER as HIDDEN  # parts of the repository graded code never sees
from .policy import TMPFS_BYTES

OUTPUT_TAIL_BYTES = 4000          # how much of the child's output a message may quote
MAX_OUTPUT_FILE_BYTES = 64 << 20  # the child's output file may not grow past this
DEFAULT_MAX_PROCESSES = int(os.environ.get("AUTOGRADER_MAX_PROCESSES", "64"))
DEFAULT_MAX_MEMORY_BYTES = int(os.environ.get("AUTOGRADER_MAX_MEMORY_MB", "6144")) << 20
#: Upper bound on any one call's timeout (seconds), e.g. to grade many submissions quickly.
MAX_CALL_TIMEOUT = float(os.environ.get("AUTOGRADER_MAX_CALL_TIMEOUT", "inf"))
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
             "CUDA_HOME", "LD_LIBRARY_PATH", "COURSE_FULL", "TZ", "AUTOGRADER_RUN_TAG",
             "COURSE_PORTS")


class SandboxError(Exception):
    """The student code did not give an answer; ``str()`` says why, for the student."""


class CallTimeout(SandboxError):
    pass


class ChildExited(SandboxError):
    pass


class LimitExceeded(SandboxError):
    pass


class StudentError(SandboxError):
    """The student function raised; the message holds its exception and traceback tail."""


class BadReply(SandboxError, framing.BadReply):
    """The child replied with something the grader does not accept."""


# ---------------------------------------------------------------- the sandbox

@dataclass
class Limits:
    max_processes: int = DEFAULT_MAX_PROCESSES
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES
    load_timeout: float = 60.0


@dataclass
class Sandbox:
    """A restartable worker holding the student's code.

    ``cells`` is a list of ``(cell_id, python_source)`` executed in order in a fresh namespace;
    ``objects`` (optional) is a cloudpickle of ``{name: object}`` added to that namespace (the
    notebook bridge grades what a kernel defined this way).
    """

    cells: list[tuple[str, str]]
    objects: bytes | None = None
    limits: Limits = field(default_factory=Limits)
    #: modules the checks' ranks import (the spec's ``rank_modules``): with a tuple, the worker
    #: starts the ranks' fork server as it starts, preloading them; None: no ranks expected
    rank_modules: tuple[str, ...] | None = None
    cell_errors: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _spare: set[int] = field(default_factory=set)
    _cgroup: cgroups.Cgroup | None = None
    _loading: threading.Thread | None = None
    _template: object | None = None  # the warm template the worker came from, if any
    _work: Path | None = None        # its work folder there

    # -- lifecycle
    def start(self) -> None:
        """Start the worker and wait until it has loaded the cells."""
        self.begin_start()
        self.finish_start()

    @property
    def loading(self) -> bool:
        """Started by :meth:`begin_start`, not yet finished by :meth:`finish_start`."""
        return self._loading is not None

    def begin_start(self) -> None:
        """Start the worker and send it the cells, without waiting: it imports torch and runs
        them while the grader gets ready (each import of torch costs seconds of one core)."""
        become_subreaper()
        self._spare = {p.pid for p in psutil.Process().children(recursive=True)}
        self._dir = Path(tempfile.mkdtemp(prefix="sandbox-"))
        os.chmod(self._dir, 0o700)
        work = self._dir / "work"
        work.mkdir()
        self._out_path = self._dir / "output.txt"
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
        env.update(HOME=str(work), TMPDIR=str(work), PYTHONDONTWRITEBYTECODE="1",
                   OMP_NUM_THREADS=os.environ.get("AUTOGRADER_THREADS", "1"),
                   PYTHONNOUSERSITE="1", MPLBACKEND="Agg", COURSE_OFFLINE="1",
                   PYTHONPATH=str(REPO))  # the worker runs this same grader's code
        if self.rank_modules is not None:
            env[WARM_RANKS_ENV] = "1"
            env[PRELOAD_ENV] = ",".join(self.rank_modules)
        cmd = [sys.executable, "-m", "autograder.sandbox.worker", str(req_r), str(rep_w)]
        mode = isolation_mode()
        # the kernel's limits sit above the watchdog's (which names what was exceeded): they
        # stop what polling cannot see or catch in time (shared memory, a fast fork bomb)
        # tasks: the kernel counts threads too (a gloo rank of torch runs a dozen or more)
        self._cgroup = cgroups.make(self.limits.max_memory_bytes * 5 // 4 + (256 << 20),
                                    self.limits.max_processes * 64)
        note_cgroup(self._cgroup is not None)
        if mode == "bwrap" and template.CURRENT is not None and sandbox_user() is None:
            try:
                self._start_forked(template.CURRENT, env, req_r, rep_w)
                return
            except template.TemplateUnavailable as exc:  # not asked again by this grading;
                template.CURRENT = None                  # the warm grader replaces it
                note_cold_start(str(exc))
        if mode == "bwrap":
            from .policy import bwrap_command

            cmd = [*bwrap_command(work), *cmd]
        elif mode == "unshare":
            cmd = [*UNSHARE, *cmd]
            env["AUTOGRADER_HIDE"] = os.pathsep.join(
                str(p) for p in [REPO / n for n in HIDDEN] if p.exists())
            env["AUTOGRADER_WRITABLE"] = str(work)
        as_user = {}
        if (user := sandbox_user()) is not None:  # root grading: graded code runs as user
            os.chmod(self._dir, 0o711)  # it may enter, not list nor change, the grader's folder
            os.chown(work, user.pw_uid, user.pw_gid)
            as_user = dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
            if self._cgroup is not None:
                self._cgroup.allow(user.pw_uid, user.pw_gid)
        with open(self._out_path, "wb") as out:
            self._proc = subprocess.Popen(
                cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                pass_fds=(req_r, rep_w), start_new_session=True,
                preexec_fn=functools.partial(_child_limits, self._cgroup), **as_user)
        os.close(req_r)
        os.close(rep_w)
        self._send_load()

    def _start_forked(self, tpl, env: dict, req_r: int, rep_w: int) -> None:
        """The worker forked by the sandbox's warm template (:mod:`.template`), in a work folder
        of the template's scratch; into the cgroup before it may run anything."""
        self._work = tpl.new_work_folder()
        env.update(HOME=str(self._work), TMPDIR=str(self._work))
        with open(self._out_path, "wb") as out:
            self._proc = tpl.spawn(self._work, env, out.fileno(), req_r, rep_w,
                                   TMPFS_BYTES, MAX_OUTPUT_FILE_BYTES)
        self._template = tpl
        FORKED.append(True)
        os.close(req_r)
        os.close(rep_w)
        if self._cgroup is not None:
            self._cgroup.add(self._proc.pid)
        _go_ahead(self._req_w)
        self._send_load()

    def _send_load(self) -> None:
        self._load_deadline = time.monotonic() + self.limits.load_timeout
        # written from a thread: the cells may not fit in the pipe before the worker reads
        request = pickle.dumps({"op": "load", "cells": self.cells, "objects": self.objects})
        self._loading = threading.Thread(target=_write_quietly, args=(self._req_w, request),
                                         daemon=True)
        self._loading.start()

    def finish_start(self) -> None:
        """Wait until the worker started by :meth:`begin_start` has loaded the cells."""
        writer, self._loading = self._loading, None
        if writer is None:
            return
        timeout = max(self._load_deadline - time.monotonic(), 0.1)
        writer.join(timeout)
        reply = self._request(None, timeout, "loading your notebook's code")
        check_confinement(self._proc.pid, forked=self._template is not None)
        self.cell_errors = dict(reply.get("cell_errors", {}))

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        writer, self._loading = self._loading, None
        if self._proc is not None:
            kill_tree(self._proc.pid, self._spare)
            if self._template is not None:  # and what it left in the template's sandbox
                self._template.kill_workers()
            if writer is not None:  # its pipe's reader is gone: the write ends at once
                writer.join(timeout=5)
            for fd in (self._req_w, self._rep_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None
            shutil.rmtree(self._dir, ignore_errors=True)
            if self._work is not None:
                shutil.rmtree(self._work, ignore_errors=True)
            self._template = self._work = None
            if self._cgroup is not None:
                self._cgroup.remove()
                self._cgroup = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- calls
    def call(self, probe, *args, timeout: float = 30.0):
        """Run ``probe(namespace, *args)`` in the worker; return its (plain-data) result.

        ``probe`` must be a module-level function of an importable trusted module; it is sent
        by name. Raises a :class:`SandboxError` subclass with a student-readable message.
        """
        if self.loading:
            self.finish_start()
        if not self.alive():
            self.close()
            self.start()
        msg = {"op": "call", "module": probe.__module__, "probe": probe.__qualname__, "args": args}
        reply = self._request(msg, min(timeout, MAX_CALL_TIMEOUT), f"{probe.__qualname__}")
        if not reply.get("ok"):
            raise StudentError(reply.get("error", "the function raised an exception"))
        return reply.get("value")

    def output_tail(self, limit: int = OUTPUT_TAIL_BYTES) -> str:
        try:
            with open(self._out_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except (OSError, AttributeError):
            return ""

    def _request(self, msg, timeout, what):
        """Send ``msg`` (None: it was sent already) and read the reply within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            if msg is not None:
                write_frame(self._req_w, pickle.dumps(msg))
            data = read_frame(self._rep_r, deadline, self._watchdog, framing.MAX_REPLY_BYTES)
            self._watchdog()  # a call that returned fast must not leave limits broken behind
        except TimeoutError:
            self.close()
            raise CallTimeout(f"timed out after {timeout:g} s ({what})") from None
        except (EOFError, BrokenPipeError, OSError):
            code = self._exit_code()
            if self._cgroup is not None and self._cgroup.oom_killed():
                self.close()
                raise LimitExceeded(
                    f"stopped: your code used more than {self.limits.max_memory_bytes / 2**30:.1f}"
                    f" GiB of memory, shared memory included ({what})") from None
            tail = self.output_tail(800).strip()
            self.close()
            raise ChildExited(f"the process running your code exited with code {code} "
                              f"({what})" + (f"; its last output:\n{tail}" if tail else "")) from None
        except LimitExceeded:
            self.close()
            raise
        except framing.BadReply as exc:  # a frame past the cap: the rest is never read
            self.close()
            raise BadReply(str(exc)) from None
        try:
            reply = decode_reply(data)
        except framing.BadReply as exc:
            raise BadReply(str(exc)) from None
        if not isinstance(reply, dict):
            raise BadReply("the worker's reply was tampered with")
        return reply

    def _exit_code(self):
        try:
            return self._proc.wait(timeout=2)
        except Exception:
            return "unknown"

    def _watchdog(self):
        """Called a few times a second while waiting: enforce process and memory limits."""
        try:
            root = psutil.Process(self._proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        if len(tree) > self.limits.max_processes:
            raise LimitExceeded(f"stopped: your code started more than "
                                f"{self.limits.max_processes} processes")
        if _memory(tree, lambda p: p.memory_info().rss) > self.limits.max_memory_bytes and \
                _memory(tree, lambda p: p.memory_full_info().pss) > self.limits.max_memory_bytes:
            # RSS is cheap but counts pages that forked processes share; PSS splits them fairly
            raise LimitExceeded(f"stopped: your code used more than "
                                f"{self.limits.max_memory_bytes / 2**30:.1f} GiB of memory")


def _go_ahead(fd: int) -> None:
    """The go-ahead a forked worker waits for (it is in its cgroup now)."""
    os.write(fd, b"g")


def _write_quietly(fd: int, data: bytes) -> None:
    """One frame to the worker; if it died meanwhile, reading its reply says so."""
    try:
        write_frame(fd, data)
    except OSError:
        pass


def _memory(tree, measure) -> int:
    total = 0
    for p in tree:
        try:
            total += measure(p)
        except psutil.Error:
            pass
    return total


def _child_limits(group: cgroups.Cgroup | None = None):
    """Runs in the child before exec: into its cgroup, no core dumps, a bounded output file."""
    import resource

    if group is not None:
        group.join_self()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_OUTPUT_FILE_BYTES, MAX_OUTPUT_FILE_BYTES))
