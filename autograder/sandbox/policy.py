"""The sandbox's file system and namespaces, as one bubblewrap command line.

Read it as bubblewrap's and nsjail's policies are read: the root is an empty tmpfs, and graded
code sees exactly what is listed here, read-only but its scratch folder.

- The operating system (``/usr``, the ``/lib`` links, the few files of ``/etc`` that Python
  and gloo read) and the Python that runs the grader (its prefix and every folder on its
  ``sys.path``), read-only.
- Of the course repository only ``autograder/`` and ``course/`` (and the virtual environment,
  where it lives inside the repository), read-only: ``solutions/``, the answer keys in it,
  ``.git``, ``build/`` and every student's submission are *absent*, not covered by a mount that
  could be taken away.
- One writable scratch folder per grading (the worker's working directory, ``HOME`` and
  ``TMPDIR``), and small private ``/tmp`` and ``/dev/shm`` (tmpfs, bounded).
- A fresh ``/proc`` of its own PID namespace (``/proc/sys`` and ``/proc/sysrq-trigger``
  read-only: when the grader runs as root, graded code is root *outside* its namespace, and the
  kernel lets root write kernel settings without any capability), a minimal ``/dev`` (null,
  zero, random, urandom, tty; the NVIDIA devices where there are GPUs), ``/sys``'s device
  folders read-only (CPU topology for torch, GPU discovery).
- New user, PID, IPC, network (loopback only), UTS and cgroup namespaces; uid and gid 65534
  inside, no capabilities; killed with the grader (``--die-with-parent``).

The worker then drops what is left and loads a seccomp filter (:mod:`.confine`).
"""
from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from ..registry import REPO

#: uid and gid of graded code inside the sandbox ("nobody").
SANDBOX_ID = 65534
#: Size of the private /tmp and /dev/shm (each); the scratch folder is on disk.
TMPFS_BYTES = int(os.environ.get("AUTOGRADER_TMPFS_MB", "512")) << 20
#: The only parts of the repository graded code needs: the grader's probes and the toolkit.
REPO_PARTS = ("autograder", "course")
#: Present on the host, hidden from graded code whatever else is listed.
NEVER = ("solutions", ".git", "build", "submissions", "grades")
_SYSTEM = ("/usr", "/opt/conda")
#: Of /etc, what Python, torch and gloo read (the dynamic linker's cache, users and groups for
#: uid 65534, name resolution of localhost, the time zone): not the rest (shadow, ssh keys).
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf",
        "hosts", "host.conf", "gai.conf", "localtime", "timezone", "alternatives")
#: Of /sys, the devices (CPU topology for torch, PCI for CUDA; the nvidia module's version for
#: its driver library), read-only: not the kernel's
#: debug and tracing files, firmware tables or cgroups.
_SYS = ("/sys/devices", "/sys/bus", "/sys/class", "/sys/dev", "/sys/module")
#: Files of the new /proc that root (which graded code's uid is, outside, when the grader runs
#: as root) could write without any capability: kernel settings and the SysRq trigger.
_PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger")
_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                "/dev/nvidia-modeset")


def python_paths() -> list[str]:
    """Folders the grader's Python needs: its prefixes and the existing ``sys.path`` entries,
    with their real paths (a venv's ``bin/python`` links to the base interpreter)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             *sys.path]
    out = []
    for p in paths:
        if not p or not os.path.isdir(p):
            continue
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q not in out:
                out.append(q)
    return out


def _inside(path: str, folder: Path) -> bool:
    try:
        Path(path).relative_to(folder)
        return True
    except ValueError:
        return False


def visible_paths() -> list[str]:
    """Every host folder bound read-only into the sandbox, none holding a hidden one."""
    repo = REPO.resolve()
    hidden = [repo / n for n in NEVER]
    out = [p for p in _SYSTEM if os.path.isdir(p) and not os.path.islink(p)]
    venv = Path(sys.prefix).resolve()
    for p in python_paths():
        if any(_inside(p, h) or _inside(str(h), Path(p)) for h in hidden):
            continue  # the repository itself (an editable install's path) or inside a hidden part
        if _inside(p, repo) and not _inside(p, venv):
            continue  # of the repository: only the parts below and a venv kept in it
        if not _inside(p, Path("/usr")) and p not in out:
            out.append(p)
    out += [str(repo / part) for part in REPO_PARTS if (repo / part).is_dir()]
    # a folder inside another one listed is bound once, by its outermost
    out = sorted(set(out), key=len)
    return [p for i, p in enumerate(out) if not any(_inside(p, Path(q)) for q in out[:i])]


def bwrap_command(scratch: Path) -> list[str]:
    """The bubblewrap command that runs the worker (append the worker's own command)."""
    # --as-pid-1: the worker is the PID namespace's first process, under no process of the
    # sandbox that lacks its seccomp filter (bubblewrap's reaper would be one, and on a kernel
    # without Yama graded code of the same uid could open its memory)
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
           "--as-pid-1", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID),
           "--hostname", "sandbox", "--cap-drop", "ALL"]
    # /tmp first: a Python or scratch folder inside /tmp is bound over it, not hidden by it
    cmd += ["--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp"]
    for link in _LINKS:
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            cmd += ["--ro-bind", link, link]
    for path in visible_paths():
        cmd += ["--ro-bind", path, path]
    for name in _ETC:
        cmd += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for path in _SYS:
        cmd += ["--ro-bind-try", path, path]
    cmd += ["--proc", "/proc"]
    for path in _PROC_READ_ONLY:  # bound from the host's /proc: read-only, whatever uid writes
        cmd += ["--ro-bind-try", path, path]
    cmd += ["--dev", "/dev",
            "--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/dev/shm"]
    for dev in [*_GPU_DEVICES, *sorted(glob.glob("/dev/nvidia[0-9]*")), "/dev/nvidia-caps"]:
        if os.path.exists(dev):
            cmd += ["--dev-bind", dev, dev]
    cmd += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch), "--"]
    return cmd
