"""What ``make lab`` / ``make lab-instructor`` start with (course/lab.py), without starting it.

Formgrader needs ``alembic`` on the server's PATH (nbgrader runs it to set up the gradebook),
and the lab's terminals should find this venv's ``python``: the server's PATH starts with the
folder of the Python that runs the lab, in both modes, whatever PATH ``make`` was started with.

Tier: quick.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from course import lab

HERE = os.path.dirname(os.path.abspath(sys.executable))


@pytest.mark.parametrize("mode", lab.MODES)
def test_server_path_starts_with_this_pythons_bin(mode):
    env = lab.lab_environment(mode, {"PATH": os.pathsep.join(["/usr/bin", "/bin"])})
    assert env["PATH"].split(os.pathsep) == [HERE, "/usr/bin", "/bin"]
    # what Formgrader runs, and what the terminal's `python` is
    assert shutil.which("alembic", path=env["PATH"]) == os.path.join(HERE, "alembic")
    assert Path(shutil.which("python", path=env["PATH"])).parent == Path(HERE)


def test_server_path_keeps_the_users_folders_once():
    env = lab.lab_environment("instructor", {"PATH": os.pathsep.join(["/opt/x", HERE, "/bin"])})
    assert env["PATH"].split(os.pathsep) == [HERE, "/opt/x", "/bin"]
    assert lab.lab_environment("student", {})["PATH"] == HERE


def test_lab_environment_leaves_the_callers_environment_alone(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin")
    env = lab.lab_environment("student")
    assert env["PATH"].startswith(HERE) and os.environ["PATH"] == "/usr/bin"
