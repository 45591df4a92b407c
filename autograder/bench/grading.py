"""``python -m autograder.bench grading [--repeats 3] [--assignment A ...] [--speed skip|measure]
[--doc PATH | --no-doc]`` (``make bench-grading``): how long grading takes here, and what it
starts.

For every assignment (or those named), in each of ``--repeats`` rounds, it grades the reference
(``solutions/<a>/<notebook>``) and the released stub (``assignments/<a>/<notebook>``) the way a
student's ``check()``, folder grading and nbgrader do: ``python -m autograder grade NOTEBOOK
--assignment A --speed S --report ...`` in a fresh process (:func:`autograder.invoke.run_grader`,
cold: a new interpreter each time, whose descendants are every process the grading starts;
``check-latency`` measures the warm path).
Per assignment and notebook it reports

- **seconds**: the grading process's wall time, from its start (interpreter and torch imports
  included) to its report; the median of the rounds;
- **processes**: how many processes the grading started (sandboxes, their fork servers, ranks,
  the reference's sandbox): counted from outside by polling the grading process's descendants
  every 10 ms (:mod:`.processes` says how, and why it is a lower bound); the median of the rounds;
- **score** (the reference should score full, the stub zero; the command exits 1 otherwise or
  when a grading fails);
- **slowest checks**: the three with the largest median of the report's per-check ``seconds``
  (``results[].seconds``: pytest's duration of the check, as the harness records it in
  :class:`autograder.results.CheckResult`; the sandbox's start and a multi-process run shared
  by several checks count in the first check that needs them).

Timings are this command's, never a test's. Other programs on the machine take cores away from
the grading and make it slower; the table says what the load average was. The Markdown table
goes between :data:`BEGIN` and :data:`END` in ``docs/benchmarks.md`` (a rerun replaces it), with
the machine, the load average and the command.
"""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

from ..registry import ASSIGNMENTS, REPO

BEGIN = "<!-- grading benchmark: begin (python -m autograder.bench grading writes what follows) -->"
END = "<!-- grading benchmark: end -->"
DOC = REPO / "docs" / "benchmarks.md"
KINDS = {"reference": "source", "stub": "release"}  # kind -> the registry's notebook attribute


def grade_once(notebook: Path, assignment: str, speed: str, timeout: float) -> dict:
    """One grading in a fresh process: its seconds, processes started, report and exit."""
    from ..invoke import run_grader
    from .processes import ProcessCounter

    counter = ProcessCounter()
    run = run_grader(["grade", str(notebook), "--assignment", assignment, "--speed", speed],
                     timeout=timeout, on_start=counter.start, warm=False)
    processes = counter.stop()
    return {"seconds": run.seconds, "processes": processes, "poll_cpu_s": counter.cpu_seconds,
            "report": run.report, "returncode": run.returncode, "timed_out": run.timed_out,
            "output": run.output[-1500:]}


def summarise(runs: list[dict], kind: str) -> dict:
    """The rounds of one notebook: medians, score, slowest checks, and what went wrong."""
    reports = [r["report"] or {} for r in runs]
    per_check: dict[str, list[float]] = {}
    for report in reports:
        for result in report.get("results") or []:
            per_check.setdefault(result["name"], []).append(result["seconds"])
    slowest = sorted(((statistics.median(s), name) for name, s in per_check.items()), reverse=True)[:3]
    scores = {(rep.get("score"), rep.get("max_score")) for rep in reports}
    problems = []
    for r, report in zip(runs, reports):
        if r["timed_out"] or r["returncode"] != 0 or not report.get("results"):
            tail = " / ".join(r["output"][-300:].split("\n"))
            problems.append(f"exit {r['returncode']}{', timed out' if r['timed_out'] else ''}: {tail}")
            continue
        lost = [x["name"] for x in report["results"] if x["status"] == "failed"]
        if kind == "reference" and lost:
            problems.append(f"the reference lost points: {', '.join(lost)}")
        if kind == "stub" and report["score"]:
            problems.append(f"the stub scored {report['score']:g}")
    score, max_score = min(scores, key=str)
    varied = "" if len(scores) == 1 else " (varied)"
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "processes": round(statistics.median(r["processes"] for r in runs)),
            "score": "?" if score is None else f"{score:g}/{max_score:g}{varied}",
            "slowest": [(name, seconds) for seconds, name in slowest], "problems": problems,
            "poll_cpu_s": sum(r["poll_cpu_s"] for r in runs)}


def _cells(s: dict | None) -> dict[str, str]:
    """One notebook's summary as table cells ("-" where it was not graded)."""
    if s is None:
        return dict.fromkeys(("seconds", "processes", "score", "slowest"), "-")
    return {"seconds": f"{s['seconds']:.1f}", "processes": str(s["processes"]), "score": s["score"],
            "slowest": "; ".join(f"{name} {sec:.1f}" for name, sec in s["slowest"]) or "-"}


