"""Run untrusted student code in a child process that the grader fully controls.

The grader process (parent) never executes student code. It starts a *worker* child
(:mod:`autograder.worker`) that executes the student's cells, then asks it to run *probes*:
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
- Where Linux user namespaces are available, the worker also runs in its own user, mount,
  network and PID namespaces: no network but its own loopback, ``solutions/`` hidden behind an
  empty mount, every file system read-only but its own work folder, no view of the grader's
  processes, and every process it started dies with it.
"""
from __future__ import annotations

import ctypes
import io
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
OUTPUT_TAIL_BYTES = 4000          # how much of the child's output a message may quote
MAX_OUTPUT_FILE_BYTES = 64 << 20  # the child's output file may not grow past this
DEFAULT_MAX_PROCESSES = int(os.environ.get("AUTOGRADER_MAX_PROCESSES", "64"))
DEFAULT_MAX_MEMORY_BYTES = int(os.environ.get("AUTOGRADER_MAX_MEMORY_MB", "6144")) << 20
#: Upper bound on any one call's timeout (seconds), e.g. to grade many submissions quickly.
MAX_CALL_TIMEOUT = float(os.environ.get("AUTOGRADER_MAX_CALL_TIMEOUT", "inf"))
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
             "CUDA_HOME", "LD_LIBRARY_PATH", "COURSE_FULL", "TZ", "AUTOGRADER_RUN_TAG")


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


class BadReply(SandboxError):
    """The child replied with something the grader does not accept."""


# ---------------------------------------------------------------- framing (length-prefixed)

def write_frame(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_frame(fd: int, deadline: float | None = None, on_wait=None) -> bytes:
    """Read one frame; ``on_wait`` is called while waiting (the parent's watchdog)."""
    header = _read_exact(fd, 8, deadline, on_wait)
    (size,) = struct.unpack("<Q", header)
    return _read_exact(fd, size, deadline, on_wait)


def _read_exact(fd, size, deadline, on_wait):
    chunks, got = [], 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], min(left, 0.05))
            if not ready:
                if on_wait:
                    on_wait()
                continue
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def decode_reply(data: bytes):
    """The only way child data enters the grader: weights-only unpickling, on the CPU."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadReply("the code returned an object the grader does not accept (only plain "
                       f"torch.Tensor, numbers, strings, lists and dicts): {first[:300]}") from None


# ---------------------------------------------------------------- isolation helpers

def namespaces_available() -> bool:
    """True when ``unshare`` can make user/mount/net/pid namespaces here (tested once)."""
    global _NS_OK
    if _NS_OK is None:
        if os.environ.get("AUTOGRADER_ISOLATION", "").lower() == "process" or not shutil.which("unshare"):
            _NS_OK = False
        else:
            try:
                _NS_OK = subprocess.run(
                    [*_UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
            except Exception:
                _NS_OK = False
    return _NS_OK


_NS_OK: bool | None = None
_UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
            "--kill-child", "--mount-proc"]


def isolation_summary() -> str:
    if namespaces_available():
        return "child processes in their own user/mount/net/pid namespaces, solutions hidden"
    return "child processes only (no user namespaces here: same user, network not cut)"


def become_subreaper() -> None:
    """Make orphaned descendants (double fork + setsid) re-parent to this process."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def kill_tree(root_pid: int | None, spare: set[int]) -> None:
    """Kill ``root_pid``'s process group and every descendant of this process not in ``spare``.

    Repeated until nothing new appears, so a small fork bomb cannot outrun it.
    """
    me = psutil.Process()
    if root_pid is not None:
        try:
            os.killpg(root_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for _ in range(200):
        victims = [p for p in me.children(recursive=True) if p.pid not in spare]
        if not victims:
            break
        for p in victims:
            try:
                p.send_signal(signal.SIGSTOP)  # freeze first: a stopped process cannot fork
            except psutil.Error:
                pass
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=1)
    # reap zombies that were re-parented to us
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break


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
    cell_errors: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _spare: set[int] = field(default_factory=set)

    # -- lifecycle
    def start(self) -> None:
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
                   PYTHONNOUSERSITE="1", MPLBACKEND="Agg", COURSE_OFFLINE="1")
        cmd = [sys.executable, "-m", "autograder.worker", str(req_r), str(rep_w)]
        if namespaces_available():
            cmd = [*_UNSHARE, *cmd]
            env["AUTOGRADER_HIDE"] = os.pathsep.join(
                str(p) for p in [REPO / "solutions"] if p.exists())
            env["AUTOGRADER_WRITABLE"] = str(work)
        with open(self._out_path, "wb") as out:
            self._proc = subprocess.Popen(
                cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                pass_fds=(req_r, rep_w), start_new_session=True,
                preexec_fn=_child_limits)
        os.close(req_r)
        os.close(rep_w)
        reply = self._request({"op": "load", "cells": self.cells, "objects": self.objects},
                              min(self.limits.load_timeout, MAX_CALL_TIMEOUT),
                              "loading your notebook's code")
        self.cell_errors = dict(reply.get("cell_errors", {}))

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        if self._proc is not None:
            for fd in (self._req_w, self._rep_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            kill_tree(self._proc.pid, self._spare)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None
            shutil.rmtree(self._dir, ignore_errors=True)

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
        deadline = time.monotonic() + timeout
        try:
            write_frame(self._req_w, pickle.dumps(msg))
            data = read_frame(self._rep_r, deadline, self._watchdog)
            self._watchdog()  # a call that returned fast must not leave limits broken behind
        except TimeoutError:
            self.close()
            raise CallTimeout(f"timed out after {timeout:g} s ({what})") from None
        except (EOFError, BrokenPipeError, OSError):
            code = self._exit_code()
            tail = self.output_tail(800).strip()
            self.close()
            raise ChildExited(f"the process running your code exited with code {code} "
                              f"({what})" + (f"; its last output:\n{tail}" if tail else "")) from None
        except LimitExceeded:
            self.close()
            raise
        reply = decode_reply(data)
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


def _memory(tree, measure) -> int:
    total = 0
    for p in tree:
        try:
            total += measure(p)
        except psutil.Error:
            pass
    return total


def _child_limits():
    """Runs in the child before exec: no core dumps, a bounded output file."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_OUTPUT_FILE_BYTES, MAX_OUTPUT_FILE_BYTES))
