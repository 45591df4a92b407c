"""The shared harness: load the submission -> run it isolated -> run the checks -> report.

A check module (``autograder/checks/<assignment>.py``) is a pytest file. Each check is a test
function decorated with :func:`graded`, which names the student function it grades and its
points, and takes the ``student`` fixture: a :class:`Student` whose :meth:`Student.call` runs a
*probe* (a module-level function of the same check module) inside the sandbox. The check then
judges the returned plain data here, in the grader's own process.

:func:`run_checks` runs one check module under pytest, in this process, and returns a
:class:`Report`. Nothing the student code does can reach this process except the plain data
its probes return.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import asdict, dataclass, field

import pytest

from .sandbox import Sandbox, SandboxError

SPEEDUP_MARK = "speedup"


def graded(function: str, points: float, *, timeout: float = 60.0, speedup: bool = False):
    """Mark a check: it grades ``function`` and is worth ``points``."""
    def wrap(test):
        test = pytest.mark.graded(function=function, points=points)(test)
        test = pytest.mark.timeout(timeout + 30)(test)  # backstop; calls have their own timeouts
        if speedup:
            test = pytest.mark.speedup(test)
        test._call_timeout = timeout
        return test
    return wrap


def functions_of(assignment: str) -> dict[str, float]:
    """``{function: total points}`` for an assignment's checks, in check order."""
    module = importlib.import_module(f"autograder.checks.{assignment}")
    totals: dict[str, float] = {}
    for obj in vars(module).values():
        for mark in getattr(obj, "pytestmark", []):
            if mark.name == "graded":
                f = mark.kwargs["function"]
                totals[f] = totals.get(f, 0) + mark.kwargs["points"]
    return totals


# ---------------------------------------------------------------- what checks use

class Student:
    """The checks' handle on the sandboxed submission."""

    def __init__(self, sandbox: Sandbox, submission_problems: list[str]):
        self.sandbox = sandbox
        self.problems = submission_problems
        self._load_failure: str | None = None
        self.timeout = 30.0

    def call(self, probe, *args, timeout: float | None = None):
        """Run ``probe(namespace, *args)`` in the sandbox; a failure fails the check (AssertionError)."""
        if self._load_failure:
            raise AssertionError(self._load_failure)
        try:
            if not self.sandbox.alive():
                self._start()
            return self.sandbox.call(probe, *args, timeout=timeout or self.timeout)
        except SandboxError as exc:
            message = str(exc)
            if "is not defined" in message:
                for cell_id, err in self.sandbox.cell_errors.items():
                    message += f"\n(cell {cell_id!r} failed while loading: {err.splitlines()[0]})"
            raise AssertionError(message) from None

    def _start(self):
        try:
            self.sandbox.start()
        except SandboxError as exc:
            self._load_failure = f"your notebook's code could not be loaded: {exc}"
            raise AssertionError(self._load_failure) from None

    def cell_error(self, cell_id: str) -> str | None:
        return self.sandbox.cell_errors.get(cell_id)


def skip_unless(condition: bool, reason: str) -> None:
    """Skip a check with a reason the student reads (never pass it silently)."""
    if not condition:
        pytest.skip(reason)


# ---------------------------------------------------------------- results

@dataclass
class CheckResult:
    name: str
    function: str
    max_points: float
    points: float
    status: str        # passed | failed | skipped
    seconds: float
    message: str = ""


@dataclass
class Report:
    assignment: str
    hardware: str
    isolation: str
    results: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_score(self) -> float:
        """Points that could be earned here (skipped checks are not counted)."""
        return sum(r.max_points for r in self.results if r.status != "skipped")

    def by_function(self) -> dict[str, tuple[float, float, list[CheckResult]]]:
        out: dict[str, tuple[float, float, list[CheckResult]]] = {}
        for r in self.results:
            got, top, rs = out.get(r.function, (0.0, 0.0, []))
            out[r.function] = (got + r.points, top + r.max_points, [*rs, r])
        return out

    def to_dict(self) -> dict:
        return {"assignment": self.assignment, "hardware": self.hardware,
                "isolation": self.isolation, "score": self.score, "max_score": self.max_score,
                "notes": self.notes, "results": [asdict(r) for r in self.results]}


