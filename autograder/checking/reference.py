"""The reference solution, where it is at hand (the instructor's repository; the student edition
has no ``solutions/``): its cells, and a namespace holding its definitions.

Used by the speed checks, to measure the reference in a sandbox of its own that never runs
student code (:func:`autograder.checking.speed.reference_sandbox`), and by the benchmark
(``autograder.bench``). Nothing of it is sent into a sandbox that runs student code: there,
every function is graded with the student's own versions of the functions it calls. The
namespace's ``__name__`` is not an importable module, so cloudpickle sends its functions to
ranks by value.
"""
from __future__ import annotations

import contextlib
import io


def reference_cells(assignment: str, ids: list[str] | None = None) -> list[tuple[str, str]] | None:
    """The reference solution's runnable cells (those with ``ids``, if given), or None where
    solutions/ is absent (the student edition)."""
    from ..notebook import runnable_cells
    from ..registry import get

    path = get(assignment).source
    return runnable_cells(path, ids) if path.exists() else None


def reference_namespace(cells: list[tuple[str, str]]) -> dict:
    """Execute ``cells`` (the set-up cell's printout swallowed) in a fresh namespace."""
    ns: dict = {"__name__": "__reference__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for cell_id, source in cells:
            exec(compile(source, f"<reference {cell_id}>", "exec", dont_inherit=True), ns)
    return ns
