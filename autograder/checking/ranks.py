"""Running code on N ranks from a probe (in the sandbox): one-shot runs and ranks that stay up.

- :func:`run_ranks` runs ``fn(rank, world_size, *args)`` on fresh processes
  (:func:`course.launch.launch`: gloo on CPU processes, NCCL where every rank can have its own
  GPU) and turns a failure into a short message: the first rank to fail, its exception and the
  student's frames, not the launcher's.
- :class:`RankServer` keeps ranks up across probe calls and runs named commands on them, so
  that the grader can time each command from its own process (the speed checks), alternating
  between the student's ranks and the reference's, which live in another sandbox.

Everything here runs beside untrusted code and imports nothing heavier than torch.
"""
from __future__ import annotations

import datetime
import itertools
import re
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ..sandbox import as_loaded
from ..sandbox.as_loaded import exact_float32

#: Seconds a collective (or a receive) may wait before its process group gives up: a ring
#: whose ranks wait for each other fails after this, with a message, instead of hanging.
COLLECTIVE_TIMEOUT = 20.0
#: Seconds for one whole multi-process run (start-up included) before every rank is stopped.
LAUNCH_TIMEOUT = 90.0


class RanksTimedOut(RuntimeError):
    """The ranks of a run were still running at its timeout and were stopped: a probe that
    would start more runs of the same code stops there (a hang costs one timeout)."""


def run_ranks(fn, world_size: int, *args, backend: str | None = None,
              timeout: float = LAUNCH_TIMEOUT, collective_timeout: float = COLLECTIVE_TIMEOUT,
              in_process: bool = True) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns their results in rank
    order, or raises RuntimeError with a readable message.

    The ranks start from the student's namespace as the cells left it, not as earlier checks
    did (:mod:`.as_loaded`), as the notebook's ``launch`` starts fresh processes. With
    ``in_process``, one rank runs here, in a process group of one (no process start: the same
    behaviour for the code under test, seconds sooner), unless the namespace has changed since
    it was loaded: then that rank, too, is a fresh process."""
    from course.launch import LaunchError, launch

    if world_size == 1 and in_process and not as_loaded.changed_since_load():
        return [_in_this_process(fn, args, backend, collective_timeout)]
    payload = as_loaded.dumps((fn, args))
    with tempfile.TemporaryDirectory(prefix="rank-errors-") as errors:
        try:
            return launch(_noting_failure, world_size, errors, payload, backend=backend,
                          timeout=timeout, quiet=True, collective_timeout=collective_timeout)
        except LaunchError as exc:
            raise RuntimeError(_first_failure(Path(errors), exc, world_size)) from None
        except TimeoutError:
            raise RanksTimedOut(
                f"with {world_size} processes, the ranks were still running after {timeout:.0f} s "
                "and were stopped: does every send have a matching receive on the other rank, "
                "and does every rank make the same calls in the same order?") from None


def _in_this_process(fn, args, backend, collective_timeout):
    """``fn(0, 1, *args)`` in a process group of one, with one torch thread (as launch gives
    each of its processes)."""
    from course.launch import default_backend

    backend = backend or default_backend(1)
    if backend == "nccl":
        torch.cuda.set_device(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        return fn(0, 1, *args)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _noting_failure(rank, world_size, errors, payload):
    """Run the function in ``payload`` (:func:`.as_loaded.dumps` of ``(fn, args)``) on a rank;
    if it raises, note when and why in ``errors`` (a folder), so that the first failure is
    reported, not a neighbour's broken connection that followed it."""
    try:
        fn, args = as_loaded.loads(payload)
        exact_float32()
        return fn(rank, world_size, *args)
    except BaseException as exc:
        Path(errors, f"{time.time():.6f}-{rank}").write_text("".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)))
        raise


#: What a rank says when it only lost its peer: the cause is elsewhere.
_LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|NCCL communicator was "
                        r"aborted|Timed out|timed out")


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _first_failure(errors: Path, launch_error, world_size: int) -> str:
    """The first rank that failed, with its own error: a Python exception noted by the rank,
    unless every noted exception only reports a lost peer and a rank died without one (a C++
    abort in gloo, a signal, ``os._exit``): then that rank, with its own last lines."""
    launch_message = str(launch_error)
    first = sorted(errors.iterdir(), key=lambda f: float(f.name.split("-")[0]))
    noted = {f.name.split("-")[1] for f in first}
    silent = [(rank, code, tail) for rank, code, tail in getattr(launch_error, "failures", [])
              if str(rank) not in noted]
    if silent and all(_LOST_PEER.search(f.read_text()) for f in first):
        rank, code, tail = silent[0]
        message = short_traceback(tail, f"with {world_size} processes, rank {rank} died "
                                        f"({_exit_reason(code)}) outside Python")
        others = sorted(noted | {str(r) for r, _, _ in silent[1:]})
        if others:
            message += f"\n(rank(s) {', '.join(others)} failed after it: they lost their peer)"
    elif first:
        rank = first[0].name.split("-")[1]
        others = sorted({f.name.split("-")[1] for f in first[1:]} - {rank})
        message = short_traceback(first[0].read_text(), f"with {world_size} processes, rank "
                                                        f"{rank} failed")
        if others:
            message += f"\n(rank(s) {', '.join(others)} failed as well)"
    else:
        message = short_traceback(launch_message, launch_message.splitlines()[0].split(";")[0])
    if "size doesn't match" in message:
        message += ("\nA receive's tensor has another size than the tensor its peer sent (or the "
                    "two ranks made different calls in between): sizes must match call for call.")
    elif re.search(r"gloo|nccl|Timed out|timed out|Connection (reset|closed)", message):
        message += ("\nA rank waited for a message its neighbour never sent, or sent one nobody "
                    "received: every send needs a matching receive, posted in the same order "
                    "on both ranks, and every rank must make the same collective calls.")
    return message[-1800:]


