"""``python -m autograder merge OUT1 OUT2 ... --out OUT``: join the results of shards
(``grade-folder --shard K/N``, one per machine) into one ``grades.csv``, per-student folders
and the class summaries (:mod:`.gradebook`), as if one run had graded them all.

Refused: a student result in two shard folders (shards are disjoint; the same result twice
means a folder was passed twice or shards were cut differently). Reported (exit code 3):
students of the class (each shard's ``shard.json`` lists all of them) that no folder holds,
and shards that are absent.

Each row is counted again from its report by the class rule (:func:`.batch.settled`, the one
``grade-folder`` uses), so shards graded apart, or by an older grader, join on one rule and
one maximum per assignment. A merge grades nothing: checks still unjudged stay in
``needs_timing`` (rerun a shard's ``grade-folder`` on hardware that can time them).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import gradebook, store
from .batch import GRADED, Graded, settled, summary, write_grades


class MergeError(Exception):
    pass


def merge(folders: list[str | Path], out_dir: str | Path) -> tuple[list[Graded], list[str]]:
    """The merged rows (written to ``out_dir``) and the keys of missing students."""
    out = Path(out_dir).resolve()
    found: dict[str, tuple[Graded, Path]] = {}
    expected: dict[str, int] = {}
    shards: set[int] = set()
    total = None
    for folder in map(Path, folders):
        try:
            manifest = json.loads((folder / "shard.json").read_text())
        except (OSError, ValueError) as exc:
            raise MergeError(f"{folder}: not a grade-folder output (no shard.json: {exc})")
        k, n = manifest["shard"]
        if total not in (None, n):
            raise MergeError(f"{folder}: shard {k}/{n}, but another folder is of {total} shards")
        if k in shards:
            raise MergeError(f"{folder}: shard {k}/{n} is given twice")
        total = n
        shards.add(k)
        expected.update(manifest["class"])
        for key, shard in manifest["class"].items():
            if shard != k:
                continue
            g = store.read_result(folder, key, None, Graded)
            if g is None:
                continue
            if key in found:
                raise MergeError(f"{key}: graded in both {found[key][1]} and {folder}")
            found[key] = (settled(g), folder)
    if out.exists() and any(out.iterdir()):
        raise MergeError(f"{out}: not empty (merge writes a fresh folder)")
    missing = sorted(set(expected) - set(found))
    rows = [found[key][0] for key in expected if key in found]   # the class's order
    out.mkdir(parents=True, exist_ok=True)
    for g in rows:
        store.write_result(out, g, json.loads(
            (found[g.key][1] / g.key / store.MARKER).read_text())["fingerprint"])
    write_grades(out, rows)
    (out / "shard.json").write_text(json.dumps({"shard": [1, 1], "class": {
        key: 1 for key in expected}, "merged_from": [str(f) for f in folders],
        "missing": missing, "missing_shards": sorted(set(range(1, (total or 1) + 1)) - shards)},
        indent=1))
    store.clear_work(out)
    gradebook.write_summary(out, rows)
    return rows, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder merge",
                                description="Join the OUT folders of grade-folder --shard runs.")
    p.add_argument("folders", nargs="+", help="the shards' OUT folders")
    p.add_argument("--out", required=True, help="a new (or empty) folder for the merged results")
    p.add_argument("--nbgrader-db", metavar="PATH", help="also write the scores into this "
                   "nbgrader gradebook (sqlite file; created if absent)")
    args = p.parse_args(argv)
    try:
        rows, missing = merge(args.folders, args.out)
    except MergeError as exc:
        print(f"Cannot merge: {exc}", file=sys.stderr)
        return 2
    if args.nbgrader_db:
        gradebook.export_nbgrader(args.nbgrader_db, rows)
    print(summary(rows))
    print(f"Wrote {Path(args.out) / 'grades.csv'} ({len(rows)} notebook(s))")
    manifest = json.loads((Path(args.out) / "shard.json").read_text())
    if manifest["missing_shards"]:
        print(f"Shards not given: {', '.join(map(str, manifest['missing_shards']))}")
    if missing:
        print(f"Missing ({len(missing)}): {', '.join(missing)}")
    bad = [g for g in rows if g.status != GRADED]
    if bad:
        print(f"{len(bad)} notebook(s) could not be graded (status column)")
    return 3 if missing or bad else 0


if __name__ == "__main__":
    sys.exit(main())
