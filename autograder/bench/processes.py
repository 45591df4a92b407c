"""Counting the processes that a process tree starts, from outside it, for the grading benchmark.

How: a thread of this process polls the tree every :data:`POLL` seconds. On Linux a poll reads
``/proc/<pid>/task/<tid>/children`` for every thread of every process found so far, starting
from the root (cheap: it reads the tree's own files only, not every process on the machine);
elsewhere it asks psutil for the root's descendants. Every (pid, start time) seen is one
process, so a pid the OS reuses is counted again.

What it cannot see, so the count is a lower bound: a process that starts and ends between two
polls, and one that leaves the tree (double fork, re-parented to init) before a poll finds it;
the grader becomes a child subreaper, so orphans of its sandboxes stay inside its tree. Why
polling and not tracing: ``ptrace`` (strace -f) would slow every fork of the run it measures,
and the kernel's fork counter (``processes`` in /proc/stat) counts every program on the
machine. Why the tree's files and not a scan of every ``/proc/<pid>/stat`` for parents (what
psutil does): a poll then costs the same for every process on the machine (about 1.3 ms for
110 processes), against a fraction of that for a grading's tree most of the time. The poller's
own CPU time is kept (:attr:`ProcessCounter.cpu_seconds`), to show what it took from the run.
"""
from __future__ import annotations

import os
import threading
import time

#: Seconds between two polls.
POLL = 0.01


def _read(path: str) -> bytes | None:
    """A small /proc file's bytes, or None once it is gone (os.read: a third cheaper than
    open(), which counts at a hundred polls a second)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (empty once it is gone)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        data = _read(f"/proc/{pid}/task/{tid}/children")
        if data:
            kids += map(int, data.split())
    return kids


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    data = _read(f"/proc/{pid}/stat")
    try:
        return int(data.rpartition(b")")[2].split()[19])
    except (AttributeError, IndexError, ValueError):
        return None


def _descendants_proc(root: int) -> set[int]:
    found, frontier = set(), [root]
    while frontier:
        for kid in _children(frontier.pop()):
            if kid not in found:
                found.add(kid)
                frontier.append(kid)
    return found


def _descendants_psutil(root: int) -> dict[int, float | None]:
    import psutil

    try:
        return {p.pid: p.create_time() for p in psutil.Process(root).children(recursive=True)}
    except psutil.Error:
        return {}


class ProcessCounter:
    """``start(pid)`` (e.g. as :func:`autograder.invoke.run_grader`'s ``on_start``), then
    ``stop()``, which returns how many distinct processes below ``pid`` were seen."""

    def __init__(self, poll: float = POLL):
        self.poll = poll
        self.seen: set[tuple[int, object]] = set()
        self.cpu_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(pid,), daemon=True,
                                        name=f"count-processes-{pid}")
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return len(self.seen)

    def _run(self, root: int) -> None:
        use_proc = os.path.exists(f"/proc/{root}/task")
        alive: set[int] = set()
        while True:
            if use_proc:
                now = _descendants_proc(root)
                self.seen |= {(pid, _start_time(pid)) for pid in now - alive}
                alive = now
            else:
                self.seen |= set(_descendants_psutil(root).items())
            if self._stop.wait(self.poll):
                break
        self.cpu_seconds = time.thread_time()
