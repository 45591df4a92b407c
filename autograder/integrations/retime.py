"""The second pass of a class run: the checks the first pass could not judge ("not graded
here": a speed check whose reference did not reach its bar in that run, or that lacked cores or
GPUs), re-timed at the end, one notebook at a time, each run holding every core and GPU of the
machine (as a lone ``grade`` would): the machine is as quiet as a class run can make it.

Only those checks' results change: each notebook is graded again with ``--only`` the functions
of its unjudged checks and the first pass's seed, and the results of the checks that were
unjudged replace theirs (passed, failed, or still skipped, with the new reason); every other
check keeps its first-pass result. What stays unjudged is counted by the class rule
(:func:`autograder.integrations.gradebook.tally`) and named in ``needs_timing``.

A SKIP whose reason reads the same, word for word, when re-timed alone depends on what the
machine has (its cores, its GPUs), not on its load: a load SKIP quotes the speedups measured in
its own run. The same check of the next students with that same reason is then not re-timed on
this machine (it cannot change here; their notes say whose re-timing showed it), so a machine
without the GPUs that a check needs costs one extra run per check, not one per student.

``--speed skip`` runs re-time nothing: not timing was the instructor's choice.
"""
from __future__ import annotations

from ..keys import is_reserved
from ..results import SKIPPED, TAG
from . import jobs as jobs_
from .progress import Progress

GRADED = "graded"
BANNER = "--- re-timed alone at the end of the class run ---"


def pending(rows, speed: str) -> list[tuple[int, list[dict]]]:
    """``[(row index, its unjudged checks' results)]`` to re-time (none under ``--speed skip``).
    Checks not measured on purpose by an earlier ``--speed skip`` run whose results were kept
    are timed now, in a run that measures."""
    if speed != "measure":
        return []
    todo = []
    for i, g in enumerate(rows):
        # a hidden check skipped for want of the answer key is no timing: re-running it without
        # the key would only skip it again
        skipped = [r for r in (g.report.get("results") or []) if r.get("status") == SKIPPED
                   and not is_reserved(r)]
        if g.status == GRADED and skipped:
            todo.append((i, skipped))
    return todo


def _group(g, r: dict) -> tuple:
    return g.assignment, r.get("name"), r.get("message")


def _result(report: dict | None, name: str) -> dict | None:
    return next((r for r in (report or {}).get("results") or [] if r.get("name") == name), None)


def retime(rows, regrade, persist, *, speed: str, cores: list[int], gpus: list[str], scratch,
           running: jobs_.Running, stream=None) -> int:
    """Re-time the unjudged checks of ``rows`` (changed in place), one notebook at a time.

    ``regrade(g, functions, slot, on_start)`` grades ``g``'s notebook again for ``functions``
    only, with ``g``'s seed, in ``slot``, and returns its new row; ``persist(g)`` runs after
    each row changed. Returns how many notebooks were graded again."""
    todo = pending(rows, speed)
    if not todo:
        return 0
    print(f"Re-timing {sum(len(s) for _, s in todo)} check(s) of {len(todo)} notebook(s) that "
          "could not be judged (SKIP), one notebook at a time on all "
          f"{len(cores)} core(s) and {len(gpus)} GPU(s)", flush=True)
    shown: dict[tuple, str] = {}   # a reason that stayed word for word -> whose re-timing showed it
    allocator = jobs_.Allocator(cores, gpus, scratch)
    whole = jobs_.Needs(len(cores), len(gpus))
    progress = Progress(len(todo), stream, desc="re-timing")
    regraded = 0

    def work(item, slot):
        i, skipped = item
        g = rows[i]
        live = [r for r in skipped if _group(g, r) not in shown]
        if not live:
            return i, skipped, live, None
        pids = []

        def started(pid):
            pids.append(pid)
            running.started(pid)
        try:
            again = regrade(g, sorted({r["function"] for r in live}), slot, started)
        finally:
            for pid in pids:
                running.finished(pid)
        for r in live:   # decided here, before the next notebook's run starts (one job)
            new = _result(again.report, r["name"]) if again.status == GRADED else None
            if new and new.get("status") == SKIPPED and new.get("message") == r.get("message"):
                shown.setdefault(_group(g, r), g.key)
        return i, skipped, live, again

    def done(item, result):
        nonlocal regraded
        i, skipped, live, again = result
        regraded += again is not None
        line = apply(rows[i], skipped, live, again, shown)
        persist(rows[i])
        progress.update(line, failed=again is not None and again.status != GRADED)

    try:
        jobs_.run_jobs(todo, [whole] * len(todo), work, 1, allocator, running, done)
    finally:
        progress.close()
    return regraded


def apply(g, skipped: list[dict], live: list[dict], again, shown: dict) -> str:
    """Put the re-timed results of ``live`` into ``g``'s report (the others keep theirs), with
    a note per check; returns the progress line."""
    notes, outcome = [], []
    results = g.report["results"]
    for r in skipped:
        name = r["name"]
        if not any(r is x for x in live):
            notes.append(f"{name}: not re-timed: its reason stayed word for word when "
                         f"{shown.get(_group(g, r), 'another notebook')}'s was re-timed alone at "
                         "the end of this class run, so it depends on this machine's cores or "
                         "GPUs, not on its load")
            outcome.append(f"{name} not re-timed (same reason as {shown.get(_group(g, r))})")
            continue
        new = _result(again.report, name) if again.status == GRADED else None
        if new is None:
            why = again.message if again.status != GRADED else "the run did not report it"
            notes.append(f"{name}: re-timing alone at the end of the class run failed "
                         f"({again.status}: {why}); the first pass's SKIP stands")
            outcome.append(f"{name} re-timing failed")
            continue
        results[next(k for k, x in enumerate(results) if x.get("name") == name)] = new
        tag = TAG.get(new.get("status"), new.get("status"))
        notes.append(f"{name}: re-timed alone at the end of the class run: {tag}"
                     + (" again: " + new.get("message", "") if tag == "SKIP" else ""))
        outcome.append(f"{name} {tag}")
    g.report["score"] = sum(float(r.get("points", 0)) for r in results)
    g.report["max_score"] = sum(float(r.get("max_points", 0)) for r in results
                                if r.get("status") != SKIPPED)   # as the CLI's report counts it
    g.report.setdefault("notes", []).extend(notes)
    if again is not None:
        g.output = f"{g.output}\n\n{BANNER}\n{again.output}"
    return f"re-timing {g.key}: " + "; ".join(outcome)
