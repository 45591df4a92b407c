"""The student edition of this repository: ``python -m autograder edition OUT_DIR``.

It holds what students need and nothing that gives answers away:

- in: the lessons and the toolkit (``course/``), the released assignments (``assignments/``),
  the self-check grader (``autograder/`` with its checks), ``README.md`` (with a note on what
  this edition lacks), ``Makefile``, ``pyproject.toml``, ``docker/`` and ``docs/``;
- out: ``solutions/`` (the reference and the answer keys, ``solutions/<a>/answer_key.py``), ``nbgrader_config.py`` (it points at solutions/), ``tests/`` (they grade
  the reference solutions), ``docs/instructor.md``, ``autograder/bench/a4_sharding.py`` (its own
  bucketed all-reduce and ZeRO byte accounting are Assignment 4's answers),
  ``autograder/bench/a6_context_parallel.py`` and ``autograder/bench/cp_attention.py`` (the
  benchmark and its own ring attention and Ulysses, which are Assignment 6's answers),
  ``autograder/bench/a7_expert_parallel.py`` and ``autograder/bench/moe_dispatch.py`` (the
  benchmark and its own routing, capacity and expert-parallel dispatch: Assignment 7's answers),
  ``autograder/gpu_check/`` (``make gpu-check`` grades and executes the reference solutions),
  ``docker/compose.reference.yaml``, CI files and hidden files.

Files come from ``git ls-files`` (what is committed or staged, as it is in the working tree), so
untracked junk never ships (``--include-untracked`` adds new files git does not ignore, to try
an edition before committing). Before it finishes, the builder searches every file it wrote for
the text of every ``### BEGIN SOLUTION`` region of the reference notebooks and refuses to
leave an edition that contains one.

Without solutions/, checks that need the reference say so in their messages: a speedup passes
at a stated fixed threshold instead of 80% of the reference's (see
:func:`autograder.checking.speed.judge_rounds`),
and the instructor's grade may differ.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..keys import KEY_FILE
from ..registry import REPO

#: Top-level entries of the repository that go into the edition.
INCLUDE = {"course", "autograder", "assignments", "docker", "docs", "README.md", "Makefile",
           "pyproject.toml", ".gitignore", "LICENSE", "LICENSE.md", "LICENSE.txt"}
#: Inside those, never (glob patterns on the path relative to the repository).
NEVER = ["docs/instructor*", "docker/compose.reference.yaml",
         "autograder/bench/a4_sharding.py",  # holds A4-like code: bucketing, ZeRO accounting
         "autograder/bench/a6_context_parallel.py",  # the A6 benchmark, which imports:
         "autograder/bench/cp_attention.py",  # its own ring attention and Ulysses (A6)
         "autograder/bench/a7_expert_parallel.py",  # the A7 benchmark, which imports:
         "autograder/bench/moe_dispatch.py",  # its own routing, capacity, EP dispatch (A7)
         "autograder/gpu_check/*"]  # needs solutions/ (as scripts/, where it was, never shipped)
KEEP_DOTFILES = {".gitignore"}

NOTE = """\
> **Student edition.** This copy of the course has the lessons, the released assignments, the
> `course` toolkit and the self-check grader, and none of the reference solutions: `solutions/`,
> the instructor's nbgrader configuration and the test suite (`tests/`, which grades the
> reference solutions) are left out, so `make test` finds no tests to run here, and the
> instructors' make targets (`release`, `student-edition`, `gradescope`) do not work.
>
> Self-check as described below: `check("<function>")` in the notebook, or
> `python -m autograder grade assignments/<assignment>/<notebook>.ipynb`. Your grade comes from
> your instructor's grading run, which can differ from the self-check:
> - **Speedup checks** compare your speedup with the reference solution's, measured in the same
>   run on the grading machine (you pass at 80% of it). This edition has no reference, so the
>   self-check asks for a **stated fixed threshold** instead and its message says so; on the
>   grading hardware the result may differ. Without the GPUs a speedup check needs, it is
>   skipped and the reason is shown.
> - A function is graded with your own versions of the other graded functions it calls, here
>   and in your instructor's grading alike, so a bug in one can also cost checks of those that
>   call it.
> - **Hidden checks** (fresh random cases against the instructor's answer key, hidden cases)
>   run only where the key is: when your instructor grades. Here they show as SKIP, "checked
>   when your instructor grades", and the report says how many points were checked here and how
>   many more your instructor's grading checks. The public checks you run here compare your code
>   with independent computations, invariants, error cases and a few fixed cases.
"""


class EditionError(Exception):
    pass


def tracked_files(repo: Path = REPO, include_untracked: bool = False) -> list[str]:
    """Paths (relative, POSIX) that git tracks and that exist in the working tree; with
    ``include_untracked``, also new files git does not ignore (not yet committed)."""
    cmd = ["git", "-C", str(repo), "ls-files", "-z", "--cached"]
    if include_untracked:
        cmd += ["--others", "--exclude-standard"]
    try:
        out = subprocess.run(cmd, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise EditionError(f"{repo} is not a git checkout (git ls-files failed: {exc})") from None
    names = sorted({n for n in out.decode().split("\0") if n})
    return [n for n in names if (repo / n).is_file() and not (repo / n).is_symlink()]


def wanted(path: str) -> bool:
    parts = path.split("/")
    if parts[0] not in INCLUDE:
        return False
    if "solutions" in parts:
        return False
    if any(p.startswith(".") and p not in KEEP_DOTFILES for p in parts):
        return False
    return not any(fnmatch.fnmatch(path, pattern) for pattern in NEVER)


def solution_regions(repo: Path = REPO) -> list[str]:
    """The text between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` in every reference
    notebook. Read as plain JSON (nbformat 4: a cell's source is a string or a list of lines),
    so that the edition builds with Python and git alone: ``make docker-work`` runs it on the
    host, before any venv."""
    regions = []
    for nb_path in sorted((repo / "solutions").glob("**/*.ipynb")):
        for cell in json.loads(nb_path.read_text(encoding="utf-8"))["cells"]:
            source = cell.get("source", "")
            source = source if isinstance(source, str) else "".join(source)
            for m in re.finditer(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, re.S):
                if m.group(1).strip():
                    regions.append(m.group(1))
    return regions


def key_regions(repo: Path = REPO) -> list[str]:
    """The code of every answer key (``solutions/<a>/answer_key.py``), without its imports,
    comments and blank lines: what :func:`leaks` must not find in the edition (a key copied
    into the grader, the toolkit or a lesson)."""
    regions = []
    for path in sorted((repo / "solutions").glob(f"*/{KEY_FILE}")):
        lines = [line for line in path.read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith(("#", "import ", "from "))]
        regions.append("\n".join(lines) + "\n")
    return regions


def _normalise(text: str) -> str:
    return " ".join(text.split())


def needles(region: str, window: int = 3, min_chars: int = 60) -> list[str]:
    """What must not appear: the whole region, and any ``window`` consecutive non-blank lines
    of it that together are at least ``min_chars`` long (a partial copy), whitespace-normalised."""
    lines = [_normalise(line) for line in region.splitlines() if line.strip()]
    out = [_normalise(region)]
    for i in range(len(lines) - window + 1):
        chunk = " ".join(lines[i:i + window])
        if len(chunk) >= min_chars:
            out.append(chunk)
    return out


def leaks(out_dir: Path, regions: list[str]) -> list[tuple[str, str]]:
    """``[(file, first line of the region)]`` for every region found (whole or in part) in a file."""
    searched = [(n, r.strip().splitlines()[0]) for r in regions for n in needles(r)]
    found = []
    for path in sorted(p for p in Path(out_dir).rglob("*") if p.is_file()):
        text = _normalise(path.read_text(encoding="utf-8", errors="ignore"))
        hits = {first for needle, first in searched if needle in text}
        found += [(str(path.relative_to(out_dir)), first) for first in sorted(hits)]
    return found


def add_note(readme: Path) -> None:
    """Put the student-edition note under the README's title."""
    text = readme.read_text() if readme.exists() else "# Course\n"
    lines = text.splitlines(keepends=True)
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("# ")), 0)
    readme.write_text("".join(lines[:at]) + "\n" + NOTE + "\n" + "".join(lines[at:]).lstrip("\n"))


def build(out_dir: str | Path, repo: Path = REPO, force: bool = False,
          include_untracked: bool = False) -> list[str]:
    """Write the student edition into ``out_dir``; return the relative paths written."""
    out = Path(out_dir).resolve()
    if out == repo.resolve() or repo.resolve().is_relative_to(out):
        raise EditionError(f"{out} would overwrite the repository")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise EditionError(f"{out} exists and is not empty (use --force to replace it)")
        shutil.rmtree(out)
    files = [f for f in tracked_files(repo, include_untracked) if wanted(f)]
    for rel in files:
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)
    add_note(out / "README.md")
    keys = [rel for rel in files if rel.rsplit("/", 1)[-1] == KEY_FILE]
    if keys:  # never reached while solutions/ is left out; a key moved elsewhere is caught here
        shutil.rmtree(out)
        raise EditionError("an answer key would ship, edition removed: " + ", ".join(keys))
    found = leaks(out, solution_regions(repo) + key_regions(repo))
    if found:
        shutil.rmtree(out)
        raise EditionError("reference solution or answer key text found, edition removed:\n" + "\n".join(
            f"  {f}: {first}" for f, first in found))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autograder edition",
                                description="Build the student edition of the course.")
    p.add_argument("out", help="folder to create (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--include-untracked", action="store_true",
                   help="also take new files git does not ignore (default: committed or staged "
                        "files only)")
    args = p.parse_args(argv)
    try:
        files = build(args.out, force=args.force, include_untracked=args.include_untracked)
    except EditionError as exc:
        print(f"Cannot build the student edition: {exc}", file=sys.stderr)
        return 1
    print(f"Student edition: {len(files)} files in {args.out} (no solutions/, no tests/, "
          "no nbgrader_config.py; see the note at the top of its README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
