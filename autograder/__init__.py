"""The workshop's autograder.

- ``python -m autograder grade NOTEBOOK`` grades a submission (see :mod:`autograder.cli`).
- :func:`check` is the bridge used by the assignment notebooks' test cells and for
  self-checking in JupyterLab: ``check("allreduce")``.
"""
from __future__ import annotations

__all__ = ["check", "CheckFailed"]


class CheckFailed(AssertionError):
    """Some checks of a function failed. In a notebook it shows as its message alone, one line
    that counts (the FAIL lines printed above it say why, each reason once), not the grader's
    own traceback (IPython renders ``_render_traceback_``)."""

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

    import time

    from .checking.spec import functions_of, load_spec
    from .invoke import run_grader
    from .registry import ASSIGNMENTS
    from .results import FAILED, checks_lines

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
    checks = [c for c in load_spec(assignment).checks if c.function == function]
    print(f"grading {function}: {len(checks)} check{'s' if len(checks) != 1 else ''} in a "
          "sandbox ...", flush=True)
    started = time.monotonic()
    stubs = _unwritten(objects, assignment, [{"name": c.name} for c in checks])
    said, shown = set(), set()

    def show(result: dict) -> None:  # each check's lines as it ends
        if result.get("name") not in shown:
            shown.add(result.get("name"))
            print("\n".join(checks_lines([result], stubs=stubs, said=said)), flush=True)

    with tempfile.TemporaryDirectory(prefix="check-") as tmp:
        pkl = os.path.join(tmp, "objects.pkl")
        with open(pkl, "wb") as f:
            f.write(data)
        run = run_grader(["grade-objects", pkl, "--assignment", assignment, "--only", function],
                         timeout=timeout, progress=show)  # forked from a warm template
        if run.note:
            print(run.note, flush=True)
    seconds = time.monotonic() - started
    if run.report is None:
        raise CheckFailed("the grader did not finish:\n" + run.output[-2000:])
    results = run.report["results"]
    if not results:
        raise CheckFailed(f"no checks named {function!r} in {assignment}")
    for r in results:  # the report is what counts: anything the progress lines missed
        show(r)
    summary = _summary(function, results)
    if any(r["status"] == FAILED for r in results):
        raise CheckFailed(f"{summary[:-1]}; inputs from seed {run.report.get('seed')}; "
                          f"{seconds:.1f} s): the FAIL lines above say why")
    print(f"{summary} in {seconds:.1f} s")


def _summary(function: str, results: list[dict]) -> str:
    """One line: how many checks passed, what else happened to the others, and the points:
    "copy_params: 2 of 2 checks passed (2/2 points)"."""
    from .keys import is_reserved
    from .results import FAILED, PASSED, SKIPPED

    reserved = [r for r in results if is_reserved(r)]
    skipped = [r for r in results if r["status"] == SKIPPED and not is_reserved(r)]
    passed = sum(r["status"] == PASSED for r in results)
    failed = sum(r["status"] == FAILED for r in results)
    n = len(results)
    line = f"{function}: {passed} of {n} check{'s' if n != 1 else ''} passed"
    line += f", {failed} failed" if failed else ""
    line += f", {len(skipped)} skipped" if skipped else ""
    line += f", {len(reserved)} hidden" if reserved else ""
    earned = sum(r["points"] for r in results)
    here = sum(r["max_points"] for r in results if not is_reserved(r))
    points = [f"{earned:g}/{here:g} points" + (" here" if reserved else "")]
    if skipped:
        points.append("a skipped check earns no points")
    if reserved:
        points.append(f"{sum(r['max_points'] for r in reserved):g} more when your instructor "
                      "grades")
    return f"{line} ({'; '.join(points)})"


def _unwritten(objects: dict, assignment: str, results: list[dict]) -> tuple[str, ...]:
    """The functions among those the checked ones run (and the helpers they call) that are
    still stubs: nothing but a docstring and ``raise NotImplementedError``. A stub's failure
    says which function it is (the grader cannot: the kernel's code is in no cell it ran)."""
    import ast
    import inspect
    import textwrap

    from .checking.spec import load_spec

    spec = load_spec(assignment)
    names = set()
    for r in results:
        try:
            runs = spec.check(r["name"]).runs
        except KeyError:
            continue
        names.add(runs)
        names.update(next((f.helpers for f in spec.functions if f.name == runs), ()))
    stubs = []
    for name in sorted(names):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(objects[name])))
        except (KeyError, OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(
            tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in \
                ast.unparse(body[0].exc or ast.Constant(None)):
            stubs.append(name)
    return tuple(stubs)
