"""The sandbox's policy as graded code meets it: what it sees, what it may do (no grading; one
short process in the sandbox per test). docs/grading.md's "Settings" and threat model.

Tier: quick (a few seconds).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

from autograder.sandbox import isolation, policy

PROBE = r"""
import ctypes, json, os, sys
sys.path.insert(0, {repo!r})
from autograder.sandbox.confine import confine
missing = confine()
libc = ctypes.CDLL(None, use_errno=True)
def refused(rc):
    return rc != 0
def writable(path):
    try:
        open(path, "a").close()
        return True
    except OSError:
        return False
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
print(json.dumps({{
    "missing": missing,
    "uid": os.getuid(),
    "repo": sorted(os.listdir({repo!r})),
    "etc_shadow": os.path.exists("/etc/shadow"),
    "proc_sys_writable": writable("/proc/sys/kernel/core_pattern"),
    "grader_writable": writable({repo!r} + "/autograder/results.py"),
    "scratch_writable": writable("scratch-file"),
    "processes": sorted(p for p in os.listdir("/proc") if p.isdigit()),
    "unfiltered": [p for p in os.listdir("/proc") if p.isdigit() and "Seccomp:\t2" not in
                   open(f"/proc/{{p}}/status").read()],
    "pid": os.getpid(),
    "cap_eff": int(status["CapEff"].strip(), 16),
    "seccomp": status["Seccomp"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
    "mount_refused": refused(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "umount_refused": refused(libc.umount2(b"/proc", 2)),
    "userns_refused": refused(libc.unshare(0x10000000)),
    "dev": sorted(os.listdir("/dev")),
}}))
"""


@pytest.fixture(scope="module")
def inside(tmp_path_factory):
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed here (.ci/run installs it): the sandbox falls "
                    "back to unshare, which tests/test_sandbox_attacks.py grades")
    scratch = tmp_path_factory.mktemp("scratch")
    cmd = [*policy.bwrap_command(scratch), sys.executable, "-c", PROBE.format(repo=str(REPO))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_bubblewrap_is_what_grades_where_it_is_installed():
    """Where bwrap is installed, a failure to start it must not quietly fall back to less."""
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed here")
    assert isolation.isolation_mode() == "bwrap", isolation._WHY_NOT_BWRAP
    assert isolation.reference_exposed() is None


def test_of_the_repository_only_the_grader_and_the_toolkit_are_there(inside):
    assert set(inside["repo"]) - {".venv"} == {"autograder", "course"}, inside["repo"]
    assert not inside["etc_shadow"]
    hidden = [REPO / n for n in policy.NEVER]
    for path in policy.visible_paths():
        assert not any(Path(path) == h or h in Path(path).parents or Path(path) in h.parents
                       for h in hidden), path


def test_unprivileged_and_filtered(inside):
    assert inside["missing"] == [] and inside["uid"] == policy.SANDBOX_ID
    assert inside["cap_eff"] == 0 and inside["seccomp"] == "2" and inside["no_new_privs"] == "1"
    assert inside["mount_refused"] and inside["umount_refused"] and inside["userns_refused"]


def test_read_only_but_its_scratch_folder(inside):
    assert not inside["grader_writable"] and not inside["proc_sys_writable"]
    assert inside["scratch_writable"]


def test_its_own_processes_and_devices_only(inside):
    # the worker is the namespace's PID 1 (--as-pid-1): no process of the sandbox lacks its
    # seccomp filter (bubblewrap's reaper would, and a kernel without Yama lets the same uid
    # open its memory)
    assert inside["processes"] == ["1"] and inside["pid"] == 1, inside["processes"]
    assert inside["unfiltered"] == [], inside["unfiltered"]
    assert set(inside["dev"]) <= {"null", "zero", "full", "random", "urandom", "tty", "ptmx",
                                  "pts", "shm", "fd", "stdin", "stdout", "stderr", "core"} | {
        d for d in inside["dev"] if d.startswith("nvidia")}


def test_seccomp_refuses_in_every_setting():
    """Without namespaces too (the process fallback): the filter and no capabilities."""
    code = ("import json, sys; sys.path.insert(0, %r)\n"
            "from autograder.sandbox.confine import confine, check_denied\n"
            "print(json.dumps([confine(), check_denied()]))" % str(REPO))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    missing, denied = json.loads(done.stdout)
    assert missing == [] and all(denied.values()), (missing, denied)
