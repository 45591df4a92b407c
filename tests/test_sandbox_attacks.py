"""A determined student against the sandbox: escape, reference theft, persistence, resource
exhaustion and protocol abuse (Assignment 1), each attack with its fair score.

Most attacks are written the same way: the attack runs first in the function; when it is
refused it raises ("blocked: ..."), and when it succeeds the function goes on with a correct
answer. So the fair score of each is zero, and a test that sees full points names the attack
that got through. Attacks on separate functions share one grading (each function's checks run
on their own). Persistence attacks are allowed to succeed inside the sandbox (the code is
correct, so the function keeps its points); what the test checks is that nothing of them is
left on the host after the grading. docs/grading.md's threat model lists what each class
stands for. The loose-comparison and self-timing classes are in tests/test_loose_comparisons.py
and tests/test_a1_a2_hardening.py.

Tier: full (about a minute and a half: fourteen gradings of A1's cheap functions).
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import REPO, points_by_function
from test_adversarial import FULL, REFERENCE, make_submission, messages, run

pytestmark = [pytest.mark.full, pytest.mark.slow]

PRELUDE = """\
import ctypes, errno, glob, json, os, pathlib, re, socket, stat, struct, sys, time
import autograder
libc = ctypes.CDLL(None, use_errno=True)
root = pathlib.Path(autograder.__file__).resolve().parents[1]
def must(rc, what):
    if rc != 0:
        raise OSError(ctypes.get_errno(), what + ": " + os.strerror(ctypes.get_errno()))
