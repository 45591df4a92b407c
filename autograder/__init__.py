"""The workshop's autograder.

- ``python -m autograder grade NOTEBOOK`` grades a submission (see :mod:`autograder.cli`).
- :func:`check` is the bridge used by the assignment notebooks' test cells and for
  self-checking in JupyterLab: ``check("allreduce")``.
"""
from __future__ import annotations

__all__ = ["check"]


def check(function: str, assignment: str | None = None, *, timeout: float = 600.0) -> None:
    """Grade the notebook's current definitions for one function; raise AssertionError if any check fails.

    The functions and classes defined in the calling notebook are serialised (cloudpickle)
    and graded by a fresh grader process, which runs them in a sandboxed child: nothing
    patched in this kernel can change the verdict. Returns None (nbgrader reads a returned
    number as partial credit). Prints the checks' table to stdout; never writes to stderr,
    which nbgrader would count as a failure.
    """
    import inspect
    import json
    import os
    import subprocess
    import sys
    import tempfile

    import cloudpickle

    from .assignments import for_function

    if os.environ.get("AUTOGRADER_DEFER_CHECKS") == "1":
        print(f"{function}: graded by nbgrader's isolated grading run after the notebook ran")
        return None
    assignment = assignment or for_function(function)
    caller = inspect.currentframe().f_back.f_globals
    module = caller.get("__name__", "__main__")
    objects = {}
    for name, obj in list(caller.items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            objects[name] = obj
    with tempfile.TemporaryDirectory(prefix="check-") as tmp:
        pkl, report_path = os.path.join(tmp, "objects.pkl"), os.path.join(tmp, "report.json")
        try:
            data = cloudpickle.dumps(objects)
        except Exception as exc:
            raise AssertionError(f"your definitions could not be sent to the grader: {exc}") from None
        with open(pkl, "wb") as f:
            f.write(data)
        proc = subprocess.run(
            [sys.executable, "-m", "autograder", "grade-objects", pkl, "--assignment", assignment,
             "--only", function, "--report", report_path],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if not os.path.exists(report_path):
            raise AssertionError("the grader did not finish:\n" + (proc.stdout + proc.stderr)[-2000:])
        with open(report_path) as f:
            report = json.load(f)
    results = report["results"]
    if not results:
        raise AssertionError(f"no checks named {function!r} in {assignment}")
    failed = []
    for r in results:
        tag = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[r["status"]]
        print(f"{tag}  {r['name']}  ({r['points']:g}/{r['max_points']:g})"
              + (f"\n      {r['message']}" if r["message"] else ""))
        if r["status"] == "failed":
            failed.append(r)
    if any(r["status"] == "skipped" for r in results):
        print("SKIP means this machine cannot measure it; no points were measured here, and "
              "the grade on the grading machine may differ.")
    if failed:
        raise AssertionError(f"{len(failed)} of {len(results)} check(s) of {function} failed: "
                             + "; ".join(f"{r['name']}: {r['message']}" for r in failed)[:3000])
    print(f"{function}: all {len(results)} check(s) passed or skipped")
