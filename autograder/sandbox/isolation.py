"""Keeping the worker's processes apart from the grader: Linux namespaces where available, and
killing a whole process tree, escaped processes included."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess

import psutil

from ..registry import REPO



def namespaces_available() -> bool:
    """True when ``unshare`` can make user/mount/net/pid namespaces here (tested once)."""
    global _NS_OK
    if _NS_OK is None:
        if os.environ.get("AUTOGRADER_ISOLATION", "").lower() == "process" or not shutil.which("unshare"):
            _NS_OK = False
        else:
            try:
                _NS_OK = subprocess.run(
                    [*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
            except Exception:
                _NS_OK = False
    return _NS_OK


_NS_OK: bool | None = None
UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
            "--kill-child", "--mount-proc"]


def isolation_summary() -> str:
    if namespaces_available():
        return "child processes in their own user/mount/net/pid namespaces, solutions hidden"
    return "child processes only (no user namespaces here: same user, network not cut)"


#: Set to 1 to grade although graded code could read solutions/ (see :func:`reference_exposed`).
ALLOW_VISIBLE_REFERENCE = "AUTOGRADER_ALLOW_VISIBLE_REFERENCE"


def reference_exposed() -> str | None:
    """Why grading must not start here, or None: with ``solutions/`` on disk and no namespaces
    to hide it, graded code could read the reference answers. The grader fails closed: the
    instructor grades on a host with user namespaces (in Docker: docker/compose.reference.yaml),
    removes solutions/, or accepts the risk with AUTOGRADER_ALLOW_VISIBLE_REFERENCE=1."""
    if not (REPO / "solutions").exists() or namespaces_available():
        return None
    if os.environ.get(ALLOW_VISIBLE_REFERENCE) == "1":
        return None
    return ("solutions/ is present and this machine cannot hide it from graded code (no user "
            "namespaces: `unshare --user --mount --pid` is not permitted here), so a submission "
            "could read the reference answers. Grade on a host with user namespaces (in Docker, "
            "use docker/compose.reference.yaml), grade from a copy without solutions/, or set "
            f"{ALLOW_VISIBLE_REFERENCE}=1 to accept the risk (docs/instructor.md).")


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


