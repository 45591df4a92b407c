"""Assignment 4's multi-process runs, case by case: a case whose student code raises costs the
checks that grade that case, not the other cases of the same run.

Why: the checks of a class share one run per world size (process starts cost seconds), and
before this one exception (in the model with an unused parameter, say) failed every check of
the class, including the rules the code follows. Now each rank runs the cases in turn
(:func:`rank_cases`), catches what a case raises, and saves each case's result to a folder as
soon as the ranks agree it is done. After a case that raised, the same ranks go on only where
that is safe: every rank raised in it and each had issued as many collectives on the default
process group (so none waits for a partner that never comes: the released stubs, which raise
at once, cost one start of the ranks, as correct code does). Otherwise (a rank raised alone, or
after more collectives than another) they stop, and the probe starts fresh ranks for the cases
after it (:func:`run_cases`).

Results are handed over before teardown, so a rank that aborts afterwards, at process exit
(gloo can std::terminate a finished rank: "terminate called without an active exception"),
never costs the student a point. A run that dies or hangs in a case (stopped by its time
limits) fails that case, and fresh ranks take the cases after it; the call's own timeout may
end the class's checks first (the text says so).

Trusted harness code: it runs beside student code (in the sandbox and in every rank) and
imports nothing heavier than torch.
"""
from __future__ import annotations

import datetime
import io
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autograder.checking.ranks import COLLECTIVE_TIMEOUT, run_ranks, short_traceback
from course.collectives import watch_group

#: Seconds the ranks wait for each other to agree that a case is done: longer than a
#: collective's timeout, which a rank whose neighbour raised waits out first.
AGREE_TIMEOUT = 3 * COLLECTIVE_TIMEOUT


def _save(folder: str, index: int, rank: int, result: dict) -> None:
    buffer = io.BytesIO()
    torch.save(result, buffer)
    # written whole, then renamed: a half-written file is never taken for a result
    tmp = Path(folder, f"case-{index}-{rank}.tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.rename(Path(folder, f"case-{index}-{rank}.pt"))


def rank_cases(rank, world_size, folder, case_fn, first, cases, *args):
    """On each rank: ``case_fn(rank, world_size, i, cases[i], *args)`` for ``i`` from ``first``,
    each result saved as ``{"reply": ...}`` or ``{"error": message, "at": time}``. The ranks
    agree after each case, on a process group of the harness's own that the student's code
    never sees, and stop after a failure unless every rank failed after as many collectives on
    the default group."""
    agree = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=AGREE_TIMEOUT))
             if world_size > 1 else None)
    issued = [0]

    def count(op, inputs, outputs, peer):
        issued[0] += 1

    # every call on the default group counted, on every torch (course.collectives)
    with watch_group(None, count):
        for i in range(first, len(cases)):
            try:
                result = {"reply": case_fn(rank, world_size, i, cases[i], *args)}
            except Exception as exc:  # noqa: BLE001 - a student's exception is this case's result
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                result = {"error": short_traceback(text, f"with {world_size} processes, rank "
                                                         f"{rank} raised"), "at": time.time()}
            mine = torch.tensor([int("error" in result), issued[0]], dtype=torch.int64)
            every = [torch.zeros_like(mine) for _ in range(world_size)]
            if agree is not None:
                dist.all_gather(every, mine, group=agree)
            else:
                every = [mine]
            _save(folder, i, rank, result)
            failed = [int(t[0]) for t in every]
            in_step = len({int(t[1]) for t in every}) == 1
            if any(failed) and not (all(failed) and in_step):
                return


def run_cases(case_fn, world_size: int, cases, *args) -> list[dict]:
    """Each case's outcome on ``world_size`` ranks (gloo): ``{"ranks": [each rank's reply]}``,
    or ``{"error": why}`` (the first rank to raise, or why the run stopped in it); fresh ranks
    take over where the ranks stopped."""
    out: list[dict | None] = [None] * len(cases)
    first = 0
    while first < len(cases):
        with tempfile.TemporaryDirectory(prefix="a4-cases-") as folder:
            stopped = None
            try:
                run_ranks(rank_cases, world_size, folder, case_fn, first, cases, *args,
                          backend="gloo")
            except RuntimeError as exc:
                stopped = str(exc)
            i = first
            while i < len(cases):
                saved = [Path(folder, f"case-{i}-{r}.pt") for r in range(world_size)]
                if not all(p.exists() for p in saved):
                    if i == first or "error" not in out[i - 1]:  # the run ended in case i
                        out[i] = {"error": stopped or "the ranks stopped before this case ended"}
                        i += 1
                    break  # else: they stopped after a failure, fresh ranks go on from case i
                results = [torch.load(p, weights_only=True) for p in saved]
                errors = sorted((r for r in results if "error" in r), key=lambda r: r["at"])
                out[i] = ({"error": errors[0]["error"]} if errors
                          else {"ranks": [r["reply"] for r in results]})
                i += 1
            first = i
    return out
