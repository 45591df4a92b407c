"""Grading several submissions at once without them disturbing each other's speed checks.

Each job (one submission) gets, for as long as it runs, its own:

- CPU cores: as many as its assignment's speed checks need (``Spec.cores_for_speed``); the
  grader is pinned to them (:func:`autograder.invoke.run_grader` ``cpus``) and everything it
  starts inherits that pinning: the sandbox, the ranks, and the reference's sandbox of each
  speed check, so the student's code and the reference are measured on the same cores;
- GPUs (``Spec.gpus_for_speed``), through ``CUDA_VISIBLE_DEVICES``;
- a port range (``COURSE_PORTS``, read by :func:`course.launch.free_port`) and a temporary
  folder (``TMPDIR``: the sandboxes' folders are made under it).

A job never gets fewer cores or GPUs than sequential grading would give its speed checks
(needs above what the machine has are capped at what it has), so a submission's score does
not depend on whether it was graded alone or beside others: jobs wait for free cores instead.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

#: ports for jobs: [PORT_BASE, PORT_END) split evenly between the slots (one per core), below
#: Linux's ephemeral range (32768-60999) where port 0 binds land
PORT_BASE, PORT_END = 20000, 32000


@dataclass(frozen=True)
class Needs:
    """What one job holds while it runs."""
    cores: int
    gpus: int = 0


@dataclass
class Slot:
    """The resources of one running job."""
    index: int                  # 0.. among jobs running at once
    cores: tuple[int, ...]
    gpus: tuple[str, ...]
    tmp: Path
    ports: tuple[int, int] = (PORT_BASE, PORT_END - 1)   # first and last of its range

    def env(self, base: dict | None = None) -> dict:
        """The grader's environment in this job."""
        env = dict(os.environ if base is None else base)
        env.update(CUDA_VISIBLE_DEVICES=",".join(self.gpus), TMPDIR=str(self.tmp),
                   COURSE_PORTS="%d-%d" % self.ports)
        return env


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except ImportError:
        return []


def needs_of(assignment: str | None, cores: int, gpus: int) -> Needs:
    """What a submission of ``assignment`` needs, capped at what the machine has (an unknown
    assignment, which fails at once, needs one core)."""
    from ..checking.spec import load_spec

    try:
        spec = load_spec(assignment) if assignment else None
    except ImportError:
        spec = None
    if spec is None:
        return Needs(1, 0)
    return Needs(max(1, min(spec.cores_for_speed, cores)), min(spec.gpus_for_speed, gpus))


def capacity(needs: list[Needs], cores: int, gpus: int) -> int:
    """How many jobs the machine can hold at once when each has its largest need: the default
    of ``--jobs``."""
    if not needs:
        return 1
    most = Needs(max(n.cores for n in needs), max(n.gpus for n in needs))
    fit = cores // most.cores
    if most.gpus:
        fit = min(fit, gpus // most.gpus)
    return max(1, fit)


@dataclass
class Allocator:
    """Hands out disjoint cores, GPUs, port ranges and temporary folders; thread-safe."""
    cores: list[int]
    gpus: list[str]
    tmp_root: Path
    _free_cores: list[int] = field(init=False)
    _free_gpus: list[str] = field(init=False)
    _free_slots: set[int] = field(init=False, default_factory=set)
    _cond: threading.Condition = field(init=False, default_factory=threading.Condition)

    def __post_init__(self):
        self._free_cores, self._free_gpus = list(self.cores), list(self.gpus)
        self._free_slots = set(range(len(self.cores)))

    def acquire(self, needs: Needs) -> Slot:
        """Blocks until ``needs`` are free; the job's own resources."""
        if needs.cores > len(self.cores) or needs.gpus > len(self.gpus):
            raise ValueError(f"{needs} is more than this machine has "
                             f"({len(self.cores)} cores, {len(self.gpus)} GPUs)")
        with self._cond:
            self._cond.wait_for(lambda: len(self._free_cores) >= needs.cores
                                and len(self._free_gpus) >= needs.gpus)
            cores = self._free_cores[:needs.cores]
            gpus = self._free_gpus[:needs.gpus]
            del self._free_cores[:needs.cores], self._free_gpus[:needs.gpus]
            index = min(self._free_slots)
            self._free_slots.remove(index)
        tmp = Path(tempfile.mkdtemp(prefix=f"job{index}-", dir=self.tmp_root))
        width = (PORT_END - PORT_BASE) // len(self.cores)
        ports = (PORT_BASE + index * width, PORT_BASE + (index + 1) * width - 1)
        return Slot(index, tuple(cores), tuple(gpus), tmp, ports)

    def release(self, slot: Slot) -> None:
        shutil.rmtree(slot.tmp, ignore_errors=True)
        with self._cond:
            self._free_cores = sorted(self._free_cores + list(slot.cores))
            self._free_gpus += list(slot.gpus)
            self._free_slots.add(slot.index)
            self._cond.notify_all()


class Running:
    """The grader processes of the jobs that run now, so that an interrupt stops them all
    (they run in sessions of their own, which Ctrl-C on the terminal does not reach)."""

    def __init__(self):
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def started(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)
        if self.stopping.is_set():
            self.stop_all()

    def finished(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def stop_all(self) -> None:
        from ..sandbox.isolation import kill_tree

        self.stopping.set()
        with self._lock:
            pids = list(self._pids)
        for pid in pids:
            kill_tree(pid, set())


def run_jobs(items: list, needs: list[Needs], work, jobs: int, allocator: Allocator,
             running: Running, done) -> None:
    """``work(item, slot)`` for each item, ``jobs`` at a time, each on its own slot;
    ``done(item, result)`` in this thread's order of completion. On Ctrl-C, every job's
    process tree is killed and nothing more is reported (``running.stopping``)."""
    def one(item, need):
        if running.stopping.is_set():
            return None
        slot = allocator.acquire(need)
        try:
            return None if running.stopping.is_set() else work(item, slot)
        finally:
            allocator.release(slot)

    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="grade-job")
    try:
        futures = {pool.submit(one, item, need): item for item, need in zip(items, needs)}
        for future in as_completed(futures):
            result = future.result()
            if running.stopping.is_set():
                break
            if result is not None:
                done(futures[future], result)
    except BaseException:
        running.stop_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
