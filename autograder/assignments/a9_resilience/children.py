"""Saves that get killed: a child forked from the sandbox's worker (beside the student's code),
stopped with SIGKILL at a chosen moment and always reaped. Used by :mod:`.probes`; judges
nothing.
"""
from __future__ import annotations

import os
import select
import signal
import time
import types

def error_text(exc) -> str:
    """An exception as one short line: its type and message."""
    return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:500]


#: What a save may call to write or commit: a kill is planted before or after each call (the
#: released text lists them; pathlib's methods go through them: ``Path.touch`` through os.open).
HOOKED = (("os", "replace"), ("os", "rename"), ("os", "link"), ("os", "symlink"),
          ("os", "fsync"), ("os", "fdatasync"), ("os", "unlink"), ("os", "remove"),
          ("os", "rmdir"), ("os", "mkdir"), ("os", "open"), ("builtins", "open"), ("io", "open"),
          ("shutil", "move"))
#: The calls that flush a file: each is reported with the file's identity and size.
SYNCS = ("os.fsync", "os.fdatasync")
#: Seconds a child's save may take before it counts as hung.
CHILD_TIMEOUT = 20.0


def _identity(fd):
    """``(st_dev, st_ino, st_size)`` of what ``fd`` (a descriptor, or an object with
    ``fileno()``) is open on, or None."""
    try:
        st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
    except Exception:  # noqa: BLE001 - the call itself will say what is wrong
        return None
    return st.st_dev, st.st_ino, st.st_size


def genuine(name):
    """os's own ``fsync`` or ``fdatasync`` (``name``: "os.fsync"): the posix module's builtin,
    whatever the submission put on ``os``. A flush cannot be seen in what it leaves behind, so
    the hooks call this one: a submission that replaced ``os.fsync`` by a function that does
    nothing still flushes for real under the hooks (and gains nothing)."""
    import posix

    attr = name.rpartition(".")[2]
    function = getattr(posix, attr, None)
    if not (type(function) is types.BuiltinFunctionType and function.__self__ is posix
            and function.__name__ == attr):
        raise RuntimeError(f"posix.{attr} was replaced before the save (by the submission?): "
                           f"the grader cannot observe its flushes")
    return function


def wrap_calls(targets, wrap, genuine_ones=()):
    """Replace each ``(module name, attribute)`` of ``targets`` by ``wrap(original,
    "module.attribute")``, where the original of a name in ``genuine_ones`` is
    :func:`genuine`'s; returns the undo (which puts back what was there)."""
    import importlib

    saved = []
    for module_name, attr in targets:
        module = importlib.import_module(module_name)
        name = f"{module_name}.{attr}"
        original = getattr(module, attr)
        saved.append((module, attr, original))
        setattr(module, attr, wrap(genuine(name) if name in genuine_ones else original, name))

    def undo():
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
    return undo


def install_hooks(plan, report, synced=None):
    """Wrap the file-system functions of :data:`HOOKED`: each call is an event; ``plan`` =
    (k, "before" | "after") kills this process at the k-th event (after: once it returned or
    raised); ``report(name)`` notes it; ``synced(dev, ino, size)`` notes each flush of
    :data:`SYNCS` that returned (the file's identity and its size at the call): posix's own
    flush (:func:`genuine`), never what the submission may have put in its place."""
    count = [0]

    def wrap(original, name):
        def hooked(*args, **kwargs):
            k = count[0]
            count[0] += 1
            report(name)
            if plan and plan == (k, "before"):
                os.kill(os.getpid(), signal.SIGKILL)
            flushed = _identity(args[0]) if synced and name in SYNCS and args else None
            try:
                result = original(*args, **kwargs)
            finally:  # after a call that raised too (os.mkdir of a folder that exists)
                if plan and plan == (k, "after"):
                    os.kill(os.getpid(), signal.SIGKILL)
            if flushed:
                synced(*flushed)
            return result
        return hooked
    wrap_calls(HOOKED, wrap, genuine_ones=SYNCS)


def run_child(body, on_go=None, timeout=CHILD_TIMEOUT):
    """Run ``body(say)`` in a forked child (``say(text)`` sends a line to this process); calls
    ``on_go(pid)`` when the child says "go". Returns (lines, how it ended, when each line
    first came). Always reaped."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        code = 1
        say = lambda text: os.write(w, (text + "\n").encode())  # noqa: E731
        try:
            body(say)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - sent to the probe
            say("error " + error_text(exc).replace("\n", " "))
        os._exit(code)
    os.close(w)
    lines, buf, deadline, ended, stamps = [], b"", time.monotonic() + timeout, None, {}
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                ended = "hung"
                break
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                lines.append(line.decode())
                stamps.setdefault(lines[-1], time.monotonic())
                if line == b"go" and on_go:
                    on_go(pid)
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL) if ended == "hung" else None
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    if ended is None:
        ended = (f"killed by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
                 else f"exit code {os.WEXITSTATUS(status)}")
    return lines, ended, stamps


def kill_child(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
