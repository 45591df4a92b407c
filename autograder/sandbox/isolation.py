"""Keeping the worker's processes apart from the grader: Linux namespaces where available, and
killing a whole process tree, escaped processes included."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from ..registry import REPO



#: ``auto`` (default): bubblewrap where it runs, else ``unshare``, else processes only;
#: ``bwrap`` or ``unshare`` insist on one (grading stops where it does not run); ``process``
#: turns namespaces off (the tests use it to check what every setting guarantees).
ISOLATION_ENV = "AUTOGRADER_ISOLATION"
UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc",
           "--uts", "--fork", "--kill-child", "--mount-proc"]
_MODE: str | None = None


def isolation_mode() -> str:
    """``bwrap``, ``unshare`` or ``process``: how graded code is kept apart here (tested once
    per grader process by starting ``true`` that way)."""
    global _MODE
    if _MODE is None:
        asked = os.environ.get(ISOLATION_ENV, "auto").lower() or "auto"
        if asked not in ("auto", "bwrap", "unshare", "process"):
            raise RuntimeError(f"{ISOLATION_ENV}={asked}: expected auto, bwrap, unshare or process")
        _MODE = "process"
        for mode in ("bwrap", "unshare"):
            if asked not in ("auto", mode):
                continue
            if (why := _fails(mode)) is None:
                _MODE = mode
                break
            if mode == "bwrap":
                _WHY_NOT_BWRAP.append(why)
        else:
            if asked in ("bwrap", "unshare"):
                raise RuntimeError(f"{ISOLATION_ENV}={asked}, but `{asked}` cannot make "
                                   "namespaces on this machine (docs/grading.md, 'Settings')")
    return _MODE


#: Why bubblewrap was not used (the report says it): not installed, or its error here.
_WHY_NOT_BWRAP: list[str] = []


def why_not_bwrap(unasked: str = "not asked for") -> str:
    """Why this process does not grade in bubblewrap (``unasked``: it was never tried)."""
    return "; ".join(_WHY_NOT_BWRAP) or unasked


def _fails(mode: str) -> str | None:
    """None when ``mode`` runs here, else why not."""
    if not shutil.which(mode):
        return f"{mode} is not installed"
    if mode == "bwrap":
        import tempfile

        from .policy import bwrap_command

        with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as scratch:
            user = sandbox_user()  # bubblewrap runs as the sandbox's user, if one is set
            if user is not None:
                os.chown(scratch, user.pw_uid, user.pw_gid)
            return _error([*bwrap_command(Path(scratch)), sys.executable, "-c", "pass"], user)
    return _error([*UNSHARE, "true"])


def _error(cmd, user=None) -> str | None:
    as_user = {} if user is None else dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=30, **as_user)
    except Exception as exc:  # noqa: BLE001 - any reason is reported, none is fatal
        return f"{cmd[0]}: {exc}"
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return (lines[-1] if lines else f"{cmd[0]} exited with code {done.returncode}")[:200]


def namespaces_available() -> bool:
    """True when graded code runs in namespaces of its own (bubblewrap or ``unshare``)."""
    return isolation_mode() != "process"


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
    """The report's ``Isolation:`` line: what this setting gives graded code, and, loudly,
    what it lacks (docs/grading.md, 'Settings')."""
    mode = isolation_mode()
    limits = ("memory and processes limited by a cgroup (shared memory counted)"
              if _CGROUPS_SEEN else "memory and processes watched by polling (no cgroup here: "
              "shared memory and memfds not counted)")
    if mode == "bwrap":
        text = ("bubblewrap: uid 65534 without capabilities, seccomp, own user/PID/IPC/net "
                "namespaces, read-only file system, solutions/ absent; " + limits)
    elif mode == "unshare":
        text = ("unshare: own user/PID/IPC/net namespaces, capabilities dropped, seccomp, "
                "read-only file system, solutions/ hidden under an empty mount (WARNING: "
                f"not bubblewrap: {why_not_bwrap()}; with it "
                "solutions/ is absent); " + limits)
    else:
        user = sandbox_user()
        if user is not None:
            hidden = ", solutions unreadable to it" if unreadable_to_sandbox(REPO / "solutions") else ""
            text = (f"WARNING: no namespaces here ({why_not_bwrap()})"
                    f": child processes as user {user.pw_name}"
                    f"{hidden}, seccomp, network not cut; " + limits)
        else:
            text = (f"WARNING: no namespaces here ({why_not_bwrap()})"
                    ": child processes as the grader's own user, "
                    "seccomp only, network not cut; " + limits)
    if CONFINEMENT_PROBLEMS:
        text += "; WARNING: " + "; ".join(sorted(CONFINEMENT_PROBLEMS))
    if COLD_STARTS:
        text += f"; the warm template failed ({COLD_STARTS[0]}): workers started cold"
    elif FORKED:
        text += "; workers forked from the sandbox's warm template (own mount, IPC, net namespaces)"
    return text


#: Why this grading's worker started cold although a warm template was there (one line each).
COLD_STARTS: list[str] = []


def note_cold_start(why: str) -> None:
    COLD_STARTS.append(why)


#: Whether a worker of this grading was forked from the sandbox's warm template.
FORKED: list[bool] = []


#: What the grader saw missing in a worker's /proc/<pid>/status (:func:`check_confinement`).
CONFINEMENT_PROBLEMS: set[str] = set()
#: Whether a sandbox of this process ran in a cgroup of its own.
_CGROUPS_SEEN: list[bool] = []


def note_cgroup(used: bool) -> None:
    if used and not _CGROUPS_SEEN:
        _CGROUPS_SEEN.append(True)


def check_confinement(root_pid: int, forked: bool = False) -> None:
    """Read, from outside, the status of the worker started under ``root_pid`` (``forked``: the
    worker itself, forked by the sandbox's warm template): no capability, ``no_new_privs``, a
    seccomp filter. Anything missing goes into the report's isolation line."""
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            if not forked and p.cmdline()[1:3] != ["-m", "autograder.sandbox.worker"]:
                continue  # bwrap or unshare, whose arguments name the worker too
            status = dict(line.split(":", 1) for line in
                          Path(f"/proc/{p.pid}/status").read_text().splitlines() if ":" in line)
        except (psutil.Error, OSError):
            continue
        if int(status.get("CapEff", "0").strip(), 16):
            CONFINEMENT_PROBLEMS.add("graded code kept capabilities")
        if status.get("NoNewPrivs", "0").strip() != "1":
            CONFINEMENT_PROBLEMS.add("no_new_privs not set")
        if status.get("Seccomp", "0").strip() != "2":
            CONFINEMENT_PROBLEMS.add("no seccomp filter (pyseccomp or libseccomp missing)")
        return


#: Set to 1 to grade although graded code could read solutions/ (see :func:`reference_exposed`).
ALLOW_VISIBLE_REFERENCE = "AUTOGRADER_ALLOW_VISIBLE_REFERENCE"


def reference_exposed() -> str | None:
    """Why grading must not start here, or None: with ``solutions/`` on disk and no bubblewrap
    to leave it out, graded code could find the reference answers (``unshare`` only covers it,
    and shows the rest of the host read-only). The grader fails closed: the instructor grades
    with bubblewrap on a host with user namespaces (in Docker: docker/compose.reference.yaml),
    removes solutions/, runs graded code as a user who cannot read it (as root, with
    AUTOGRADER_SANDBOX_USER), or accepts the risk with AUTOGRADER_ALLOW_VISIBLE_REFERENCE=1."""
    solutions = REPO / "solutions"
    if not solutions.exists() or isolation_mode() == "bwrap" or unreadable_to_sandbox(solutions):
        return None
    if os.environ.get(ALLOW_VISIBLE_REFERENCE) == "1":
        return None
    return ("solutions/ is present and graded code would not run without it here (bubblewrap, "
            "the sandbox that leaves it out, does not run: "
            f"{why_not_bwrap('AUTOGRADER_ISOLATION says not to')}), so a "
            "submission could find the reference answers. Install bubblewrap (Debian and Ubuntu: "
            "apt-get install bubblewrap) on a host with user namespaces (in Docker, "
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
    for _ in ended_children():  # reap zombies that were re-parented to us
        pass


def ended_children():
    """``(pid, wait status)`` of each child of this process that has ended, reaping them, until
    no ended one is left."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


