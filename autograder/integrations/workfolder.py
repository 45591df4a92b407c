"""The student's work folder (``make lab``), and the guard that keeps ``make release`` off work.

``make lab`` (``python -m course.lab``) starts JupyterLab in a *work folder* (``work/``, ignored
by git, or ``COURSE_WORK_DIR``), made on its first run from what the student edition holds for
students: ``lessons/`` (copies of ``course/lessons/``) and ``assignments/<assignment>/`` (the
released notebooks), chosen by the edition's rules (:func:`edition.tracked_files`,
:func:`edition.wanted`) and searched as it is (:func:`edition.leaks`): no ``solutions/``, no
answer key, no ``*.egg-info``, no ``course/`` or ``autograder/`` to shadow the installed packages.

Then the folder is the student's, and nothing overwrites a file they changed: a file missing
there (a new assignment, a lesson deleted to start over) is copied in; a copy still exactly as
released takes a newer release; beside a copy the student changed, a newer release lands as
``<name>.release-<date>.ipynb``, and one line says so. ``.release.json`` there records what was
copied (SHA-256 per file): that is how a new release and a student's change are told apart.

``make release`` regenerates ``assignments/`` with nbgrader's ``--force``, which deletes each
assignment folder first: :func:`release_guard` stops it while a file there holds changes that
no ``make release`` wrote (someone's work), :func:`record_release` notes what one wrote.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..registry import REPO
from . import edition

#: Folders of the repository copied into the work folder, and where they go there.
SOURCES = {"course/lessons/": "lessons/", "assignments/": "assignments/"}
MANIFEST = ".release.json"
RELEASE_MANIFEST = Path("build") / "release.json"


class WorkFolderError(Exception):
    """The work folder cannot be made or updated; the message says why."""


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _read_record(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # a damaged record: every file is then treated as possibly changed
        return {}


def work_files(repo: Path = REPO) -> dict[str, str]:
    """``{path in the work folder: path in the repository}`` of what the work folder holds."""
    try:
        files = edition.tracked_files(repo)
    except edition.EditionError:  # not a git checkout (an unpacked edition): the files there
        files = sorted(p.relative_to(repo).as_posix() for prefix in SOURCES
                       for p in (repo / prefix).rglob("*") if p.is_file())
    out = {}
    for rel in files:
        for prefix, there in SOURCES.items():
            if rel.startswith(prefix) and edition.wanted(rel):
                out[there + rel[len(prefix):]] = rel
    return out


def _beside(target: Path, today: str) -> Path:
    """A free name beside ``target`` for the release of ``today``: ``x.release-<today>.ipynb``."""
    n = 1
    while True:
        name = f"{target.stem}.release-{today}{'' if n == 1 else f'-{n}'}{target.suffix}"
        if not (target.parent / name).exists():
            return target.parent / name
        n += 1


def _copy_checked(pairs: list[tuple[Path, Path]], work: Path, repo: Path) -> None:
    """Copy each ``(source, target)`` through a staging folder searched as the edition is: a
    file holding a reference solution or an answer key is never copied."""
    if not pairs:
        return
    work.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".release-", dir=work))
    try:
        staged = [(staging / f"{i}-{target.name}", target) for i, (_, target) in enumerate(pairs)]
        for (source, _), (path, _) in zip(pairs, staged):
            shutil.copy2(source, path)
        found = edition.leaks(staging, edition.solution_regions(repo) + edition.key_regions(repo))
        if found:
            names = sorted({str(pairs[int(f.split("-")[0])][0]) for f, _ in found})
            raise WorkFolderError(f"reference solution or answer key text in {', '.join(names)}; "
                                  "nothing copied")
        for path, target in staged:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def sync(work: str | Path, repo: Path = REPO, today: str | None = None) -> list[str]:
    """Make or bring up to date the work folder ``work``; return one line per thing to say."""
    work, repo = Path(work), Path(repo)
    if work.resolve() == repo.resolve() or work.resolve() in repo.resolve().parents:
        raise WorkFolderError(f"{work} would hold the repository; choose another folder")
    files = work_files(repo)
    if not files:
        raise WorkFolderError(f"no lessons or assignments found in {repo}")
    created = not work.exists() or not any(work.iterdir())
    manifest = {} if created else _read_record(work / MANIFEST)
    copies, messages, recorded = [], [], dict(manifest)
    for there, rel in files.items():
        source, target = repo / rel, work / there
        new, was = digest(source), manifest.get(there)
        mine = digest(target) if target.is_file() else None
        if not target.exists():
            copies.append((source, target))
            messages.append(f"{target}: added (" + ("restored: the released version" if was
                                                    else "new in the release") + ")")
        elif was == new or mine == new:
            pass  # the release has not changed since it was copied, or the copy is already it
        elif mine == was:
            copies.append((source, target))
            messages.append(f"{target}: updated to the new release (you had not changed it)")
        else:  # changed by the student (or a folder without a record: possibly changed)
            beside = _beside(target, today or datetime.date.today().isoformat())
            copies.append((source, beside))
            messages.append(f"{target}: the new release is beside your copy, as {beside.name} "
                            "(your copy is unchanged)")
        recorded[there] = new
    _copy_checked(copies, work, repo)
    if recorded != manifest:
        (work / MANIFEST).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    if created:
        lessons = sum(there.startswith("lessons/") for there in files)
        return [f"work folder {work}: made, with {lessons} lessons and {len(files) - lessons} "
                "assignment files; it is yours: make lab never overwrites what you change"]
    return messages


# ---------------------------------------------------------------- make release

def _changed_in_assignments(repo: Path) -> list[str]:
    """Files under ``assignments/`` that differ from git's HEAD or that git does not track."""
    paths = []
    for args in (["diff", "--name-only", "HEAD"], ["ls-files", "--others", "--exclude-standard"]):
        try:
            out = subprocess.run(["git", "-C", str(repo), *args, "-z", "--", "assignments"],
                                 capture_output=True, check=True).stdout.decode()
        except (OSError, subprocess.CalledProcessError) as exc:
            raise WorkFolderError(f"{repo} is not a git checkout ({exc})") from None
        paths += [p for p in out.split("\0") if p and (repo / p).is_file()]
    return paths


