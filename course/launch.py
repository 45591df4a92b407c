"""Run a function on N processes, from a notebook or a script: ``launch(fn, world_size, ...)``.

Why not ``torch.multiprocessing.spawn``? It pickles ``fn`` by reference, and a function
defined in a notebook cell cannot be found again by name in a fresh process. Forking instead
hangs when CUDA or torch's thread pool is already running. So :func:`launch`:

1. serialises ``fn`` and its arguments *by value* with cloudpickle,
2. starts ``world_size`` fresh processes, each with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
   ``MASTER_PORT`` set and a free port: forked from a *fork server* that imported torch once
   and never ran anything (so forking is safe, and a rank starts in milliseconds instead of
   the second or more that importing torch takes) on Linux; elsewhere, or with
   ``COURSE_LAUNCH_START=exec``, a new interpreter each (``python -m course.launch``),
3. in each, joins the default process group (NCCL with one GPU per process when there are
   enough GPUs, else gloo on CPU processes, which stand in for GPUs) with a timeout, and calls
   ``fn(rank, world_size, *args)``,
4. prints every line a rank writes, prefixed ``[rank r]``, and returns the ranks' return values
   in rank order; if any rank fails or the time runs out, it stops every other rank and raises.

Scripts use ``torchrun --standalone --nproc-per-node N script.py`` instead (see the DDP lesson).
"""
from __future__ import annotations

import datetime
import gc
import io
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# torch is imported where it is used, not here: the grader's sandbox imports this module to start
# the fork server (start_fork_server) before it imports torch itself, so that both imports run
# at once.


class LaunchError(RuntimeError):
    """A rank failed; the message holds the end of its output. ``failures``: ``[(rank, exit
    code, its last lines)]``, the likely cause first (a rank that only lost a peer comes after
    the ranks that failed otherwise)."""

    failures: list = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (``--master_port 0`` does not work).

    With ``COURSE_PORTS=LO-HI`` (set by ``grade-folder --jobs`` for each job) the port comes
    from that range only, so that jobs running side by side never race for the same port."""
    lo_hi = os.environ.get("COURSE_PORTS", "")
    if lo_hi:
        lo, hi = (int(x) for x in lo_hi.split("-"))
        start = random.randrange(lo, hi + 1)
        for port in [*range(start, hi + 1), *range(lo, start)]:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise OSError(f"no free port in COURSE_PORTS={lo_hi}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, gloo otherwise."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def device_for(rank: int) -> "torch.device":
    """The device rank ``rank`` should use: its own GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    return torch.device("cpu")


