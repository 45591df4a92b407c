"""The report for people: the table the CLI prints after grading."""
from __future__ import annotations

from .keys import is_reserved, reserved_points
from .results import SKIPPED, TAG, Report, student_message


def table(report: Report) -> str:
    rows = [("check", "points", "status", "seconds", "message")]
    for r in report.results:
        message = " ".join(student_message(r.message, r.function).split())
        if len(message) > 160:
            message = message[:157] + "..."
        rows.append((f"{r.function}: {r.name}", f"{r.points:g}/{r.max_points:g}",
                     TAG.get(r.status, r.status), f"{r.seconds:.1f}", message))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    lines.insert(1, "-" * min(120, len(lines[0])))
    skipped = [r for r in report.results if r.status == SKIPPED and not is_reserved(r)]
    reserved = reserved_points(report.results)
    out = [f"Assignment {report.assignment}", *lines, "",
           f"Total: {report.score:g} / {report.max_score:g}"
           + (f"  ({sum(r.max_points for r in skipped):g} more point(s) not graded on this "
              "machine: see SKIP lines)" if skipped else "")]
    if reserved:
        out.append(f"{report.max_score:g} point(s) checked here; {reserved:g} more when your "
                   "instructor grades (hidden cases and the answer key)")
    out.append(f"Hardware: {report.hardware}")
    out.append(f"Isolation: {report.isolation}")
    out.append(f"Seed: {report.seed} (python -m autograder grade ... --seed {report.seed} "
               "repeats these inputs)")
    out += [f"Note: {n}" for n in report.notes]
    return "\n".join(out)
