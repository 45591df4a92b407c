"""The child side of :mod:`autograder.sandbox`: executes student code and runs probes.

Everything here runs beside untrusted code, so nothing here decides a grade: it only
executes, calls and sends back plain data (serialised with ``torch.save``; the parent reads it
with ``weights_only=True``).
"""
from __future__ import annotations

import ctypes
import fcntl
import importlib
import io
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import traceback


def _frame_io(req_fd, rep_fd):
    from autograder.sandbox.framing import read_frame, write_frame

    def receive():
        return pickle.loads(read_frame(req_fd))  # from the trusted parent

    def send(obj):
        import torch

        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
        except Exception as exc:
            buf = io.BytesIO()
            torch.save({"ok": False, "error": f"the result could not be sent back: {exc}"}, buf)
        write_frame(rep_fd, buf.getvalue())

    return receive, send


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_NOATIME = 1, 2, 4, 8, 32, 1024
_MS_NODIRATIME, _MS_BIND, _MS_RELATIME, _MS_STRICTATIME = 2048, 4096, 1 << 21, 1 << 24
_KEEP_WRITABLE = ("/proc", "/dev")


def _isolate() -> None:
    """Inside fresh namespaces made by ``unshare`` (the fallback where bubblewrap is missing;
    we are PID 1 of a new PID namespace):

    - hide the paths named in AUTOGRADER_HIDE (the reference solutions, .git, ...) behind empty
      mounts (which :func:`autograder.sandbox.confine.confine` then keeps from being removed),
    - make every file system read-only except our own work folder (and /proc, /sys, /dev),
      then ``/proc/sys`` read-only too, and a private ``/dev/shm``,
    - bring the loopback interface up, so gloo on 127.0.0.1 works in the empty network.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    work = os.environ.pop("AUTOGRADER_WRITABLE", "")
    for path in filter(None, os.environ.pop("AUTOGRADER_HIDE", "").split(os.pathsep)):
        libc.mount(b"none", path.encode(), b"tmpfs", _MS_RDONLY, b"size=4k,mode=000")
    if work:
        libc.mount(work.encode(), work.encode(), None, _MS_BIND, None)
    for target, options in _mounts():
        if target == work or any(target == k or target.startswith(k + "/") for k in _KEEP_WRITABLE):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for name, bit in (("nosuid", _MS_NOSUID), ("nodev", _MS_NODEV), ("noexec", _MS_NOEXEC),
                          ("noatime", _MS_NOATIME), ("nodiratime", _MS_NODIRATIME),
                          ("relatime", _MS_RELATIME), ("strictatime", _MS_STRICTATIME)):
            if name in options:
                flags |= bit
        libc.mount(None, target.encode(), None, flags, None)
    libc.mount(b"none", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=512m,mode=1777")
    for path in (b"/proc/sys", b"/proc/sysrq-trigger"):  # root outside may write them otherwise
        libc.mount(path, path, None, _MS_BIND, None)
        libc.mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)
    loopback_up()


def loopback_up() -> None:
    """Bring the loopback interface of a new network namespace up (gloo uses 127.0.0.1)."""
    try:  # SIOCGIFFLAGS / SIOCSIFFLAGS: set IFF_UP on "lo"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifreq = struct.pack("16sH14s", b"lo", 0, b"")
            flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, ifreq))[1]
            fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 0x1, b""))
    except OSError:
        pass


def _mounts():
    """(mount point, options) of every mount, from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            yield fields[4].encode().decode("unicode_escape"), set(fields[5].split(","))


