"""Memory and process limits the kernel enforces: one control group per sandbox.

A cgroup counts what a watchdog polling process sizes cannot see: shared memory (``/dev/shm``,
System V segments, the private ``/tmp``), memfds and page tables are charged to it like any
other page, and its ``pids`` controller refuses the fork past the limit instead of noticing it
afterwards. Where the machine offers one:

- cgroups v2 (``/sys/fs/cgroup/cgroup.controllers``), with the grader as root: a group under
  ``/sys/fs/cgroup/autograder/`` with ``memory.max``, ``memory.swap.max = 0`` and ``pids.max``;
- cgroups v1 with the grader as root: groups under ``memory/autograder/`` and
  ``pids/autograder/`` with ``memory.limit_in_bytes`` and ``pids.max``.

Anywhere else (a grader that is not root, a container whose ``/sys/fs/cgroup`` is read-only)
:func:`make` returns None and the report's ``Isolation:`` line says that memory is watched
only by polling (shared memory not counted) and that ``/tmp`` and ``/dev/shm`` are bounded by
their size. The sandbox's own process joins the group before it runs anything (it writes its
pid while still the grader's code, before ``exec``), so every process graded code starts is in
it, and the read-only ``/sys`` in the sandbox keeps them there.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

ROOT = Path(os.environ.get("AUTOGRADER_CGROUP_ROOT", "/sys/fs/cgroup"))


class Cgroup:
    def __init__(self, dirs: list[Path], version: int):
        self.dirs, self.version = dirs, version

    def join_self(self) -> None:
        """Move the calling process into the group (run in the child before ``exec``)."""
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write("0")

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the group (a worker forked by the warm template, before it
        runs anything)."""
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write(str(pid))

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for want of memory."""
        try:
            if self.version == 2:
                events = (self.dirs[0] / "memory.events").read_text().split()
                return int(events[events.index("oom_kill") + 1]) > 0
            return int((self.dirs[0] / "memory.failcnt").read_text()) > 0 and \
                "oom_kill 0" not in (self.dirs[0] / "memory.oom_control").read_text()
        except (OSError, ValueError, IndexError):
            return False

    def allow(self, uid: int, gid: int) -> None:
        """Let ``uid`` move itself in (the sandbox user's child writes its own pid)."""
        for d in self.dirs:
            os.chown(d / "cgroup.procs", uid, gid)

    def remove(self) -> None:
        for d in self.dirs:
            try:
                d.rmdir()  # empty once every process in it is dead
            except OSError:
                pass


def _write(path: Path, value) -> None:
    path.write_text(str(value))


def make(max_memory: int, max_processes: int) -> Cgroup | None:
    """A fresh group with these limits, or None where this machine or user cannot make one."""
    if os.geteuid() != 0 or os.environ.get("AUTOGRADER_CGROUPS", "").lower() == "off":
        return None
    name = f"sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if (ROOT / "cgroup.controllers").exists():
            return _make_v2(name, max_memory, max_processes)
        return _make_v1(name, max_memory, max_processes)
    except OSError:
        return None


def _make_v2(name, max_memory, max_processes) -> Cgroup:
    parent = ROOT / "autograder"
    parent.mkdir(exist_ok=True)
    for d in (ROOT, parent):
        _write(d / "cgroup.subtree_control", "+memory +pids")
    group = parent / name
    group.mkdir()
    try:
        _write(group / "memory.max", max_memory)
        _write(group / "pids.max", max_processes)
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", 0)
    except OSError:
        group.rmdir()
        raise
    return Cgroup([group], 2)


def _make_v1(name, max_memory, max_processes) -> Cgroup:
    made = []
    try:
        for controller, settings in (("memory", {"memory.limit_in_bytes": max_memory}),
                                     ("pids", {"pids.max": max_processes})):
            group = ROOT / controller / "autograder" / name
            group.mkdir(parents=True)
            made.append(group)
            for key, value in settings.items():
                _write(group / key, value)
    except OSError:
        for group in made:
            group.rmdir()
        raise
    return Cgroup(made, 1)
