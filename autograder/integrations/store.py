"""The per-student result folders of folder grading: written whole or not at all, and
recognised on a rerun (``grade-folder`` skips a notebook whose folder holds a finished
result of the same notebook content, assignment and seed, unless ``--force``).

A folder is built under ``OUT/.work/`` and then renamed into place, with ``grading.json`` (the
row of ``grades.csv`` and the fingerprint) in it: an interrupted run leaves either the old
folder, or none, never a half-written one (a leftover ``.work/`` is cleared by the next run).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict, fields
from pathlib import Path

MARKER = "grading.json"


def fingerprint(notebook: Path, assignment: str | None, seed: int | None) -> str:
    """What a result depends on besides the grader: the notebook's bytes, ``--assignment``
    and ``--seed``; a rerun that changes any of them regrades."""
    h = hashlib.sha256(Path(notebook).read_bytes())
    h.update(json.dumps([assignment, seed]).encode())
    return h.hexdigest()


def write_result(out: Path, g, fp: str) -> None:
    """Put ``g``'s folder (``out/g.key``) in place in one rename."""
    work = out / ".work"
    new = work / f"new-{uuid.uuid4().hex}"
    new.mkdir(parents=True)
    (new / "results.json").write_text(json.dumps(g.results, indent=2))
    (new / "report.json").write_text(json.dumps(
        g.report or {"status": g.status, "message": g.message}, indent=2))
    (new / "output.txt").write_text(g.output)
    row = {k: v for k, v in asdict(g).items() if k not in ("results", "report", "output")}
    (new / MARKER).write_text(json.dumps({"fingerprint": fp, "row": row}, indent=2))
    final = out / g.key
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = work / f"old-{uuid.uuid4().hex}"
        os.replace(final, old)
    os.replace(new, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_result(out: Path, key: str, fp: str | None, cls):
    """The finished result in ``out/key`` as a ``cls`` (batch.Graded), or None when there is
    none, it is incomplete, or (``fp`` given) it was graded from another notebook content."""
    folder = out / key
    try:
        marker = json.loads((folder / MARKER).read_text())
        if fp is not None and marker.get("fingerprint") != fp:
            return None
        row = marker["row"]
        results = json.loads((folder / "results.json").read_text())
        report = json.loads((folder / "report.json").read_text())
        output = (folder / "output.txt").read_text()
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names}, results=results,
                   report=report if "results" in report else {}, output=output)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_work(out: Path) -> None:
    """Remove what an interrupted run left half-built."""
    shutil.rmtree(out / ".work", ignore_errors=True)
