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


#: Run as root with this set to a user's name, the grader starts graded code as that user (its
#: files unreadable there, e.g. ``solutions/`` made 0700 root: Gradescope's bundle does so).
SANDBOX_USER_ENV = "AUTOGRADER_SANDBOX_USER"


def sandbox_user():
    """``pwd`` entry of the user graded code runs as, or None (the grader's own user). Only
    root can start a child as another user; elsewhere the variable is ignored."""
    import pwd

    name = os.environ.get(SANDBOX_USER_ENV, "")
    if not name or os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise RuntimeError(f"{SANDBOX_USER_ENV}={name}: no such user on this machine") from None


def unreadable_to_sandbox(path) -> bool:
    """True when graded code, running as :func:`sandbox_user`, cannot open ``path``: another
    owner, and neither its group's nor others' read or search bits for that user."""
    user = sandbox_user()
    if user is None or not os.path.exists(path):
        return False
    st = os.stat(path)
    if st.st_uid == user.pw_uid or st.st_mode & 0o005:
        return False
    return st.st_gid != user.pw_gid or not st.st_mode & 0o050


def isolation_summary() -> str:
    if namespaces_available():
        return "child processes in their own user/mount/net/pid namespaces, solutions hidden"
    user = sandbox_user()
    if user is not None:
        hidden = ", solutions unreadable to it" if unreadable_to_sandbox(REPO / "solutions") else ""
        return f"child processes as user {user.pw_name}{hidden} (no user namespaces here)"
    return "child processes only (no user namespaces here: same user, network not cut)"


#: Set to 1 to grade although graded code could read solutions/ (see :func:`reference_exposed`).
ALLOW_VISIBLE_REFERENCE = "AUTOGRADER_ALLOW_VISIBLE_REFERENCE"


def reference_exposed() -> str | None:
    """Why grading must not start here, or None: with ``solutions/`` on disk and no namespaces
    to hide it, graded code could read the reference answers. The grader fails closed: the
    instructor grades on a host with user namespaces (in Docker: docker/compose.reference.yaml),
    removes solutions/, runs graded code as a user who cannot read it (as root, with
    AUTOGRADER_SANDBOX_USER), or accepts the risk with AUTOGRADER_ALLOW_VISIBLE_REFERENCE=1."""
    solutions = REPO / "solutions"
    if not solutions.exists() or namespaces_available() or unreadable_to_sandbox(solutions):
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


