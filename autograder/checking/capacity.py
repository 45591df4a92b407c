"""How many cores' worth of CPU this machine gives n processes now: the yardstick of a speed
check that has no reference solution to compare with (the student edition's self-check, a
Gradescope bundle built without ``--with-reference``).

With the reference, a busy machine shows up as the reference's own speedup falling short, and
the check is skipped (:func:`~.speed.judge_rounds`). Without it, a fixed threshold alone would
fail correct code whenever other programs take the cores. So, after each timed round, the grader
measures the machine itself: ``n`` worker processes of its own (trusted code, a pure-Python
loop: no torch, no student code) spin together for :data:`SPIN_SECONDS` of wall time, and each
reports the CPU time it got. Their sum over the wall time is the machine's *capacity*: about
``n`` where ``n`` cores are free, ``2 n / (n + b)`` on ``n`` cores where ``b`` other processes
spin. CPU time, not speed, is what is counted, so a slow or throttled core does not lower it.

Student code cannot raise it: its processes can only take cores away, which lowers it, and a
low capacity makes the check a SKIP, which earns nothing.

Measured on this project's 2-core machine, 9 rounds each (median; ``b`` processes spinning
beside the 2 workers): b = 0: 2.00, 1: 1.46, 2: 1.00, 3: 0.87, 4: 0.69.
"""
from __future__ import annotations

import select
import subprocess
import sys
import time

#: The speed check is judged only where the machine gives at least this fraction of the
#: processes it times (a capacity of 1.8 for 2 processes).
FREE_FRACTION = 0.9
#: How long the workers spin in each measurement (wall seconds).
SPIN_SECONDS = 0.05

_WORKER = """\
import sys, time
for line in sys.stdin:
    wall = float(line)
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < wall:
        pass
    sys.stdout.write("%r\\n" % ((time.process_time() - c0) / (time.perf_counter() - t0)))
    sys.stdout.flush()
"""


class Capacity:
    """``processes`` spinning workers, started on first use and reaped by :meth:`close` (a
    context manager). :meth:`measure` returns the capacity now (see the module's text)."""

    def __init__(self, processes: int, timeout: float = 30.0):
        self.processes = processes
        self.timeout = timeout
        self._workers: list[subprocess.Popen] = []

    def __enter__(self) -> "Capacity":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._workers:
            w.kill()
            w.wait()
            for stream in (w.stdin, w.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self._workers = []

    def measure(self) -> float:
        """Cores' worth of CPU the ``processes`` workers got, spinning together now."""
        if not self._workers:
            self._workers = [subprocess.Popen([sys.executable, "-I", "-S", "-c", _WORKER],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True, bufsize=1)
                             for _ in range(self.processes)]
        for w in self._workers:
            w.stdin.write(f"{SPIN_SECONDS}\n")
            w.stdin.flush()
        deadline, total = time.monotonic() + self.timeout, 0.0
        for w in self._workers:
            ready, _, _ = select.select([w.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = w.stdout.readline() if ready else ""
            if not line:
                raise RuntimeError(f"the grader's capacity workers did not answer within "
                                   f"{self.timeout:.0f} s (a grader bug)")
            total += float(line)
        return total

    def enough(self, capacity: float) -> bool:
        """Whether ``capacity`` is enough to judge a speedup on ``processes`` processes."""
        return capacity >= FREE_FRACTION * self.processes
