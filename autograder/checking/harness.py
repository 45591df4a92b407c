"""The harness: run an assignment's checks (a pytest file) against one sandboxed submission.

A checks module (``autograder/assignments/<name>/checks.py``) is a pytest file. Each check is a
test function decorated with its spec's :meth:`~autograder.checking.spec.Spec.graded`, and takes
the ``student`` fixture: a :class:`Student` whose :meth:`Student.call` runs a *probe* (a function
of the assignment's ``probes`` module) inside the sandbox. The check then judges the returned
plain data here, in the grader's own process.

A call that times out marks the student function it runs as hung: that check fails, and so do
the function's remaining checks, at once and with the same message, without calling it again.

:func:`run_checks` runs one checks module under pytest, in this process, and returns a
:class:`~autograder.results.Report`. Nothing the student code does can reach this process
except the plain data its probes return.
"""
from __future__ import annotations

import time

import pytest

from ..keys import RESERVED, has_key
from ..results import FAILED, PASSED, SKIPPED, SPEED_NOT_MEASURED, CheckResult, Report
from ..sandbox import MAX_CALL_TIMEOUT, CallTimeout, Sandbox, SandboxError
from . import timeouts
from .spec import Check


class Student:
    """The checks' handle on the sandboxed submission."""

    def __init__(self, sandbox: Sandbox, calibration: dict[str, float] | None):
        self.sandbox = sandbox
        self.calibration = calibration
        self.check: Check | None = None          # the check running now
        self.hung: dict[str, str] = {}           # student function -> why it is hung
        self.call_seconds: dict[str, float] = {}  # check -> its longest call
        self._load_failure: str | None = None
        self._shared: dict[str, tuple[bool, object]] = {}

    @property
    def timeout(self) -> float:
        return timeouts.call_timeout(self.check, self.calibration) if self.check else 30.0

    def begin(self, check: Check) -> None:
        """Before a check: fail it at once if the function it runs already hung."""
        self.check = check
        if check.runs in self.hung:
            raise AssertionError(self.hung[check.runs])

    def call(self, probe, *args, timeout: float | None = None):
        """Run ``probe(namespace, *args)`` in the sandbox; a failure fails the check (AssertionError)."""
        if self._load_failure:
            raise AssertionError(self._load_failure)
        limit = min(timeout or self.timeout, MAX_CALL_TIMEOUT)
        start = time.perf_counter()
        try:
            if self.sandbox.loading or not self.sandbox.alive():
                self._start()
            return self.sandbox.call(probe, *args, timeout=limit)
        except CallTimeout:
            check = self.check.name if self.check else "?"
            function = self.check.runs if self.check else probe.__name__
            self.hung[function] = (
                f"timed out: {function} did not return within {limit:g} s in check {check} (a "
                "loop that never ends, a process or a collective that waits forever?); its "
                "other checks fail without calling it again")
            raise AssertionError(self.hung[function]) from None
        except SandboxError as exc:
            message = str(exc)
            if "is not defined" in message:
                for cell_id, err in self.sandbox.cell_errors.items():
                    message += f"\n(cell {cell_id!r} failed while loading: {err.splitlines()[0]})"
            raise AssertionError(message) from None
        finally:
            if self.check:
                spent = time.perf_counter() - start
                self.call_seconds[self.check.name] = max(spent, self.call_seconds.get(self.check.name, 0.0))

    def shared(self, key: str, compute):
        """``compute()`` once for every check that asks for ``key``: one multi-process run
        shared by several checks of a function (each run costs seconds of process start-up);
        a failure is remembered and fails each of them alike."""
        if key not in self._shared:
            try:
                self._shared[key] = (True, compute())
            except AssertionError as exc:
                self._shared[key] = (False, str(exc))
        ok, value = self._shared[key]
        if not ok:
            raise AssertionError(value)
        return value

    def with_own_helpers(self, function: str, helpers, run, note, uses: str = "calls your"):
        """``run()``, which grades ``function`` with the submission's own ``helpers``. Not run
        where one of them hung in its own checks; where it fails (not by timing out), the
        message adds ``note()``, computed once per grading: what is wrong with those helpers."""
        hung = [h for h in helpers if h in self.hung]
        if hung:
            raise AssertionError(f"{function} {uses} {' and '.join(hung)}, which did not return "
                                 f"in its own checks: {function} was not run")
        try:
            return run()
        except AssertionError as exc:
            if str(exc).startswith("timed out"):
                raise
            raise AssertionError(f"{exc}\n{self.shared(f'{function} helpers', note)}") from None

    def _start(self):
        try:
            if self.sandbox.loading:
                self.sandbox.finish_start()
            else:
                self.sandbox.start()
        except SandboxError as exc:
            self._load_failure = f"your notebook's code could not be loaded: {exc}"
            raise AssertionError(self._load_failure) from None


def skip_unless(condition: bool, reason: str) -> None:
    """Skip a check with a reason the student reads (never pass it silently)."""
    if not condition:
        pytest.skip(reason)