def start_method() -> str:
    """How ranks start: ``"forkserver"`` (the default on Linux) or ``"exec"`` (elsewhere, when
    ``COURSE_LAUNCH_START=exec``, or below a ``TMPDIR`` too long for the fork server's socket).
    Not macOS: its system libraries are not fork-safe. Not from a script run as ``python
    script.py`` either: multiprocessing would run the script's top level again in every rank
    (unless it is guarded by ``if __name__ == "__main__":``). Notebooks, ``python -m ...`` and
    ``python -c ...`` are fine."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) is not None and getattr(main, "__spec__", None) is None
    default = "forkserver" if sys.platform.startswith("linux") and not script else "exec"
    if os.environ.get("COURSE_LAUNCH_START", default) == "forkserver" \
            and "forkserver" in multiprocessing.get_all_start_methods() \
            and fork_server_socket_fits():
        return "forkserver"
    return "exec"


#: The longest path of a Unix socket (Linux: ``sun_path`` is 108 bytes with its NUL).
UNIX_SOCKET_PATH_MAX = 107
#: What multiprocessing adds below the temporary folder for the fork server's socket:
#: ``get_temp_dir()``'s ``pymp-XXXXXXXX`` and ``arbitrary_address("AF_UNIX")``'s
#: ``listener-XXXXXXXX`` (Python 3.11's multiprocessing.util and multiprocessing.connection).
FORK_SERVER_SOCKET_TAIL = "/pymp-XXXXXXXX/listener-XXXXXXXX"


def fork_server_socket_fits() -> bool:
    """Whether the fork server's Unix socket fits below this process's temporary folder. Below
    a long ``TMPDIR`` (a cluster's scratch folder; a grading job's sandbox inside it) it would
    not, the fork server could not start and no rank would: ranks then start by exec."""
    import tempfile

    path = os.fsencode(tempfile.gettempdir() + FORK_SERVER_SOCKET_TAIL)
    return len(path) <= UNIX_SOCKET_PATH_MAX


#: What the fork server imports before it forks its first rank.
FORK_SERVER_PRELOAD = ("torch", "torch.distributed", "cloudpickle", "course.launch")
#: More modules for it to import, comma-separated (e.g. ``torch.distributed.tensor``, which
#: costs every rank a second or more to import): the grader sets it for assignments whose ranks
#: use them.
PRELOAD_ENV = "COURSE_LAUNCH_PRELOAD"


def _fork_server_context():
    """multiprocessing's fork server, which starts once per process on first use. It imports
    torch and torch.distributed (and ``$COURSE_LAUNCH_PRELOAD``) and then only ever forks: no
    thread pool, no CUDA, nothing that a fork could copy in a bad state. (The preload list
    matters only when it starts.)"""
    context = multiprocessing.get_context("forkserver")
    extra = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    context.set_forkserver_preload([*FORK_SERVER_PRELOAD, *extra])
    return context


def pickler_keeping_filenames():
    """cloudpickle's Pickler class (a notebook's functions and classes by value), with four
    changes, each for code that runs in Jupyter and must run the same in every rank:

    - code objects keep their file names. cloudpickle 3 writes every code object it pickles by
      value with the file name "<dynamic-code>" (``_code_reduce`` in cloudpickle/cloudpickle.py,
      for deterministic pickles), so a rank's traceback would not name the cell or file where
      the failing line is. marshal keeps a code object whole, and every rank runs this same
      interpreter.
    - a module object that ``sys.modules`` holds under its name travels by reference, whatever
      its class. cloudpickle's table of reducers is looked up by exact type, so a subclass of
      ``types.ModuleType`` (``torch.ops`` is a ``torch._ops._Ops``; ``torch.distributed.config``
      a ``ConfigModuleInstance``) fell through to plain pickling and failed: "cannot pickle
      '_Ops' object" for any function that calls ``torch.ops.aten.index_select``.
    - a ``functools.cache``/``lru_cache`` wrapper defined in a notebook (``__main__`` or any
      module a rank cannot import it from) travels as the function it wraps, by value, and is
      wrapped again in the rank (with the same ``maxsize`` and ``typed``, an empty cache). Its
      own ``__reduce__`` names it by reference, and no rank could find it ("Can't get attribute
      '_helper' on <module '__main__'>").
    - a lock (``threading.Lock``, ``threading.RLock``, and so the ``Condition``, ``Event`` or
      ``queue.Queue`` built on them) travels as a new, unlocked lock: a notebook's global lock no longer stops its functions from reaching the ranks
      ("cannot pickle '_thread.lock' object"). Threads, open files and sockets still cannot.
    """
    import _thread
    import functools
    import marshal
    import threading
    import types
    from collections import ChainMap

    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap(
            {types.CodeType: lambda code: (marshal.loads, (marshal.dumps(code),)),
             _thread.LockType: lambda lock: (_thread.allocate_lock, ()),
             _thread.RLock: lambda lock: (threading.RLock, ())},
            cloudpickle.Pickler.dispatch_table)

        def reducer_override(self, obj):
            if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType \
                    and sys.modules.get(getattr(obj, "__name__", None)) is obj:
                return _import_module, (obj.__name__,)
            if isinstance(obj, functools._lru_cache_wrapper) and not _found_by_name(obj):
                parameters = obj.cache_parameters()
                return _cached, (obj.__wrapped__, parameters["maxsize"], parameters["typed"])
            return super().reducer_override(obj)

    return Pickler


def _import_module(name: str):
    import importlib

    return importlib.import_module(name)


def _cached(function, maxsize, typed):
    import functools

    return functools.lru_cache(maxsize=maxsize, typed=typed)(function)


def _found_by_name(obj) -> bool:
    """Whether another process finds ``obj`` by its module and qualified name (as pickle's by
    reference does): never for ``__main__``, which is another program there."""
    module = getattr(obj, "__module__", None)
    if module in (None, "__main__") or module not in sys.modules:
        return False
    target = sys.modules[module]
    for part in getattr(obj, "__qualname__", "").split("."):
        target = getattr(target, part, None)
    return target is obj


def start_fork_server(forked: bool = False) -> bool:
    """Start the fork server now, without waiting for its imports, so that they overlap with
    whatever this process does next (the grader's sandbox calls it before it imports torch and
    loads a submission). Returns whether ranks will start from it (:func:`start_method`).

    ``forked``: the server is this process forked, not a new interpreter: for a process that
    already imported what the server preloads and has run nothing else yet (no thread pool, no
    CUDA, no other thread), as the grader's worker forked from its warm template has; it is
    ready at once instead of importing torch again."""
    if start_method() != "forkserver":
        return False
    _fork_server_context()
    from multiprocessing import forkserver, util

    if not forked:
        forkserver.ensure_running()
        return True
    spawn = util.spawnv_passfds
    util.spawnv_passfds = _fork_and_run
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn
    return True


def _fork_and_run(path, args, passfds):
    """``multiprocessing.util.spawnv_passfds`` for :func:`start_fork_server`'s ``forked``: fork
    and run the ``-c`` program the server would have been started with (its descriptors are
    inherited); the pid, as the original returns it."""
    program = args[args.index("-c") + 1]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            start = 3  # as after exec: only the standard streams and the passed descriptors
            for fd in sorted({*passfds, 1 << 16}):
                if fd >= start:
                    os.closerange(start, fd)
                    start = fd + 1
            exec(compile(program, "<fork server>", "exec"), {"__name__": "__mp_main__"})
            code = 0
        finally:
            os._exit(code)
    return pid


class _Rank:
    """One rank's process, however it started; ``stdout`` carries its output and errors."""

    def __init__(self, how: str, tmp: str, rank: int, env: dict):
        self._popen = self._process = None
        if how == "exec":
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "course.launch", tmp, str(rank)], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.pid, self.stdout = self._popen.pid, self._popen.stdout
            return
        from multiprocessing.connection import Connection

        read_end, write_end = os.pipe()
        writer = Connection(write_end, readable=False)  # travels to the rank with the request
        context = _fork_server_context()
        self._process = context.Process(target=_forked_rank, args=(tmp, rank, env, writer),
                                        name=f"rank {rank}")
        try:
            self._process.start()
        finally:
            writer.close()  # the rank holds the only write end: its exit ends our reading
        self.pid, self.stdout = self._process.pid, os.fdopen(read_end, "rb")

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        return self._popen.poll() if self._popen else self._process.exitcode

    def kill(self) -> None:
        """Kill the rank and everything it started; wait for it."""
        try:
            import psutil

            for child in psutil.Process(self.pid).children(recursive=True):
                child.kill()
        except Exception:
            pass
        if self.poll() is None:
            (self._popen or self._process).kill()
        if self._popen:
            self._popen.wait()
        else:
            self._process.join()
            self._process.close()