"""


def attacked(function: str, attack: str) -> str:
    """The reference ``function`` that first runs ``attack``; any exception from the attack
    becomes "blocked: ..." (the function then scores zero)."""
    body = textwrap.indent(PRELUDE + textwrap.dedent(attack), "        ")
    guard = (f"    try:\n{body}\n    except BaseException as exc:\n"
             "        raise RuntimeError(f'blocked: {type(exc).__name__}: {exc}') from None\n")
    return REFERENCE[function].replace('"""\n', '"""\n' + guard, 1)


# ---------------------------------------------------------------- must be refused (fair: 0)
# name: (function, attack). Every attack here raises when the sandbox refuses it.
THEFT = {
    "read the reference notebook": ("copy_params", """
        json.loads((root / "solutions/a1_data_parallel/data_parallel.ipynb").read_text())"""),
    "read an answer key": ("allreduce", """
        keys = glob.glob(str(root / "solutions" / "*" / "answer_key.py"))
        assert keys, "no answer key in sight"
        open(keys[0]).read()"""),
    "read the git history": ("split_batch", """
        assert os.listdir(root / ".git" / "objects")"""),
    "search every folder for a solution": ("split_batch_weighted", """
        found = []
        for top, dirs, files in os.walk("/"):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev", "/usr")]
            found += [os.path.join(top, f) for f in files
                      if f in ("data_parallel.ipynb", "answer_key.py") and "BEGIN SOLUTION"
                      in open(os.path.join(top, f), errors="ignore").read()]
        assert found, "no reference anywhere"
        open(found[0]).read()"""),
    "find the grader among the processes": ("train_batch", """
        seen = [open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
                for p in os.listdir("/proc") if p.isdigit()]
        assert any("autograder grade" in c or "pytest" in c for c in seen), seen"""),
}
ESCAPE = {
    "unmount whatever hides the rest": ("copy_params", """
        mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
        gone = [m for m in reversed(mounts) if libc.umount2(m.encode(), 2) == 0]
        assert gone, "no mount could be removed"
        json.loads((root / "solutions/a1_data_parallel/data_parallel.ipynb").read_text())"""),
    "bind-mount the repository elsewhere": ("allreduce", """
        os.makedirs("/tmp/repo", exist_ok=True)
        must(libc.mount(str(root).encode(), b"/tmp/repo", None, 4096 | 16384, None), "bind")
        os.listdir("/tmp/repo/solutions")"""),
    "a user namespace of its own": ("split_batch", """
        must(libc.unshare(0x10000000 | 0x20000), "unshare")"""),
    "clone into a new namespace": ("split_batch_weighted", """
        pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
        if pid == 0:
            os._exit(0)
        assert pid > 0, "clone refused"
        os.waitpid(pid, 0)"""),
    "ptrace the parent": ("train_batch", """
        must(libc.ptrace(16, os.getppid(), 0, 0), "ptrace attach")"""),
}
TAMPER = {
    "remount the grader read-write and edit it": ("copy_params", """
        libc.mount(None, str(root / "autograder").encode(), None, 32 | 4096, None)
        open(root / "autograder" / "results.py", "a").close()"""),
    "write into the toolkit": ("allreduce", """
        open(root / "course" / "__init__.py", "a").close()"""),
    "a sitecustomize for the next grading": ("split_batch", """
        import sysconfig
        open(os.path.join(sysconfig.get_paths()["purelib"], "sitecustomize.py"), "a").close()"""),
    "chroot": ("split_batch_weighted", """
        os.chroot("/tmp")"""),
    "become root": ("train_batch", """
        os.setuid(0)"""),
}
KERNEL = {
    "write a kernel setting back as it is": ("copy_params", """
        value = open("/proc/sys/kernel/core_pattern").read()
        open("/proc/sys/kernel/core_pattern", "w").write(value)"""),
    "write a sysfs setting back as it is": ("allreduce", """
        path = "/sys/kernel/mm/transparent_hugepage/enabled"
        value = re.search(r"\\[(\\w+)\\]", open(path).read()).group(1)
        open(path, "w").write(value)"""),
    "make a block device": ("split_batch", """
        os.mknod("/tmp/disk", stat.S_IFBLK | 0o600, os.makedev(8, 0))"""),
    "read the kernel log": ("split_batch_weighted", """
        os.read(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK), 4096)"""),
    "a keyring of the host": ("train_batch", """
        key = libc.syscall(250, 0, -3, 1)  # keyctl(KEYCTL_GET_KEYRING_ID, session, create)
        assert key > 0, "keyctl refused" """),
}
RESOURCES = {
    "fill /dev/shm": ("copy_params", """
        with open("/dev/shm/fill", "wb") as f:
            for _ in range(1024):
                f.write(b"x" * (1 << 20))"""),
    "exhaust file descriptors": ("allreduce", """
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(20000)]"""),
    "a 200 MiB file in its scratch folder": ("split_batch", """
        with open("big", "wb") as f:
            for _ in range(200):
                f.write(b"x" * (1 << 20))"""),
    "mount a new /proc": ("split_batch_weighted", """
        os.makedirs("/tmp/p", exist_ok=True)
        must(libc.mount(b"proc", b"/tmp/p", b"proc", 0, None), "mount proc")"""),
    "a handle past the mounts": ("train_batch", """
        handle = ctypes.create_string_buffer(struct.pack("Ii", 128, 0) + b"\\0" * 128)
        mount_id = ctypes.c_int()
        must(libc.syscall(303, -100, b"/", handle, ctypes.byref(mount_id), 0), "name_to_handle_at")"""),
}


HELPERS = {"split_batch", "allreduce"}  # train_batch runs with the submission's own


def gradings() -> list[dict]:
    """Every attack above, packed into as few gradings as fairness allows: a function at most
    once per grading, and train_batch never beside an attacked helper of its own (it would
    fail through the helper, hiding whether its own attack got through)."""
    groups: list[dict] = []
    for name, (fn, code) in {**THEFT, **ESCAPE, **TAMPER, **KERNEL, **RESOURCES}.items():
        for group in groups:
            taken = {f for f, _ in group.values()}
            if fn in taken or (fn == "train_batch" and taken & HELPERS) or (
                    fn in HELPERS and "train_batch" in taken):
                continue
            group[name] = (fn, code)
            break
        else:
            groups.append({name: (fn, code)})
    return groups


@pytest.mark.parametrize("attacks", gradings(), ids=lambda g: next(iter(g)).replace(" ", "-"))
def test_each_attack_is_refused_and_scores_zero(tmp_path, offline_env, attacks):
    before = _fingerprint()
    answers = {fn: attacked(fn, code) for fn, code in attacks.values()}
    report = run(make_submission(tmp_path, **answers), offline_env, "--speed", "skip")
    got = points_by_function(report)
    for name, (fn, _) in attacks.items():
        assert got[fn] == 0, f"{name!r} got through: {fn} scored {got[fn]}"
        assert "blocked:" in messages(report, fn), (name, messages(report, fn))
    assert _fingerprint() == before, "the grader's files changed"


def _fingerprint() -> dict[str, float]:
    """Modification times of the grader, the toolkit and the Python they run on."""
    import sysconfig

    out = {}
    for top in (REPO / "autograder", REPO / "course", Path(sysconfig.get_paths()["purelib"])):
        out[str(top)] = top.stat().st_mtime
        out.update({str(p): p.stat().st_mtime for p in top.glob("*.py")})
    return out


def test_no_network_beyond_its_own_loopback(tmp_path, offline_env):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    attack = f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hello')"
    report = run(make_submission(tmp_path, copy_params=attacked("copy_params", attack)),
                 offline_env, "--only", "copy_params")
    server.close()
    assert points_by_function(report)["copy_params"] == 0 and not accepted


# ---------------------------------------------------------------- persistence (fair: full)
def test_nothing_outlives_the_grading(tmp_path, offline_env):
    """Shared memory, a /dev/shm file, a /tmp file and a daemon, all made by correct code:
    its points stay, and none of it is on the host afterwards."""
    tag = uuid.uuid4().hex[:8]
    key = int(tag, 16) & 0x7FFFFFFF
    leave = f"""
        assert libc.shmget({key}, 1 << 20, 0o1000 | 0o666) >= 0, "shmget"   # IPC_CREAT
        open("/dev/shm/left-{tag}", "wb").write(b"x" * (1 << 20))
        open("/tmp/left-{tag}", "w").write("x")
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(4242)
            os._exit(0)
        """
    report = run(make_submission(tmp_path, copy_params=attacked("copy_params", leave)),
                 offline_env, "--only", "copy_params")
    assert points_by_function(report)["copy_params"] == FULL["copy_params"], report["results"]
    shm = Path("/proc/sysvipc/shm").read_text().split("\n")[1:]
    assert not [line for line in shm if line.split() and int(line.split()[0]) == key]
    assert not Path(f"/dev/shm/left-{tag}").exists() and not Path(f"/tmp/left-{tag}").exists()


# ---------------------------------------------------------------- exhaustion and protocol (fair: 0)
def _cgroups_here() -> bool:
    from autograder.sandbox import cgroup

    group = cgroup.make(1 << 30, 64)
    if group is not None:
        group.remove()
    return group is not None


def test_memory_in_a_memfd_counts(tmp_path, offline_env):
    if not _cgroups_here():
        pytest.skip("no cgroup here (not root, or /sys/fs/cgroup read-only): memfds are not "
                    "counted, as docs/grading.md says for this setting")
    hog = """
        hoard = [os.memfd_create("hoard") for _ in range(48)]  # 48 x 64 MiB (each under the
        for fd in hoard:                                        # file size limit)
            for _ in range(64):
                os.write(fd, b"x" * (1 << 20))"""
    report = run(make_submission(tmp_path, copy_params=attacked("copy_params", hog)),
                 offline_env, "--only", "copy_params", max_memory_mb=1024)
    assert points_by_function(report)["copy_params"] == 0
    assert "GiB of memory" in messages(report, "copy_params"), messages(report, "copy_params")


def test_a_thread_bomb_meets_the_kernels_limit(tmp_path, offline_env):
    if not _cgroups_here():
        pytest.skip("no cgroup here: processes and threads are counted by polling only")
    bomb = """
        import threading
        stop = threading.Event()
        try:
            for _ in range(10000):
                threading.Thread(target=stop.wait, daemon=True).start()
        finally:
            stop.set()"""
    report = run(make_submission(tmp_path, copy_params=attacked("copy_params", bomb)),
                 offline_env, "--only", "copy_params")
    assert points_by_function(report)["copy_params"] == 0
    assert "blocked:" in messages(report, "copy_params") or "processes" in messages(
        report, "copy_params"), messages(report, "copy_params")


@pytest.mark.parametrize("claimed", [1 << 40, 255 << 20], ids=["1TiB", "255MiB-of-noise"])
def test_a_forged_reply_frame_is_refused_and_the_grader_stays_small(tmp_path, offline_env, claimed):
    forge = f"""
        out = int(sys.argv[2])
        os.write(out, struct.pack("<Q", {claimed}))
        chunk = b"\\0" * (1 << 20)
        for _ in range({claimed} >> 20):
            os.write(out, chunk)
        time.sleep(60)"""
    path = make_submission(tmp_path, copy_params=attacked("copy_params", forge))
    peak = _grade_measuring_peak(path, offline_env)
    assert peak < 3 << 30, f"the grader grew to {peak / 2**30:.1f} GiB"


def _grade_measuring_peak(path, env) -> int:
    """Grade ``path`` with the CLI; the grader process's peak resident memory (VmHWM)."""
    out = path.parent / "report.json"
    proc = subprocess.Popen([sys.executable, "-m", "autograder", "grade", str(path), "--only",
                             "copy_params", "--json", str(out)], cwd=REPO,
                            env={**env, "AUTOGRADER_MAX_CALL_TIMEOUT": "20"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            status = psutil.Process(proc.pid).memory_full_info()
            peak = max(peak, status.rss)
        except psutil.Error:
            pass
        time.sleep(0.05)
    stdout = proc.stdout.read()
    assert re.search(r"copy_params.*0/1\s+FAIL", stdout), stdout
    assert "the grader reads" in stdout or "does not accept" in stdout, stdout
    return peak


def test_a_reply_that_would_run_code_in_the_grader_is_refused(tmp_path, offline_env):
    marker = tmp_path / "ran-in-the-grader"
    evil = f"""
import io, os, struct, sys, time

class Evil:
    def __reduce__(self):
        return (open, ({str(marker)!r}, "w"))

def copy_params(params, device):
    buf = io.BytesIO()  # past the probe: a reply frame of its own, straight into the pipe
    torch.save({{"ok": True, "value": [Evil() for p in params]}}, buf)
    os.write(int(sys.argv[2]), struct.pack("<Q", len(buf.getvalue())) + buf.getvalue())
    time.sleep(30)
"""
    report = run(make_submission(tmp_path, copy_params=evil), offline_env, "--only", "copy_params")
    assert points_by_function(report)["copy_params"] == 0 and not marker.exists()
    assert "does not accept" in messages(report, "copy_params")