class _Collector:
    """pytest plugin: provides the ``student`` fixture and records each check's outcome."""

    def __init__(self, student: Student, only: set[str] | None, measure_speed: bool = True,
                 key_present: bool = True, progress=None):
        self._student = student
        self._progress = progress  # called with each result as it is recorded
        self.key_present = key_present
        self.only = only
        self.measure_speed = measure_speed
        self.results: list[CheckResult] = []
        self.collect_errors: list[str] = []
        self._checks: dict[str, Check] = {}

    @pytest.fixture(scope="session")
    def student(self):
        yield self._student
        self._student.sandbox.close()

    @pytest.fixture
    def _begin_check(self, request):
        check = self._checks[request.node.nodeid]
        if check.hidden and not self.key_present:
            pytest.skip(RESERVED)
        if check.speed and not self.measure_speed:
            pytest.skip(SPEED_NOT_MEASURED)
        self._student.begin(check)

    def pytest_configure(self, config):
        config.addinivalue_line("markers", "graded(check): a graded check")

    def pytest_collectreport(self, report):
        if report.failed:  # the checks module did not import: a grader bug, never a 0 / 0
            self.collect_errors.append(str(report.longrepr)[-3000:])

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        keep = []
        for item in items:
            mark = item.get_closest_marker("graded")
            if mark is None or (self.only and mark.kwargs["check"].function not in self.only
                                and mark.kwargs["check"].name not in self.only):
                continue
            self._checks[item.nodeid] = mark.kwargs["check"]
            item.fixturenames.insert(0, "_begin_check")
            keep.append(item)
        items[:] = keep

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        check = self._checks.get(item.nodeid)
        if check is None:
            return
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._record(check, SKIPPED, report.duration, reason.removeprefix("Skipped: "))
        elif report.failed:
            self._record(check, FAILED, report.duration,
                         _message(call.excinfo) if call.excinfo else str(report.longrepr)[-500:])
        elif report.when == "call":
            # what a passing check printed (a measured speedup) is worth showing the student
            self._record(check, PASSED, report.duration, report.capstdout.strip()[-500:])

    def _record(self, check: Check, status, seconds, message):
        if any(r.name == check.name for r in self.results):  # a teardown error after a pass
            return
        got = check.points if status == PASSED else 0.0
        self.results.append(CheckResult(check.name, check.function, check.points, got, status,
                                        seconds, message,
                                        self._student.call_seconds.get(check.name, 0.0)))
        if self._progress is not None:
            self._progress(self.results[-1])


def _message(excinfo) -> str:
    exc = excinfo.value
    if isinstance(exc, AssertionError):
        text = str(exc).split("\nassert ")[0]
        return text or "assertion failed"
    if excinfo.typename == "Failed" and "Timeout" in str(exc):
        return f"timed out: {exc}"
    return f"{excinfo.typename}: {exc}"[:800]


def only_names(only: str | None) -> set[str]:
    """The names of ``--only F,CHECK`` (functions or checks), blanks left out."""
    return {n.strip() for n in (only or "").split(",") if n.strip()}


def run_checks(assignment: str, cells: list[tuple[str, str]], *, objects: bytes | None = None,
               only: str | None = None, problems: list[str] | None = None,
               seed: int | None = None, measure_speed: bool = True, progress=None) -> Report:
    """Grade ``cells`` (and/or pickled ``objects``) with the checks of ``assignment``; ``only``
    names functions or checks (``"f"`` or ``"f,check_name"``); ``seed`` repeats a run's inputs; without
    ``measure_speed`` the speed checks SKIP unrun (timings on a shared machine mean nothing);
    ``progress(result)`` is called as each check ends (the report has them all)."""
    from ..registry import get
    from .spec import load_spec

    path = get(assignment).checks_path
    sandbox = Sandbox(cells=cells, objects=objects, rank_modules=load_spec(assignment).rank_modules)
    sandbox.begin_start()  # the worker imports torch and runs the cells while we import ours

    from course.devices import hardware_summary

    from ..sandbox.isolation import isolation_summary
    from .expect import set_run_seed

    seed = set_run_seed(seed)
    calibration = timeouts.calibrated(assignment)
    student = Student(sandbox, calibration)
    wanted = only_names(only) or None
    key_present = has_key(assignment)
    collector = _Collector(student, wanted, measure_speed, key_present, progress)
    args = [str(path), "-p", "no:cacheprovider", "-p", "no:terminal", "-p", "no:randomly",
            # only the plugin the checks use (their backstop timeouts); pytest's end-of-session
            # collections for unraisable exceptions (the checks run none of the submission's
            # code here) and the other installed plugins' imports cost 0.7 s a grading
            "--disable-plugin-autoload", "-p", "pytest_timeout", "-p", "no:unraisableexception",
            "-o", "addopts=",
            # assertion rewriting for the checks module only: "*.py" would rewrite every module
            # imported while grading (sympy, by autograd's first backward: seconds each time)
            "-o", f"python_files={path.name}", "--rootdir", str(path.parent), "-W", "ignore"]
    start = time.monotonic()
    try:
        pytest.main(args, plugins=[collector])
    finally:
        student.sandbox.close()
    if collector.collect_errors:
        raise RuntimeError(f"the grader's checks of {assignment} could not be loaded (a bug in "
                           "the grader, not in the submission):\n" + "\n".join(collector.collect_errors))
    report = Report(assignment, hardware_summary(), isolation_summary(), seed,
                    collector.results, list(problems or []))
    for cell_id, err in student.sandbox.cell_errors.items():
        report.notes.append(f"cell {cell_id!r} raised while loading: {err}")
    report.notes.append("call timeouts: " + ("calibrated on this machine (20 x the reference's)"
                                             if calibration else "the spec's defaults"))
    if not measure_speed:
        report.notes.append("speed checks not run (--speed skip)")
    from ..keys import is_reserved

    reserved = [r for r in collector.results if is_reserved(r)]
    if not key_present and reserved:  # only where this run left hidden checks out
        report.notes.append(
            f"no answer key here (the student edition): the public checks ran; {len(reserved)} "
            f"hidden check(s), {sum(r.max_points for r in reserved):g} point(s), are checked "
            "when your instructor grades")
    report.notes.append(f"graded in {time.monotonic() - start:.1f} s")
    return report