def _forked_rank(tmp: str, rank: int, env: dict, out) -> None:
    """Body of a rank forked from the fork server: become the process `exec` would have
    started (our output into the pipe, our environment and module path), then work."""
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    for path in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    try:
        _worker(tmp, rank)
    except BaseException:  # report it as an interpreter would, not as multiprocessing does
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = 300.0,
           threads: int = 1, collective_timeout: float = 60.0, quiet: bool = False,
           env: dict | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return their results.

    ``threads``: torch threads per process (one each lets N CPU processes share N cores
    fairly). ``collective_timeout``: seconds a collective may wait before the process group
    gives up. ``timeout``: seconds for the whole run. ``quiet``: do not echo the ranks' output.
    """
    for attempt in range(3):
        try:
            return _launch(fn, world_size, args, backend, timeout, threads, collective_timeout,
                           quiet, env)
        except _PortTaken:
            if not quiet:
                print("[launch] the port was taken meanwhile; retrying with another", flush=True)
    raise LaunchError("could not find a free port for the process group three times")


class _PortTaken(Exception):
    """The free port we picked was taken before rank 0 could listen on it."""


def _launch(fn, world_size, args, backend, timeout, threads, collective_timeout, quiet, env):
    import cloudpickle
    import torch

    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    backend = backend or default_backend(world_size)
    if not quiet and backend == "gloo" and not torch.cuda.is_available():
        print(f"[launch] {world_size} CPU process(es) on gloo, standing in for GPUs "
              f"({os.cpu_count()} core(s), {threads} thread(s) each)", flush=True)
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        payload = io.BytesIO()
        pickler_keeping_filenames()(payload).dump((fn, args))
        Path(tmp, "payload.pkl").write_bytes(payload.getvalue())
        child_env = {**os.environ, **(env or {}),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                     "WORLD_SIZE": str(world_size), "LAUNCH_BACKEND": backend,
                     "LAUNCH_COLLECTIVE_TIMEOUT": str(collective_timeout),
                     "OMP_NUM_THREADS": str(threads), "LAUNCH_THREADS": str(threads),
                     "PYTHONUNBUFFERED": "1",
                     # functions of importable modules travel by name: see what we see
                     "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        procs, tails, readers, ended = [], [], [], {}
        how = start_method()
        for rank in range(world_size):
            proc = _Rank(how, tmp, rank, {**child_env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            tail: list[str] = []
            reader = threading.Thread(target=_pump, args=(proc, rank, tail, quiet, ended), daemon=True)
            reader.start()
            procs.append(proc), tails.append(tail), readers.append(reader)
        try:
            failed = _wait(procs, timeout)
        finally:
            for proc in procs:
                proc.kill()
            for reader in readers:
                reader.join(timeout=5)
        if failed == "timeout":
            raise TimeoutError(f"launch: ranks still running after {timeout:.0f} s; all stopped")
        if failed is not None and any("EADDRINUSE" in "".join(tails[r]) or "address already in use"
                                      in "".join(tails[r]).lower() for r, _ in failed):
            raise _PortTaken()
        if failed is not None:
            # the cause first: ranks that only lost a peer mid-collective come after it
            failed.sort(key=lambda rc: (_lost_peer(tails[rc[0]]), ended.get(rc[0], float("inf"))))
            error = LaunchError("\n".join(
                f"rank {rank} exited with code {code}; its last lines:\n" + "".join(tails[rank][-15:])
                for rank, code in failed))
            error.failures = [(rank, code, "".join(tails[rank][-15:])) for rank, code in failed]
            raise error
        return [cloudpickle.loads(Path(tmp, f"result-{r}.pkl").read_bytes())
                for r in range(world_size)]


def _pump(proc, rank, tail, quiet, ended):
    """Echo one rank's output with its prefix; note when it ended (its output closed)."""
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        del tail[:-200]
        if not quiet:
            sys.stdout.write(f"[rank {rank}] {line}")
            sys.stdout.flush()
    ended[rank] = time.monotonic()


