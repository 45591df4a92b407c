"""How many cores' worth of CPU this machine gives n processes now: the yardstick of a speed
check that has no reference solution to compare with (the student edition's self-check, a
Gradescope bundle built without ``--with-reference``).

With the reference, a busy machine shows up as the reference's own speedup falling short, and
the check is skipped (:func:`~.speed.judge_rounds`). Without it, a fixed threshold alone would
fail correct code whenever other programs take the cores. So, after each timed round, the grader
measures the machine itself: ``n`` worker processes of its own (trusted code, a pure-Python
loop: no torch, no student code) spin together until a common end :data:`SPIN_SECONDS` away,
and each reports the CPU time it got. Their sum over that time is the machine's *capacity*: about
``n`` where ``n`` cores are free, ``2 n / (n + b)`` on ``n`` cores where ``b`` other processes
spin. CPU time, not speed, is what is counted, so a slow or throttled core does not lower it.

Student code cannot raise it: its processes can only take cores away, which lowers it, and a
low capacity makes the check a SKIP, which earns nothing.

Measured on this project's 2-core machine, 9 rounds each (median; ``b`` processes spinning
beside the 2 workers): b = 0: 2.00, 1: 1.48, 2: 1.04, 3: 0.88, 4: 0.71; both workers pinned
to one core: 1.00.
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

#: A worker spins until the common end the grader sends (CLOCK_MONOTONIC, one clock for every
#: process) and answers the CPU time it got: a worker that starts late gets less, so workers run
#: one after the other (one core) count as one core, not as two.
_WORKER = """\
import sys, time
for line in sys.stdin:
    end, c0 = float(line), time.process_time()
    while time.monotonic() < end:
        pass
    sys.stdout.write("%r\\n" % (time.process_time() - c0))
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
            self._spin()  # untimed: the workers' start-up is not the machine's business
        return self._spin()

    def _spin(self) -> float:
        end = time.monotonic() + SPIN_SECONDS
        for w in self._workers:
            w.stdin.write(f"{end!r}\n")
            w.stdin.flush()
        deadline, total = time.monotonic() + self.timeout, 0.0
        for w in self._workers:
            ready, _, _ = select.select([w.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = w.stdout.readline() if ready else ""
            if not line:
                raise RuntimeError(f"the grader's capacity workers did not answer within "
                                   f"{self.timeout:.0f} s (a grader bug)")
            total += float(line)
        return total / SPIN_SECONDS

    def enough(self, capacity: float) -> bool:
        """Whether ``capacity`` is enough to judge a speedup on ``processes`` processes."""
        return capacity >= FREE_FRACTION * self.processes