class _Collector:
    """pytest plugin: provides the ``student`` fixture and records each check's outcome."""

    def __init__(self, sandbox: Sandbox, problems: list[str]):
        self.sandbox = sandbox
        self.problems = problems
        self.results: list[CheckResult] = []
        self._marks: dict[str, tuple[str, float]] = {}

    @pytest.fixture(scope="session")
    def student(self):
        s = Student(self.sandbox, self.problems)
        yield s
        self.sandbox.close()

    @pytest.fixture
    def _timeouts(self, request, student):
        student.timeout = getattr(request.function, "_call_timeout", 30.0)

    def pytest_configure(self, config):
        config.addinivalue_line("markers", "graded(function, points): a graded check")
        config.addinivalue_line("markers", "speedup: a check that measures a speedup")

    def pytest_collection_modifyitems(self, items):
        for item in items:
            mark = item.get_closest_marker("graded")
            if mark:
                self._marks[item.nodeid] = (mark.kwargs["function"], float(mark.kwargs["points"]))
                item.fixturenames.insert(0, "_timeouts")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if item.nodeid not in self._marks:
            return
        function, points = self._marks[item.nodeid]
        name = item.name.removeprefix("test_")
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._record(name, function, points, "skipped", report.duration,
                         reason.removeprefix("Skipped: "))
        elif report.failed:
            self._record(name, function, points, "failed", report.duration,
                         _message(call.excinfo) if call.excinfo else str(report.longrepr)[-500:])
        elif report.when == "call":
            # what a passing check printed (a measured speedup) is worth showing the student
            self._record(name, function, points, "passed", report.duration,
                         report.capstdout.strip()[-500:])

    def _record(self, name, function, points, status, seconds, message):
        if any(r.name == name for r in self.results):  # a teardown error after a pass
            return
        got = points if status == "passed" else 0.0
        self.results.append(CheckResult(name, function, points, got, status, seconds, message))


def _message(excinfo) -> str:
    exc = excinfo.value
    if isinstance(exc, AssertionError):
        text = str(exc).split("\nassert ")[0]
        return text or "assertion failed"
    if excinfo.typename == "Failed" and "Timeout" in str(exc):
        return f"timed out: {exc}"
    return f"{excinfo.typename}: {exc}"[:800]


def run_checks(assignment: str, cells: list[tuple[str, str]], *, objects: bytes | None = None,
               only: str | None = None, problems: list[str] | None = None) -> Report:
    """Grade ``cells`` (and/or pickled ``objects``) with the checks of ``assignment``."""
    from course.devices import hardware_summary
    from .assignments import ASSIGNMENTS
    from .sandbox import isolation_summary

    a = ASSIGNMENTS[assignment]
    sandbox = Sandbox(cells=cells, objects=objects)
    collector = _Collector(sandbox, list(problems or []))
    args = [str(a.checks_path), "-p", "no:cacheprovider", "-p", "no:terminal",
            "-p", "no:randomly", "-o", "addopts=",
            # assertion rewriting for the check modules only: "*.py" would rewrite every module
            # imported while grading (sympy, by autograd's first backward: seconds each time)
            "-o", f"python_files={a.checks_path.stem}*.py",
            "--rootdir", str(a.checks_path.parent), "-W", "ignore"]
    plugins = [collector] + ([_OnlyFunction(only)] if only else [])
    start = time.monotonic()
    try:
        pytest.main(args, plugins=plugins)
    finally:
        sandbox.close()
    report = Report(assignment, hardware_summary(), isolation_summary(), collector.results,
                    list(problems or []))
    for cell_id, err in sandbox.cell_errors.items():
        report.notes.append(f"cell {cell_id!r} raised while loading: {err}")
    report.notes.append(f"graded in {time.monotonic() - start:.1f} s")
    return report


class _OnlyFunction:
    """pytest plugin: keep only the checks of some student functions (``"f"`` or ``"f,g"``)."""

    def __init__(self, functions: str):
        self.functions = {f.strip() for f in functions.split(",") if f.strip()}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        keep = [i for i in items if (m := i.get_closest_marker("graded"))
                and m.kwargs["function"] in self.functions]
        items[:] = keep