def table(rows: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per assignment, reference and stub side by side."""
    lines = ["| assignment | reference s | stub s | processes: reference / stub | reference "
             "score | stub score | slowest checks, reference (s) | slowest checks, stub (s) |",
             "| --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for name, by_kind in rows.items():
        ref, stub = _cells(by_kind.get("reference")), _cells(by_kind.get("stub"))
        lines.append(f"| {name} | {ref['seconds']} | {stub['seconds']} | {ref['processes']} / "
                     f"{stub['processes']} | {ref['score']} | {stub['score']} | "
                     f"{ref['slowest']} | {stub['slowest']} |")
    return "\n".join(lines)


def machine() -> str:
    from course.devices import hardware_summary

    from .common import cores

    return (f"{hardware_summary()}; {cores()} core(s) for this program, {os.cpu_count()} on "
            f"the machine; Python {platform.python_version()}, {platform.system()} "
            f"{platform.release()}")


def block(rows: dict, loads: list[float], command: str, repeats: int, speed: str,
          poll_cpu: float) -> str:
    """What goes between the markers: when, how, where, under what load, then the table."""
    today = datetime.date.today().isoformat()
    return "\n".join([
        f"Measured {today} with `{command}` ({repeats} round(s); speed checks "
        f"{'skipped' if speed == 'skip' else 'measured'}).", "",
        f"Machine: {machine()}.", "",
        f"Load average (1 min): {loads[0]:.1f} at the start, {loads[-1]:.1f} at the end, "
        f"{min(loads):.1f} to {max(loads):.1f} after each grading. Other programs running on "
        "the machine take cores away from the grading: with a load above the number of cores, "
        "these seconds include waiting for a core.", "",
        table(rows), "",
        f"Seconds: median wall time of the grading process. Processes: started by the grading "
        f"(a lower bound, polled every 10 ms; the polling took {poll_cpu:.1f} s of CPU over the "
        "whole run). Slowest checks: median of the report's per-check seconds."])


def write_doc(path: Path, text: str) -> None:
    """Put ``text`` between the markers of ``path`` (appended, with them, if they are absent)."""
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in doc and END in doc.split(BEGIN, 1)[1]:
        head, rest = doc.split(BEGIN, 1)
        doc = f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}"
    else:
        doc = f"{doc.rstrip()}\n\n## Grading\n\n{BEGIN}\n{text}\n{END}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)


def assignment(name: str) -> str:
    """An assignment's name, or a prefix of one name only (``a1`` for ``a1_data_parallel``)."""
    matches = ([a for a in ASSIGNMENTS if a == name]
               or [a for a in ASSIGNMENTS if a.startswith(name + "_")]    # a1 is not a10
               or [a for a in ASSIGNMENTS if a.startswith(name)])
    if len(matches) != 1:
        raise ValueError(name)
    return matches[0]


def main(argv: list[str] | None = None) -> int:
    from .common import load, parser

    p = parser("grading", "Grade every assignment's reference and released stub in fresh "
                          "processes: seconds, processes started, slowest checks.",
               repeats=3, out=None)
    p.add_argument("--assignment", nargs="+", type=assignment, metavar="A",
                   default=list(ASSIGNMENTS),
                   help=f"only these, by name or its start (a1; default: all of {', '.join(ASSIGNMENTS)})")
    p.add_argument("--speed", choices=("measure", "skip"),
                   default=os.environ.get("AUTOGRADER_SPEED", "measure"),
                   help="passed to the grader (default: $AUTOGRADER_SPEED or measure)")
    p.add_argument("--doc", type=Path, default=DOC, help="Markdown file to write the table into "
                                                         "(between its markers; docs/benchmarks.md)")
    p.add_argument("--no-doc", action="store_true", help="print the table only")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per grading (1800)")
    args = p.parse_args(argv)
    args.assignment = list(dict.fromkeys(args.assignment))
    raw = ["--repeats", str(args.repeats), "--speed", args.speed]
    raw += [] if args.assignment == list(ASSIGNMENTS) else ["--assignment", *args.assignment]
    raw += [] + ([] if args.doc == DOC else ["--doc", str(args.doc)])
    command = "python -m autograder.bench grading " + " ".join(map(shlex.quote, raw))

    loads = [load()]
    print(f"Grading {', '.join(args.assignment)}: reference and stub, {args.repeats} round(s), "
          f"speed {args.speed}; load average now {loads[0]:.1f}", flush=True)
    runs: dict[str, dict[str, list]] = {a: {} for a in args.assignment}
    for round_ in range(args.repeats):
        for name in args.assignment:
            for kind, attribute in KINDS.items():
                notebook = getattr(ASSIGNMENTS[name], attribute)
                if not notebook.exists():
                    continue  # the student edition has no reference
                run = grade_once(notebook, name, args.speed, args.timeout)
                runs[name].setdefault(kind, []).append(run)
                loads.append(load())
                print(f"  round {round_ + 1}: {name} {kind}: {run['seconds']:.1f} s, "
                      f"{run['processes']} processes, exit {run['returncode']}, load "
                      f"{loads[-1]:.1f}", flush=True)
    rows = {name: {kind: summarise(r, kind) for kind, r in by_kind.items()}
            for name, by_kind in runs.items()}
    poll_cpu = sum(s["poll_cpu_s"] for by_kind in rows.values() for s in by_kind.values())
    problems = [f"{name} {kind}: {why}" for name, by_kind in rows.items()
                for kind, s in by_kind.items() for why in s["problems"]]
    text = block(rows, loads, command, args.repeats, args.speed, poll_cpu)
    if problems:
        text += "\n\nProblems:\n\n" + "\n".join(f"- {line}" for line in problems)
    print(f"\n{text}")
    if not args.no_doc:
        write_doc(args.doc, text)
        print(f"\nwritten into {args.doc}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
