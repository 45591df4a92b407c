"""The sandbox's warm template: a process inside bubblewrap that imported torch and the worker's
code once, and forks a fresh worker for each grading. Student code never runs in it.

Why: a worker that starts cold pays an interpreter and ``import torch`` (1.4 s on a quiet core,
5 s on a busy one) before the first line of a submission runs; forked from this template it
starts in milliseconds. Used by the warm grader (:mod:`autograder.warm`) for ``check()``.

What each forked worker gets, before any student code runs (:func:`_become_worker`):

- its own mount, IPC and network namespaces, with a fresh ``/tmp`` and ``/dev/shm`` (tmpfs) and
  a loopback of its own: nothing a previous check wrote there, no shared memory segment, no
  listening socket of a previous check reaches it;
- the template's control socket closed, every other inherited descriptor closed but its two
  pipes and its output file;
- the same confinement as a cold worker (:func:`.confine.confine`: no capabilities, bounding
  set emptied, ``no_new_privs``, the seccomp filter), which the grader verifies from outside.

The template keeps ``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN`` and ``CAP_SETPCAP`` of *its* user
namespace only (bubblewrap's ``--cap-add``: they give nothing outside the sandbox) to make those
namespaces, and is not dumpable: a worker (same uid, same PID namespace) cannot read or write
its memory, and ptrace is refused by the filter. A worker can still kill or stop it: then the
grader's next request finds no template and starts cold (``autograder.warm`` says so); a stopped
template never answers, and an unanswered request is never retried on it. The grader kills every
process of the sandbox but the template once a grading ends, so a child left behind (``setsid``,
double fork) never meets the next check.

Protocol, on the control socket (one request at a time; the grader holds a lock): a request is
a JSON object ``{"work": folder, "env": {...}, "cpus": [...]}`` with four descriptors (request
pipe, reply pipe, output file, status pipe); the template forks, answers ``{"pid": <pid in the
sandbox's PID namespace>}``, and writes the worker's wait status to the status pipe when it
reaps it. The worker waits for one byte on its request pipe (the grader puts it in its cgroup
first), then runs :func:`autograder.sandbox.worker.main`.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import socket
import struct
import sys

_PR_SET_DUMPABLE = 4
_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 32, 4096
_MS_REC, _MS_PRIVATE = 1 << 14, 1 << 18
#: What the template imports once; a forked worker has it all.
PRELOAD = ("torch", "numpy", "cloudpickle", "pyseccomp", "autograder.sandbox.worker",
           "autograder.sandbox.as_loaded", "autograder.sandbox.confine",
           "autograder.sandbox.framing", "course.compat", "course.launch")
MAX_REQUEST_BYTES = 1 << 20


def serve(control_fd: int) -> None:
    """The template's loop: fork a worker per request, report each one's exit."""
    import importlib

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    for name in PRELOAD:
        importlib.import_module(name)
    control = socket.socket(fileno=control_fd)
    woken = wake_on_child_exit()
    control.sendall(b"ready\n")
    status_fds: dict[int, int] = {}  # worker pid -> its status pipe
    while True:
        readable, _, _ = select.select([control, woken], [], [], 5)
        if woken in readable:
            os.read(woken, 4096)
        _reap(status_fds)
        if control not in readable:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, 4)
        except OSError:
            return
        if not msg:
            return  # the grader is gone
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            control.sendall(b'{"error": "a request carries four descriptors"}\n')
            continue
        request = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                import signal

                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(fds[3])
                _become_worker(request, fds[0], fds[1], fds[2], control)
                code = 0
            except BaseException as exc:  # noqa: BLE001 - said in the worker's output
                os.write(2, f"autograder sandbox template: {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(code)
        for fd in fds[:3]:
            os.close(fd)
        status_fds[pid] = fds[3]
        control.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def wake_on_child_exit() -> int:
    """A pipe that becomes readable when a child exits (SIGCHLD through Python's wake-up fd):
    the grader learns of a worker's end at once, not at the next poll."""
    import signal

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    return read_end


def _reap(status_fds: dict[int, int]) -> None:
    """Reap every child that ended: the workers (their status to the grader) and, the template
    being the sandbox's PID 1, whatever a worker left behind and was re-parented here."""
    from autograder.sandbox.isolation import ended_children

    for pid, status in ended_children():
        fd = status_fds.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, struct.pack("i", status))
            except OSError:
                pass
            os.close(fd)


def _fresh_tmpfs(libc, target: str, size: int) -> None:
    """An empty tmpfs on ``target`` for this worker alone, with every mount below it (the
    repository's and Python's read-only binds, the template's scratch folder: bubblewrap puts
    them inside its own ``/tmp`` where they lie there) bound back in place, read-only where they
    were."""
    from autograder.sandbox.worker import _mounts

    below = sorted(((m, opts) for m, opts in _mounts() if m.startswith(target + "/")),
                   key=lambda m: m[0].count("/"))
    kept = [(m, opts, os.open(m, os.O_PATH)) for m, opts in below]
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                  f"size={size},mode=1777".encode()) != 0:
        raise OSError(ctypes.get_errno(), f"a fresh {target} could not be mounted")
    for mount, options, fd in kept:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(mount, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(mount), exist_ok=True)
            open(mount, "a").close()
        if libc.mount(f"/proc/self/fd/{fd}".encode(), mount.encode(), None, _MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), f"{mount} could not be bound back")
        if "ro" in options:
            libc.mount(None, mount.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)
        os.close(fd)


def _become_worker(request: dict, req_fd: int, rep_fd: int, out_fd: int, control) -> None:
    """In the forked child: fresh namespaces and file systems, then the worker's main."""
    libc = ctypes.CDLL(None, use_errno=True)
    control.close()
    os.setsid()
    if libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare of the worker's namespaces failed")
    libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
    size = int(request.get("tmpfs_bytes", 512 << 20))
    work = request["work"]
    for target in ("/tmp", "/dev/shm"):
        _fresh_tmpfs(libc, target, size)
    from autograder.sandbox.worker import loopback_up

    loopback_up()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    keep = sorted({req_fd, rep_fd})
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    # sys.stdout and sys.stderr are the template's, on descriptors 1 and 2 (now the output
    # file), empty and buffered as a cold worker's are (stdout by blocks, stderr by lines)
    os.chdir(work)
    os.environ.clear()
    os.environ.update(request["env"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = int(request.get("max_output_bytes", 64 << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    if request.get("cpus"):
        os.sched_setaffinity(0, request["cpus"])
    if os.read(req_fd, 1) != b"g":  # the grader moved us into the grading's cgroup first
        os._exit(0)
    from autograder.sandbox import worker

    sys.argv = [worker.__file__, str(req_fd), str(rep_fd)]  # as a cold worker's command line
    worker.main(req_fd, rep_fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
