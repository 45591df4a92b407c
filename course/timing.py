"""Honest timing: synchronize the device, warm up, and report the median of repeats.

Why each part matters:
- CUDA is asynchronous: without :func:`course.devices.synchronize` you time the queueing.
- The first calls pay for lazy initialisation, memory allocation and kernel selection: warm up.
- One measurement is noise; the median of several is robust to the odd slow repeat.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from .devices import synchronize


class Timer:
    """Context manager that measures wall-clock seconds between synchronized points.

    >>> with Timer(devices) as t:
    ...     work()
    >>> t.seconds
    """

    def __init__(self, devices=None):
        self.devices = devices
        self.seconds = float("nan")

    def __enter__(self):
        synchronize(self.devices)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.devices)
        self.seconds = time.perf_counter() - self._start
        return False


@dataclass
class Measurement:
    """Seconds of each timed repeat; ``median`` is the number to compare."""

    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median: above ~0.2 the machine was busy; repeat the measurement."""
        return (max(self.times) - min(self.times)) / self.median if self.times else float("nan")

    def __str__(self) -> str:
        return (f"median {self.median * 1e3:.2f} ms over {len(self.times)} repeats "
                f"(min {min(self.times) * 1e3:.2f}, max {max(self.times) * 1e3:.2f})")


def benchmark(fn, *args, warmup: int = 2, repeats: int = 5, devices=None, **kwargs) -> Measurement:
    """Call ``fn(*args, **kwargs)`` ``warmup`` times untimed, then ``repeats`` times timed.

    Each timed call is bracketed by device synchronization.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    for _ in range(warmup):
        fn(*args, **kwargs)
    m = Measurement()
    for _ in range(repeats):
        with Timer(devices) as t:
            fn(*args, **kwargs)
        m.times.append(t.seconds)
    return m


def speedup(baseline: Measurement, candidate: Measurement) -> float:
    """How many times faster ``candidate`` is than ``baseline`` (ratio of medians)."""
    return baseline.median / candidate.median
