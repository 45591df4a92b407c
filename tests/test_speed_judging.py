"""How a speed check judges its rounds (autograder/checking/speed.py, capacity.py), without a
grading: the same code against the reference passes, code clearly below 80% of it fails, a
reference that cannot show a speedup makes a SKIP; without a reference (the student edition),
a fixed threshold is asked, and only where the grader measures that the machine gives the timed
CPU processes their cores: on a busy machine the check is a SKIP, never a FAIL of correct code
(the bug this fixes: A10's reference got 0.82x against a fixed 1.2x in the student edition
while ``make test-all`` ran). The capacity itself is measured for real: 2 processes pinned to
one core get at most one core's worth. And a checks module that cannot be imported is a loud
grader error, not a grading of 0 / 0.

Tier: quick (about 5 s).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO

from autograder.checking import speed
from autograder.checking.capacity import FREE_FRACTION, Capacity


class FakeCapacity:
    """A Capacity that reports ``free`` cores each round and records that it was closed."""

    made: list["FakeCapacity"] = []

    def __init__(self, free: float):
        self.free, self.processes, self.closed, self.measured = free, None, False, 0

    def __call__(self, processes: int) -> "FakeCapacity":
        self.processes = processes
        FakeCapacity.made.append(self)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True

    def measure(self) -> float:
        self.measured += 1
        return self.free

    def enough(self, capacity: float) -> bool:
        return capacity >= FREE_FRACTION * self.processes


def judge(rounds, **kwargs):
    it = iter(rounds)
    defaults = dict(what="the timed thing", fixed_threshold=1.2, reference_minimum=1.2)
    return speed.judge_rounds(lambda i: next(it), **{**defaults, **kwargs})


def wobble(student: float, reference: float | None):
    """Rounds whose values wobble by +-5% around the given speedups, forever."""
    for k in itertools.count():
        f = (0.95, 1.0, 1.05)[k % 3]
        yield student * f, None if reference is None else reference * f ** -1


def test_the_reference_against_itself_passes_and_half_of_it_fails(capsys):
    judge(wobble(1.4, 1.4), has_reference=True)
    assert "reference 1.4" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="reached 1.4.x in this same run") as failed:
        judge(wobble(0.7, 1.4), has_reference=True)
    assert "80% of it" in str(failed.value)


def test_a_reference_below_its_minimum_skips(monkeypatch):
    monkeypatch.setattr(speed, "Capacity", FakeCapacity(0.5))  # unused with a reference
    with pytest.raises(pytest.skip.Exception, match="even the reference solution reached only"):
        judge(wobble(0.5, 1.0), has_reference=True, processes=2)
    assert not any(c.measured for c in FakeCapacity.made)


def test_without_a_reference_a_busy_machine_skips_and_never_fails(monkeypatch):
    fake = FakeCapacity(1.3)
    monkeypatch.setattr(speed, "Capacity", fake)
    for student in (0.5, 1.5):  # a slow machine's correct code, and fast code
        with pytest.raises(pytest.skip.Exception, match=r"only 1\.30 cores' worth of CPU.*1\.8 "
                                                        r"are needed"):
            judge(wobble(student, None), has_reference=False, processes=2)
    assert fake.processes == 2 and fake.closed and fake.measured >= 6  # a second look first


def test_without_a_reference_an_idle_machine_asks_the_fixed_threshold(monkeypatch, capsys):
    monkeypatch.setattr(speed, "Capacity", FakeCapacity(1.97))
    judge(wobble(1.3, None), has_reference=False, processes=2)
    assert "needed 1.20x" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="asks for a fixed 1.20x"):
        judge(wobble(0.6, None), has_reference=False, processes=2)


def test_gpu_checks_measure_no_cpu_capacity(monkeypatch):
    FakeCapacity.made.clear()
    monkeypatch.setattr(speed, "Capacity", FakeCapacity(0.1))
    judge(wobble(1.3, None), has_reference=False, processes=None)
    assert FakeCapacity.made == []


def test_two_processes_on_one_core_measure_one_core_at_most():
    """For real: the grader's workers pinned to one core get about one core's worth; on the
    machine's cores, at most as many as there are workers."""
    code = ("import os\nfrom autograder.checking.capacity import Capacity\n"
            "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "with Capacity(2) as c:\n    print(max(c.measure() for _ in range(5)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert 0.3 < float(proc.stdout) < 1.15, proc.stdout
    with Capacity(2) as c:
        free = [c.measure() for _ in range(3)]
        workers = list(c._workers)
    assert all(0 < f <= 2.05 for f in free), free
    assert all(w.poll() is not None for w in workers)  # reaped
    assert not c.enough(1.79) and c.enough(1.8)


def test_a_checks_module_that_does_not_import_is_a_grader_error(monkeypatch, tmp_path):
    from autograder import registry
    from autograder.checking.harness import run_checks

    broken = tmp_path / "checks_broken.py"
    broken.write_text("from autograder.checking import no_such_module\n")
    real = registry.get("a1_data_parallel")
    fields = {k: getattr(real, k) for k in dir(real) if not k.startswith("_")}
    monkeypatch.setattr(registry, "get", lambda name: SimpleNamespace(
        **{**fields, "checks_path": broken}))
    with pytest.raises(RuntimeError, match="could not be loaded .a bug in the grader") as error:
        run_checks("a1_data_parallel", [])
    assert "no_such_module" in str(error.value)
