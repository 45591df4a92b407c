"""Speedup checks: measured, never assumed.

A speedup is a ratio of medians over repeats, after warm-up, measured in one run, with the
device synchronized inside each timed call. The grader times each call *from its own
process* (wall-clock round trip to the sandbox), so student code cannot fake its timings.
It compares the student's speedup with the reference solution's, measured the same way in
the same run on the same machine, and passes at a stated fraction of it. Where there is no
reference (the student edition) it uses a stated fixed threshold and says the instructor's
grade may differ. Where the hardware cannot show a speedup the check is skipped with a reason.
"""
from __future__ import annotations

import statistics
import time

from .sandbox import Sandbox
from .submission import cell_source, is_answer_cell, is_setup_cell, nbgrader_meta, read_notebook

#: The student passes at this fraction of the reference solution's speedup.
FRACTION_OF_REFERENCE = 0.8


def timed_calls(call, probe, *args, warmup: int = 1, repeats: int = 5) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``probe`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call(probe, *args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(probe, *args)
        times.append(time.perf_counter() - start)
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)


def reference_cells(assignment: str, ids: list[str] | None = None) -> list[tuple[str, str]] | None:
    """The reference solution's runnable cells (those with ``ids``, if given), or None where
    solutions/ is absent (the student edition)."""
    from .assignments import ASSIGNMENTS

    path = ASSIGNMENTS[assignment].source
    if not path.exists():
        return None
    nb = read_notebook(path)
    cells = [(nbgrader_meta(c).get("grade_id", "setup"), cell_source(c))
             for c in nb.cells if is_setup_cell(c) or is_answer_cell(c)]
    return [c for c in cells if ids is None or c[0] in ids]


def reference_speedup(assignment: str, measure) -> float | None:
    """Run ``measure(call) -> speedup`` against the reference solution in its own sandbox."""
    cells = reference_cells(assignment)
    if cells is None:
        return None
    with Sandbox(cells=cells) as ref:
        ref.start()
        return measure(ref.call)


def judge(student: float, reference: float | None, fixed_threshold: float, what: str) -> None:
    """Pass or fail a measured speedup against the reference (or the fixed threshold)."""
    if reference is not None:
        need = FRACTION_OF_REFERENCE * reference
        assert student >= need, (
            f"{what}: your speedup is {student:.2f}x; the reference solution reached "
            f"{reference:.2f}x in this same run, and {FRACTION_OF_REFERENCE:.0%} of it "
            f"({need:.2f}x) is needed")
        print(f"{what}: {student:.2f}x (reference {reference:.2f}x)")
    else:
        assert student >= fixed_threshold, (
            f"{what}: your speedup is {student:.2f}x; this student edition has no reference "
            f"solution, so it asks for a fixed {fixed_threshold:.2f}x (your instructor's grade "
            f"compares with the reference on the grading machine and may differ)")
        print(f"{what}: {student:.2f}x (needed {fixed_threshold:.2f}x)")
