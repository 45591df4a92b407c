"""Run a lesson notebook with nbclient and record which of its cells used CUDA.

How a cell's CUDA use is measured (nothing is guessed from the cell's text):

- in the kernel: a probe cell inserted after every code cell prints the CUDA caching
  allocator's cumulative count of allocations (``allocation.all.allocated`` of
  ``torch.cuda.memory_stats``, summed over the GPUs) and whether CUDA is initialised; a cell
  used CUDA in the kernel when the count grew (or CUDA became initialised) during it. The
  probe reads counters only: it allocates nothing and initialises nothing;
- in the ranks that ``course.launch.launch`` starts: a set-up cell, run first, wraps
  ``launch`` so that every rank, after its function returns or raises, appends the same
  counter of its own process to a log file, which the next probe reads and empties. The
  wrapper changes nothing else (same arguments, same return values, same errors).

Probe cells and their outputs are not part of what is reported: the cells are numbered as in
the lesson file (0-based, markdown cells included, as nbformat counts them).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

MARK = "__GPU_CHECK__ "

SETUP = r'''
def _gpu_check_setup(log):
    import functools, json, os
    import torch
    import course.launch as _course_launch

    def allocations():
        """Cumulative CUDA allocations of this process (0 if it never initialised CUDA)."""
        if not torch.cuda.is_initialized():
            return 0
        return sum(torch.cuda.memory_stats(i).get("allocation.all.allocated", 0)
                   for i in range(torch.cuda.device_count()))

    original = _course_launch.launch

    @functools.wraps(original)
    def launch(fn, world_size, *args, **kwargs):
        def counted(rank, world, *a):
            try:
                return fn(rank, world, *a)
            finally:
                with open(log, "a") as f:
                    f.write(json.dumps({"rank": rank, "pid": os.getpid(),
                                        "cuda_initialized": torch.cuda.is_initialized(),
                                        "cuda_allocations": allocations()}) + "\n")
        return original(counted, world_size, *args, **kwargs)

    _course_launch.launch = launch

    def probe(cell):
        ranks = []
        if os.path.exists(log):
            with open(log) as f:
                ranks = [json.loads(line) for line in f if line.strip()]
            os.remove(log)
        print("__GPU_CHECK__ " + json.dumps({"cell": cell, "cuda_initialized": torch.cuda.is_initialized(),
                                             "cuda_allocations": allocations(), "ranks": ranks}))
    return probe

_gpu_check_probe = _gpu_check_setup(LOG)
_gpu_check_probe(-1)
del _gpu_check_setup
'''

#: Lines of a cell's printout that carry a timing, a speedup or a throughput.
TIMING = re.compile(r"\d[\d,]*(\.\d+)?\s*(ms|µs|us|s|x|GB/s|MB/s|examples/s|images/s|samples/s)(\b|$|\))")


def instrumented(nb, log: str):
    """A copy of ``nb`` with the set-up cell first and a probe after every code cell; returns
    (notebook, {position in the copy: cell index in the lesson})."""
    import nbformat

    cells = [nbformat.v4.new_code_cell(SETUP.replace("LOG", repr(log)))]
    where = {}
    for index, cell in enumerate(nb.cells):
        where[len(cells)] = index
        cells.append(cell)
        if cell.cell_type == "code":
            cells.append(nbformat.v4.new_code_cell(f"_gpu_check_probe({index})"))
    copy = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    return copy, where


def _probe_records(copy) -> list[dict]:
    records = []
    for cell in copy.cells:
        for out in cell.get("outputs", []):
            for line in out.get("text", "").splitlines():
                if line.startswith(MARK):
                    records.append(json.loads(line[len(MARK):]))
    return records


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def run_lesson(path: Path, *, timeout: float = 600, kernel: str = "python3") -> dict:
    """Execute ``path`` (environment as this process has it) and return what happened:
    ``error`` (None, or the failing cell and its exception), ``cuda_cells`` (cell indices
    whose code used CUDA in the kernel or in launched ranks), ``cells`` (per code cell: the
    counters' growth and the ranks' records), ``timings`` (printed lines with a timing) and
    ``seconds``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="gpu-check-lesson-") as tmp:
        copy, where = instrumented(nb, os.path.join(tmp, "ranks.jsonl"))
        client = NotebookClient(copy, timeout=timeout, kernel_name=kernel, allow_errors=False,
                                resources={"metadata": {"path": str(path.parent)}})
        start, error = time.monotonic(), None
        try:
            client.execute()
        except (CellExecutionError, CellTimeoutError) as exc:
            error = str(exc).strip().splitlines()[-1][:400] if str(exc).strip() else type(exc).__name__
        except Exception as exc:  # the kernel did not start or died
            error = f"{type(exc).__name__}: {exc}"[:400]
        seconds = time.monotonic() - start
    failed_cell = None
    for position, cell in enumerate(copy.cells):
        if position in where and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            failed_cell = where[position]
            err = next(o for o in cell.outputs if o.get("output_type") == "error")
            error = f"cell {failed_cell}: {err.get('ename')}: {err.get('evalue')}"[:400]
            break
    records = _probe_records(copy)
    cells, cuda_cells = [], []
    previous = records[0] if records and records[0]["cell"] == -1 else \
        {"cuda_initialized": False, "cuda_allocations": 0}
    for rec in (r for r in records if r["cell"] >= 0):
        grew = rec["cuda_allocations"] - previous["cuda_allocations"]
        became = rec["cuda_initialized"] and not previous["cuda_initialized"]
        rank_allocs = sum(r["cuda_allocations"] for r in rec["ranks"])
        used = grew > 0 or became or rank_allocs > 0
        cells.append({"cell": rec["cell"], "kernel_cuda_allocations": grew,
                      "ranks": len(rec["ranks"]), "rank_cuda_allocations": rank_allocs,
                      "used_cuda": used})
        if used:
            cuda_cells.append(rec["cell"])
        previous = rec
    timings = []
    for position, cell in enumerate(copy.cells):
        if position in where and cell.cell_type == "code":
            timings += [f"[cell {where[position]}] {line.strip()}" for line in _text(cell).splitlines()
                        if TIMING.search(line) and not line.startswith(MARK)]
    code_cells = sum(c.cell_type == "code" for c in nb.cells)
    return {"error": error, "failed_cell": failed_cell, "cuda_cells": cuda_cells,
            "cells": cells, "code_cells": code_cells, "cells_run": len(cells),
            "timings": timings, "seconds": seconds}