def short_traceback(text: str, head: str) -> str:
    """The useful part of a rank's traceback: its last exception line and the student's frames
    (code from notebook cells), without the launcher's frames or torch's log lines."""
    text = re.sub(r"(?m)^\[rank\d+\]:\s?", "", text)
    lines = [line.rstrip() for line in text.splitlines()]
    frames = list(dict.fromkeys(f"  in {m.group(1)}, line {m.group(2)}"
                                for m in re.finditer(r'File "<(cell [^>]*)>", line (\d+)', text)))
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)]
    last = errors[-1] if errors else next((line for line in reversed(lines) if line.strip()), "")
    return "\n".join([f"{head}: {last}"[:800], *frames[-4:]])


# ---------------------------------------------------------------------------- ranks that stay up

def _serve(rank, world_size, port, setup, fn, args):
    """Body of each rank of a :class:`RankServer`: ``commands = setup(rank, world_size, fn,
    *args)``, then run what the store asks for (``go-K`` = ``name:count``) until ``stop``.
    A rank without the named command does nothing for it. Returns ``commands["result"]()``."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=900))
    commands = setup(rank, world_size, fn, *args)
    store.set(f"ready-{rank}", "1")
    for k in itertools.count():
        name, _, count = store.get(f"go-{k}").decode().partition(":")
        if name == "stop":
            break
        for _ in range(int(count)):
            if name in commands:
                commands[name]()
        store.set(f"done-{k}-{rank}", "1")
    return commands["result"]() if "result" in commands else None


class RankServer:
    """``world_size`` ranks that stay up (started in a background thread of this process) and
    run named commands on demand; :meth:`run` returns when every rank has run it."""

    def __init__(self, setup, fn, world_size: int, *args, backend: str | None = None):
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=900))
        self.k, self.error, self.result, self.waiting = 0, None, None, []
        self.waiting = [f"ready-{r}" for r in range(world_size)]
        self.thread = threading.Thread(target=self._launch, daemon=True,
                                       args=(setup, fn, args, backend))
        self.thread.start()
        self._wait(self.waiting)

    def _launch(self, setup, fn, args, backend):
        waker = dist.TCPStore("127.0.0.1", self.store.port, is_master=False,  # its own connection:
                              timeout=datetime.timedelta(seconds=900))        # the probe waits on the other
        try:
            self.result = run_ranks(_serve, self.world_size, self.store.port, setup, fn, args,
                                    backend=backend, timeout=3600, collective_timeout=60.0,
                                    in_process=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting probe
            self.error = exc
        for key in self.waiting:      # wake the probe that waits for the ranks
            waker.set(key, "failed")

    def _wait(self, keys, timeout: float = 600.0):
        """Wait until the ranks set ``keys``; if they failed, raise their error instead (the
        launching thread sets the awaited keys when it ends, so this never waits for nothing)."""
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive() and self.result is None:
            raise RuntimeError("the ranks stopped before they were asked to")
        self.store.wait(keys, datetime.timedelta(seconds=timeout))
        if self.error is not None:
            raise self.error

    def run(self, command: str, count: int = 1) -> None:
        k = self.k
        self.k += 1
        self.waiting = [f"done-{k}-{r}" for r in range(self.world_size)]
        self.store.set(f"go-{k}", f"{command}:{count}")
        self._wait(self.waiting)

    def stop(self, timeout: float = 60.0) -> list:
        """Stop the ranks; what each one's ``result`` command returned, in rank order."""
        self.store.set(f"go-{self.k}", "stop")
        self.thread.join(timeout=timeout)
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise RuntimeError(f"the ranks did not stop within {timeout:g} s of being asked to")
        return self.result


# ---------------------------------------------------------------------------- probes for servers
# Module-level, so that the grader can call them by name in a sandbox: the student's (where
# ``function`` is the student's) or a reference sandbox's (where it is the reference's).

_SERVERS: dict[str, RankServer] = {}


def probe_server_start(ns, key: str, function, setup, world_size: int, args: tuple,
                       backend=None) -> None:
    """Start ranks running ``setup`` with the namespace's ``function`` (a spec Function: a
    function or a class): the student's own, calling the student's own versions of the other
    graded functions."""
    from .probes import student_function

    probe_server_stop(ns, key)
    fn = student_function(ns, function)
    _SERVERS[key] = RankServer(setup, fn, world_size, *args, backend=backend)


def probe_server_run(ns, key: str, command: str, count: int = 1) -> None:
    _SERVERS[key].run(command, count)


probe_server_run.timed = True  # the worker skips its between-call clean-up: it would be timed


def probe_server_stop(ns, key: str):
    """Stop the ranks of ``key`` (if up); what their ``result`` commands returned."""
    server = _SERVERS.pop(key, None)
    return None if server is None else server.stop()
