"""One package per assignment: ``spec.py`` (the contract: functions, checks, points),
``probes.py`` (runs in the student's sandbox), ``ranks.py`` (runs in the ranks a probe starts),
``checks.py`` (the graded pytest checks, in the grader). See docs/adding-an-assignment.md."""
