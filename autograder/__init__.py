"""The workshop's autograder.

- ``python -m autograder grade NOTEBOOK`` grades a submission (see :mod:`autograder.cli`).
- :func:`check` is the bridge used by the assignment notebooks' test cells and for
  self-checking in JupyterLab: ``check("allreduce")``.
"""
from __future__ import annotations

__all__ = ["check", "CheckFailed"]


class CheckFailed(AssertionError):
    """Some checks of a function failed. In a notebook it shows as its message alone: the
    failing cases, not the grader's own traceback (IPython renders ``_render_traceback_``)."""

    def _render_traceback_(self):
        return [f"CheckFailed: {self}"]


def check(function: str, assignment: str | None = None, *, timeout: float = 600.0) -> None:
    """Grade the notebook's current definitions for one function; raise CheckFailed (an
    AssertionError) if any check fails.

    The functions and classes defined in the calling notebook are serialised (cloudpickle)
    and graded by a fresh grader process, which runs them in a sandboxed child: nothing
    patched in this kernel can change the verdict. Returns None (nbgrader reads a returned
    number as partial credit). Prints the checks' table to stdout; never writes to stderr,
    which nbgrader would count as a failure.
    """
    import inspect
    import io
    import os
    import tempfile

    from .checking.spec import functions_of
    from .invoke import run_grader
    from .keys import is_reserved, reserved_points
    from .registry import ASSIGNMENTS
    from .results import FAILED, SKIPPED, result_lines

    if os.environ.get("AUTOGRADER_DEFER_CHECKS") == "1":
        print(f"{function}: graded by nbgrader's isolated grading run after the notebook ran")
        return None
    if assignment is None:
        owners = [a for a in ASSIGNMENTS if function in functions_of(a)]
        if len(owners) != 1:
            raise CheckFailed(f"no assignment has a check named {function!r}" if not owners else
                              f"{function!r} is checked in several assignments: {owners}; "
                              "pass assignment=")
        assignment = owners[0]
    caller = inspect.currentframe().f_back.f_globals
    module = caller.get("__name__", "__main__")
    objects = {name: obj for name, obj in list(caller.items())
               if not name.startswith("_") and getattr(obj, "__module__", None) == module
               and (inspect.isfunction(obj) or inspect.isclass(obj))}
    try:  # the launcher's pickler: a cached helper or a torch.ops call travels as in launch()
        from course.launch import pickler_keeping_filenames

        buffer = io.BytesIO()
        pickler_keeping_filenames()(buffer).dump(objects)
        data = buffer.getvalue()
    except Exception as exc:
        raise CheckFailed(f"your definitions could not be sent to the grader: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="check-") as tmp:
        pkl = os.path.join(tmp, "objects.pkl")
        with open(pkl, "wb") as f:
            f.write(data)
        run = run_grader(["grade-objects", pkl, "--assignment", assignment, "--only", function],
                         timeout=timeout)
    if run.report is None:
        raise CheckFailed("the grader did not finish:\n" + run.output[-2000:])
    results = run.report["results"]
    if not results:
        raise CheckFailed(f"no checks named {function!r} in {assignment}")
    for r in results:
        print("\n".join(result_lines(r)))
    reserved = reserved_points(results)
    if reserved:
        here = sum(r["max_points"] for r in results if r["status"] != SKIPPED)
        print(f"{function}: {here:g} point(s) checked here; {reserved:g} more when your "
              "instructor grades (hidden cases and the answer key)")
    if any(r["status"] == SKIPPED and not is_reserved(r) for r in results):
        print("SKIP means this machine cannot measure it; no points were measured here, and "
              "the grade on the grading machine may differ.")
    failed = [r for r in results if r["status"] == FAILED]
    if failed:
        raise CheckFailed(f"{len(failed)} of {len(results)} check(s) of {function} failed (seed "
                          f"{run.report.get('seed')}): " + "; ".join(
                              f"{r['name']}: {r['message'].splitlines()[0] if r['message'] else ''}"
                              for r in failed)[:3000])
    print(f"{function}: all {len(results)} check(s) passed or skipped")
