"""``python -m autograder.bench check-latency [--repeats 3] [--doc PATH | --no-doc]``: how long a
student waits for ``check()``, and a whole grading.

In this process (a stand-in for a notebook's kernel: it imports torch first, as every
assignment notebook does), the reference's set-up and answer cells of an assignment are run in a
namespace named ``__main__`` and ``check(function)`` is called ``--repeats`` times in a row, as a
student re-running a check cell does: for a one-process function of A1 (``copy_params``) and a
multi-process one of A2 (``average_gradients``: gloo ranks). Then A1's reference is graded whole,
``python -m autograder grade`` through :func:`autograder.invoke.run_grader` as nbgrader and
``grade-folder`` do (forked from the same warm template), speed checks skipped. Beside them, ``python -c "import torch"`` in a fresh process (the median of
``--repeats``): the yardstick for a start-up.

Needs ``solutions/`` (the answers it checks are the reference's, read from there, never kept in
this file). Each row: the first call, the median of the others, and the ratio of that median to
``import torch``. The Markdown table goes between :data:`BEGIN` and :data:`END` in
``docs/benchmarks.md`` (a rerun replaces it), with the machine, load and command.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from ..registry import REPO

BEGIN = "<!-- check latency: begin (python -m autograder.bench check-latency writes what follows) -->"
END = "<!-- check latency: end -->"
DOC = REPO / "docs" / "benchmarks.md"
CASES = (("a1_data_parallel", "data_parallel.ipynb", "copy_params"),
         ("a2_ddp", "ddp.ipynb", "average_gradients"))


def import_torch_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def kernel_namespace(assignment: str, notebook: str) -> dict:
    """The reference's set-up and answer cells run in a fresh ``__main__``-named namespace, as
    a kernel that ran them holds them."""
    from ..notebook import runnable_cells

    module = types.ModuleType("__main__")
    ns = module.__dict__
    for cell_id, source in runnable_cells(REPO / "solutions" / assignment / notebook):
        exec(compile(source, f"<cell {cell_id}>", "exec"), ns)
    return ns


def time_checks(assignment: str, notebook: str, function: str, repeats: int) -> list[float]:
    ns = kernel_namespace(assignment, notebook)
    seconds = []
    for _ in range(repeats):
        out = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            exec(compile(f"check({function!r}, {assignment!r})", "<bench>", "exec"), ns)
        seconds.append(time.perf_counter() - start)
        if "FAIL" in out.getvalue():
            raise RuntimeError(f"the reference failed check({function!r}):\n{out.getvalue()}")
    return seconds


def time_grading(assignment: str, notebook: str, repeats: int) -> list[float]:
    from ..invoke import run_grader

    seconds = []
    for _ in range(repeats):
        run = run_grader(["grade", str(REPO / "solutions" / assignment / notebook),
                          "--assignment", assignment, "--speed", "skip"], timeout=900)
        if run.report is None or run.report.get("score") != run.report.get("max_score"):
            raise RuntimeError(f"the reference of {assignment} did not score full:\n{run.output[-2000:]}")
        seconds.append(run.seconds)
    return seconds


def row(what: str, seconds: list[float], torch_s: float) -> str:
    first, rest = seconds[0], seconds[1:] or seconds
    median = statistics.median(rest)
    return f"| {what} | {first:.2f} | {median:.2f} | {median / torch_s:.2f} |"


def table(repeats: int) -> tuple[list[str], float]:
    import torch  # noqa: F401 - the kernel stand-in has it, as every notebook's first cell does

    torch_runs = [import_torch_seconds() for _ in range(repeats)]
    torch_s = statistics.median(torch_runs)
    lines = ["| what | first (s) | repeated, median (s) | repeated / `import torch` |",
             "| --- | ---: | ---: | ---: |"]
    for assignment, notebook, function in CASES:
        seconds = time_checks(assignment, notebook, function, repeats)
        lines.append(row(f"`check(\"{function}\")` ({assignment})", seconds, torch_s))
        print(lines[-1], flush=True)
    seconds = time_grading(CASES[0][0], CASES[0][1], repeats)
    lines.append(row(f"whole grading of {CASES[0][0]} (`run_grader`, speed skipped)",
                     seconds, torch_s))
    lines.append(f"| `python -c \"import torch\"` | {torch_runs[0]:.2f} | {torch_s:.2f} | 1.00 |")
    return lines, torch_s


def write_doc(doc: Path, lines: list[str], repeats: int) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    block = [BEGIN,
             f"{datetime.date.today()}, {platform.node() or 'this machine'}: {os.cpu_count()} "
             f"cores, load average {load} before; torch "
             f"{__import__('torch').__version__}; `python -m autograder.bench check-latency "
             f"--repeats {repeats}`", "", *lines, END]
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + "\n".join(block) + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## check() latency\n\n" + "\n".join(block) + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.bench check-latency",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--repeats", type=int, default=3, help="calls per row (default 3)")
    p.add_argument("--doc", type=Path, default=DOC, help="the Markdown file the table goes in")
    p.add_argument("--no-doc", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if not (REPO / "solutions").is_dir():
        print("check-latency: needs solutions/ (the reference's answers are what it checks)",
              file=sys.stderr)
        return 1
    lines, _ = table(max(args.repeats, 2))
    print("\n".join(lines))
    if not args.no_doc:
        write_doc(args.doc, lines, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
