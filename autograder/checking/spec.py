"""What an assignment's ``spec.py`` declares: its contract with the grader.

Each assignment's ``autograder/assignments/<name>/spec.py`` builds one :class:`Spec`: the
student functions (names and parameters, and which other graded functions each may call) and
the graded checks (name, the function they grade, points, per-call timeout). It is the single
source of points: the checks module takes them from here (:meth:`Spec.graded`), and a test
compares them with the notebooks' nbgrader metadata.

Imported in the grader and in the sandbox (probes look up parameters here), so it imports
nothing heavy: pytest only inside :meth:`Spec.graded`, which runs in the grader.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

#: Seconds one call of a probe may take when this machine has no calibration (see
#: :mod:`autograder.checking.timeouts`); a check that needs more says so in its spec.
DEFAULT_CALL_TIMEOUT = 20.0


@dataclass(frozen=True)
class Function:
    """A function (or class) the student writes."""
    name: str
    params: tuple[str, ...]
    #: graded functions it may call: while it is graded, those are the reference's (where the
    #: reference is at hand), so that a bug costs the points of one function only
    helpers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Check:
    """One graded check: the pytest function ``test_<name>`` in the checks module."""
    name: str
    function: str          # what the report groups it under ("f" or "f_speedup")
    points: float
    timeout: float = DEFAULT_CALL_TIMEOUT  # seconds per call of a probe, uncalibrated
    calls: str = ""        # the student function it runs ("" = ``function``)
    speed: bool = False    # measures a speedup
    #: needs the instructor's answer key (hidden cases, the reference implementation): SKIPPED
    #: with :data:`autograder.keys.RESERVED` where the key is absent (the student edition)
    hidden: bool = False

    @property
    def runs(self) -> str:
        """The student function whose hang fails this check at once."""
        return self.calls or self.function


@dataclass(frozen=True)
class Spec:
    assignment: str
    functions: tuple[Function, ...]
    checks: tuple[Check, ...]
    #: CPU cores its speed checks need to themselves (``grade-folder --jobs`` gives each
    #: submission this many, where the machine has them; with fewer they SKIP with the reason)
    cores_for_speed: int = 1
    #: GPUs its speed checks need to themselves (0: none; a machine with fewer SKIPs them)
    gpus_for_speed: int = 0
    #: None when its checks start no ranks; else the modules its ranks import beyond torch and
    #: torch.distributed (may be empty). Then the sandbox starts the ranks' fork server with
    #: them preloaded as the submission loads: no rank pays for those imports again.
    rank_modules: tuple[str, ...] | None = None

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"{self.assignment}: no check named {name!r} in its spec")

    def points(self) -> dict[str, float]:
        """``{function: total points}`` in check order (speedups as ``f_speedup``)."""
        totals: dict[str, float] = {}
        for c in self.checks:
            totals[c.function] = totals.get(c.function, 0.0) + c.points
        return totals

    def graded(self, test):
        """Decorator for ``test_<name>`` in the checks module: marks it with its check's
        function and points (from this spec) for the harness."""
        import pytest

        check = self.check(test.__name__.removeprefix("test_"))
        test = pytest.mark.graded(check=check)(test)
        # a backstop only: every call inside has its own timeout, and hangs fail fast
        return pytest.mark.timeout(max(600.0, 10 * check.timeout))(test)


def load_spec(assignment: str) -> Spec:
    """The :class:`Spec` of ``assignment`` (``autograder.assignments.<name>.spec.SPEC``)."""
    return importlib.import_module(f"autograder.assignments.{assignment}.spec").SPEC


def functions_of(assignment: str) -> dict[str, float]:
    """``{function: total points}`` for an assignment's checks, in check order."""
    return load_spec(assignment).points()