def _lost_peer(tail: list[str]) -> bool:
    text = "".join(tail[-30:])
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                   "NCCL communicator was aborted", "Broken pipe"))


def _wait(procs, timeout):
    """None when every rank exited 0; 'timeout'; or the failed ranks as [(rank, code)]."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        first = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if first:
            time.sleep(1.0)  # let the ranks it brought down exit too, to report them all
            later = [(rank, p.poll()) for rank, p in enumerate(procs)
                     if p.poll() not in (None, 0) and rank not in dict(first)]
            return first + later
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.02)
    return "timeout"


def _worker(tmp: str, rank: int) -> None:
    """Body of one rank: join the group, run the function, save its return value."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    # What the rank inherited or imported (torch and the preloaded modules: a few hundred
    # thousand objects) goes to the collector's permanent generation, which no collection
    # walks: the collect before the goodbye below took 0.2-0.5 s per rank walking them (and
    # copied the fork server's pages it touched). What the rank makes from here on is
    # collected as usual.
    gc.freeze()
    torch.set_num_threads(int(os.environ.get("LAUNCH_THREADS", "1")))
    from course.compat import install

    install()  # newer torch.distributed names on an older torch (course/compat.py)
    world_size = int(os.environ["WORLD_SIZE"])
    backend = os.environ["LAUNCH_BACKEND"]
    fn, args = cloudpickle.loads(Path(tmp, "payload.pkl").read_bytes())
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=float(os.environ["LAUNCH_COLLECTIVE_TIMEOUT"]))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        Path(tmp, f"result-{rank}.pkl").write_bytes(cloudpickle.dumps(result))
        # An orderly goodbye. Objects that hold the group (a DDP reducer sits in reference
        # cycles) are freed first, and no rank tears its connections down while a peer may
        # still be talking to it; otherwise gloo can std::terminate a rank at exit
        # ("terminate called without an active exception") after all the work succeeded.
        del result
        gc.collect()
        try:
            dist.barrier()
        except RuntimeError:
            pass  # the group broke earlier (a collective timed out): our work is saved all the same
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: C++ destructors of threads that the libraries started are the
    # other way a finished rank could still abort. Everything it had to say is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
