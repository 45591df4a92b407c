"""Start JupyterLab on the course, in the student's mode (default) or the instructor's.

``make lab`` runs ``python -m course.lab``; ``make lab-instructor`` adds ``--instructor``.
The two modes differ only in the Jupyter configuration folder that is put first on
``JUPYTER_CONFIG_PATH`` for this one server (``course/lab_config/student`` or
``course/lab_config/instructor``: a ``jupyter_server_config.json`` for the server extensions
and JupyterLab's news, a ``labconfig/page_config.json`` for the front-end extensions):

- students get no nbgrader tools (no *Nbgrader* menu, no Create Assignment, Formgrader or
  course-list panels, no nbgrader server extensions): they check their work with
  ``check(...)`` and ``python -m autograder grade``, and the instructor's tools would only
  confuse them;
- neither mode shows JupyterLab's news pop-up nor checks for updates (a workshop room's
  network and attention are for the course).

Why a per-launch folder rather than ``jupyter labextension disable``: that command writes to
the virtual environment (or the user's ``~/.jupyter``), so it would switch the tools off for
the instructor too, and for every other project sharing that environment. Here nothing
outside the course's folder changes. The folder lives in the ``course`` package, so the
student edition and the Docker image, which ship ``course/``, have it too.

The student's server runs in their *work folder* (``--work-dir``: ``work/`` unless
``COURSE_WORK_DIR`` says otherwise), made or brought up to date first by
:mod:`autograder.integrations.workfolder`: copies of the lessons and the released assignments,
no ``solutions/``, and nothing of the instructor's overwrites what the student changed there.
The instructor's runs where it is started (``make lab-instructor``: the repository, with
``solutions/`` and Formgrader). In both modes the server's ``PATH`` starts with this Python's
``bin`` folder: nbgrader runs ``alembic`` from ``PATH`` (Formgrader's gradebook), and the lab's
terminals find this venv's ``python``.

``tests/test_browser.py`` starts its server through :func:`lab_environment` and
:func:`lab_command`, so it tests what ``make lab`` starts.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MODES = ("student", "instructor")
CONFIG_ROOT = Path(__file__).resolve().parent / "lab_config"


def config_dir(mode: str = "student") -> Path:
    """The repository's Jupyter configuration folder for ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    folder = CONFIG_ROOT / mode
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is missing: reinstall the course (pip install -e .)")
    return folder


def lab_environment(mode: str = "student", env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``mode``'s folder first on JUPYTER_CONFIG_PATH
    and this Python's ``bin`` folder first on PATH.

    Folders already on JUPYTER_CONFIG_PATH stay, after it: a user's own extra configuration
    still applies where the course's folder says nothing.
    """
    env = dict(os.environ if env is None else env)
    paths = [str(config_dir(mode))]
    if env.get("JUPYTER_CONFIG_PATH"):
        paths.append(env["JUPYTER_CONFIG_PATH"])
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(paths)
    # this Python's bin (a venv's: not resolved, which would give the base interpreter's)
    here = os.path.dirname(os.path.abspath(sys.executable))
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != here]
    env["PATH"] = os.pathsep.join([here, *rest])
    return env


def lab_command(args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command line of JupyterLab run by this interpreter, with ``args`` appended."""
    return [sys.executable, "-m", "jupyterlab", *args]


def main(argv: list[str] | None = None) -> int:
    """Parse ``--instructor``; every other argument goes to ``jupyter lab`` unchanged."""
    parser = argparse.ArgumentParser(
        prog="python -m course.lab",
        description="JupyterLab on the course; other arguments are passed to jupyter lab.")
    parser.add_argument("--instructor", action="store_true",
                        help="keep nbgrader's instructor tools (menu Nbgrader, Formgrader)")
    parser.add_argument("--work-dir", default=os.environ.get("COURSE_WORK_DIR") or "work",
                        help="student mode: the work folder, made on the first run and then "
                             "never overwritten (default: $COURSE_WORK_DIR or work)")
    ours, rest = parser.parse_known_args(argv)
    mode = "instructor" if ours.instructor else "student"
    where = ""
    if mode == "student":
        from autograder.integrations.workfolder import WorkFolderError, sync

        try:
            for line in sync(ours.work_dir):
                print(line, flush=True)
        except WorkFolderError as exc:
            print(f"make lab: stopped: {exc}", file=sys.stderr)
            return 1
        if not any(a.startswith(("--ServerApp.root_dir", "--notebook-dir")) for a in rest):
            rest = [f"--ServerApp.root_dir={os.path.abspath(ours.work_dir)}", *rest]
            where = f", in your work folder {ours.work_dir}"
    env, cmd = lab_environment(mode), lab_command(rest)
    print(f"JupyterLab, {mode} mode{where} (configuration: {config_dir(mode)})", flush=True)
    if os.name == "posix":
        # Replace this process: Ctrl-C and JupyterLab's shutdown prompt reach it directly.
        os.execve(cmd[0], cmd, env)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