def release_guard(repo: Path = REPO) -> list[str]:
    """Files under ``assignments/`` that ``make release`` would destroy: changed since git's
    HEAD (or untracked) and not exactly what the last ``make release`` wrote."""
    written = _read_record(repo / RELEASE_MANIFEST)
    return [rel for rel in _changed_in_assignments(repo) if written.get(rel) != digest(repo / rel)]


def record_release(repo: Path = REPO) -> None:
    """Note what ``make release`` just wrote under ``assignments/``."""
    written = {p.relative_to(repo).as_posix(): digest(p)
               for p in sorted((repo / "assignments").rglob("*")) if p.is_file()}
    (repo / "build").mkdir(exist_ok=True)
    (repo / RELEASE_MANIFEST).write_text(json.dumps(written, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder.integrations.workfolder",
                                description="The student's work folder; make release's guard.")
    p.add_argument("command", choices=["sync", "release-guard", "release-record"])
    p.add_argument("work", nargs="?", default="work", help="sync: the work folder (work)")
    args = p.parse_args(argv)
    try:
        if args.command == "sync":
            print("\n".join(sync(args.work)) or f"work folder {args.work}: up to date")
        elif args.command == "release-record":
            record_release()
        elif at_risk := release_guard():
            print("make release: stopped: it would replace these files of assignments/, which "
                  "hold changes that no release wrote:\n" + "".join(f"  {r}\n" for r in at_risk)
                  + "Move them away (students work in their work folder: make lab) or discard "
                  "them (git checkout -- <file>), then run it again; make release FORCE=1 "
                  "replaces them.", file=sys.stderr)
            return 1
    except WorkFolderError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