def _format_exception(exc: BaseException, filename_prefix: str = "<cell ") -> str:
    """The exception and the student's own frames (grader frames dropped)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(filename_prefix)]
    lines = [f"  in {f.filename[1:-1]}, line {f.lineno}, in {f.name}: {f.line}" for f in frames[-5:]]
    head = f"{type(exc).__name__}: {exc}"
    return "\n".join([head[:1500], *lines])


def _load(msg) -> dict:
    """Execute the cells one by one, as Jupyter runs them; a failing cell is recorded and the
    rest still run.

    As in a kernel, the cells run in the ``__dict__`` of a module named ``__main__`` that
    ``sys.modules`` holds (IPython does the same with its user namespace): dataclasses,
    ``typing.get_type_hints``, enums and ``pickle`` look classes up there. Each cell compiles
    with its own ``__future__`` imports only (not this file's), and its source is in
    ``linecache`` under its name, so ``inspect.getsource`` and tracebacks show its lines.
    cloudpickle sends ``__main__``'s functions and classes to ranks by value, as it does from a
    notebook. What the namespace holds once loaded is recorded: every multi-process run starts
    from that state (:mod:`autograder.sandbox.as_loaded`).
    """
    import builtins
    import linecache
    import types

    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module  # this worker's own code keeps its globals
    ns = module.__dict__
    ns.update(__builtins__=builtins, get_ipython=lambda: _NoShell())
    errors: dict[str, str] = {}
    if msg.get("objects"):
        import cloudpickle

        try:
            ns.update(cloudpickle.loads(msg["objects"]))
        except BaseException as exc:  # noqa: BLE001 - report anything, including SystemExit
            errors["<kernel objects>"] = _format_exception(exc)
    for cell_id, source in msg.get("cells", []):
        filename = f"<cell {cell_id}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            code = compile(source, filename, "exec", dont_inherit=True)
        except SyntaxError as exc:
            errors[cell_id] = f"SyntaxError: {exc.msg} (line {exc.lineno})"
            continue
        try:
            exec(code, ns)
        except SystemExit as exc:
            errors[cell_id] = f"the cell called exit({exc.code!r}); the rest of it was skipped"
        except BaseException as exc:  # noqa: BLE001
            errors[cell_id] = _format_exception(exc)
    from autograder.sandbox import as_loaded

    as_loaded.record(ns)
    return ns, errors


def _free_memory() -> None:
    """Between checks: drop garbage and give cached CUDA memory back. What survives the
    collection (torch and everything imported since, the submission's module and what it
    keeps) goes to the collector's permanent generation, which later collections skip: each
    walked it all again, about 0.15 s a check once torch.distributed and torch._dynamo are in.
    What later checks make is collected as before."""
    import gc

    import torch

    gc.collect()
    gc.freeze()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _leave_with_the_grader(req_fd: int) -> None:
    """If the grader dies (a test's timeout, a killed kernel, Ctrl-C twice), nobody would stop
    student code that never returns: it would spin on, re-parented to init. A daemon thread
    waits for the request pipe's hang-up (every writer gone) and kills the worker's process
    group (in a PID namespace the worker is PID 1: the kernel then kills every process in it).
    It never reads the pipe, so the main loop's frames are untouched."""
    def watch():
        poller = select.poll()
        poller.register(req_fd, 0)  # hang-up and errors are always reported; no data asked for
        while True:
            for _, events in poller.poll():
                if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    try:
                        os.killpg(0, signal.SIGKILL)
                    finally:
                        os._exit(1)

    threading.Thread(target=watch, name="leave-with-the-grader", daemon=True).start()


class _NoShell:
    """Stands in for IPython's shell so that leftover magics do nothing."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def main(req_fd: int, rep_fd: int) -> None:
    if os.getpid() == 1 and "AUTOGRADER_WRITABLE" in os.environ:
        _isolate()  # PID 1 of a fresh PID namespace made by unshare (bubblewrap's is set up)
    from autograder.sandbox.confine import confine

    for problem in confine():  # before anything else starts: every process inherits it
        print(f"autograder sandbox: {problem}", file=sys.stderr)
    from autograder.sandbox.framing import WARM_RANKS_ENV

    if os.environ.get(WARM_RANKS_ENV):
        # the ranks' fork server imports torch while we import it and load the submission
        from course.launch import start_fork_server

        # forked from the warm template, this process imported torch and ran nothing else:
        # the fork server is then this process forked, ready at once
        start_fork_server(forked="torch" in sys.modules)
    receive, send = _frame_io(req_fd, rep_fd)
    _leave_with_the_grader(req_fd)
    import torch

    from autograder.sandbox.as_loaded import exact_float32
    from course.compat import install

    install()  # torch.distributed's newer names on an older torch, as every rank has them
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ns: dict = {}
    while True:
        try:
            msg = receive()
        except EOFError:
            return
        if msg["op"] == "load":
            ns, errors = _load(msg)
            send({"ok": True, "cell_errors": errors})
        elif msg["op"] == "call":
            probe = None
            try:
                probe = getattr(importlib.import_module(msg["module"]), msg["probe"])
                exact_float32()
                value = probe(ns, *msg["args"])
                send({"ok": True, "value": value})
                del value
            except SystemExit as exc:
                send({"ok": False, "error": f"your code called exit({exc.code!r})"})
            except BaseException as exc:  # noqa: BLE001
                send({"ok": False, "error": _format_exception(exc)})
            if not getattr(probe, "timed", False):  # a timed probe's calls run back to back: a
                _free_memory()                       # clean-up would be timed too


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
