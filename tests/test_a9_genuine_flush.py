"""A9's hooks flush with posix's own fsync: a submission cannot fake the flush that the
durability check looks for (autograder/assignments/a9_resilience/children.py, ``genuine``).

A flush leaves nothing behind to check, so the grader counts the ``os.fsync`` and
``os.fdatasync`` calls a save makes, through hooks. A submission that replaced ``os.fsync`` by a
function that does nothing, before the hooks went in, used to be counted as flushing; now the
hooks call posix's builtin, whatever is on ``os``: under them, such a save flushes for real, and
the replacement is back after them. A replaced ``posix.fsync`` is refused with a message.

Tier: quick (one subprocess, under a second).
"""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SCRIPT = r'''
import os, posix, tempfile
from autograder.assignments.a9_resilience import children

calls, events, flushed = [], [], []
fake = lambda fd: calls.append(fd)          # the submission's: flushes nothing
os.fsync = fake
children.install_hooks(None, events.append, lambda *identity: flushed.append(identity))
with tempfile.NamedTemporaryFile() as f:
    f.write(b"x" * 10)
    f.flush()
    os.fsync(f.fileno())
    st = os.fstat(f.fileno())
assert calls == [], calls                    # the fake was not what ran
assert events.count("os.fsync") == 1 and flushed == [(st.st_dev, st.st_ino, 10)], (events, flushed)
assert children.genuine("os.fsync") is posix.fsync
posix.fdatasync = fake
try:
    children.genuine("os.fdatasync")
except RuntimeError as exc:
    print("refused:", exc)
'''


def test_a_replaced_fsync_is_not_what_the_hooks_call():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "refused: posix.fdatasync was replaced before the save" in proc.stdout, proc.stdout
