"""What the worker does to itself before any student code runs, in every isolation mode: no
capabilities, ``no_new_privs``, a seccomp filter, bounded open files.

The policy is the list below, read as nsjail's and bubblewrap's are: everything is allowed
except the system calls that change what a process can see or do beyond its sandbox. Each is
refused with EPERM, which Python raises as ``PermissionError`` (a clear message, not a crash);
``clone3`` answers ENOSYS so that the C library falls back to ``clone``, whose flags the filter
can read (a ``clone`` that asks for a new namespace is refused like ``unshare``).

The grader never takes the worker's word for any of this: it reads ``/proc/<pid>/status`` of
the worker itself (:func:`autograder.sandbox.isolation.confinement_of`).
"""
from __future__ import annotations

import ctypes
import errno
import resource

#: System calls graded code never needs; each is refused with EPERM.
DENIED = (
    # the file system it was given: no mounts, no new root, no handles past its mounts
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # other processes and namespaces: no tracing, no reading their memory, no new namespaces
    "ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "pidfd_getfd",
    # the kernel itself
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "lookup_dcookie",
    "ioperm", "iopl", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # the machine's clocks and names (a namespace has its own names; clocks are the host's)
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "vhangup",
)
#: ``clone`` flags that make a namespace (CLONE_NEWNS ... CLONE_NEWTIME).
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080)
#: Open files per process (gloo's ranks need a few hundred at most).
MAX_OPEN_FILES = 4096

_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 38, 24, 28
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_SECBIT_ALL_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED ... all locked


def confine() -> list[str]:
    """Drop every capability, set ``no_new_privs``, bound open files and load the seccomp
    filter. Returns what could not be done (empty: everything), for the worker's output."""
    missing = []
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if not _drop_capabilities(libc):
        missing.append("capabilities not dropped")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MAX_OPEN_FILES, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, cap), cap))
    try:
        _load_filter()
    except Exception as exc:  # noqa: BLE001 - said loudly by the grader, which checks /proc
        missing.append(f"no seccomp filter ({type(exc).__name__}: {exc})")
    return missing


def _drop_capabilities(libc) -> bool:
    """Empty the bounding, ambient, effective, permitted and inheritable sets, and lock the
    securebits so that uid 0 (root of a user namespace) does not get them back on exec."""
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    libc.prctl(_PR_SET_SECUREBITS, _SECBIT_ALL_LOCKED_NOROOT, 0, 0, 0)  # fails without caps: fine
    for cap in range(64):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP, EINVAL past last

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    return libc.capset(ctypes.byref(header), ctypes.byref(data)) == 0


def _load_filter() -> None:
    import pyseccomp as sc

    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except Exception:  # noqa: BLE001 - a name this kernel's libseccomp does not know
            pass
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.load()  # sets no_new_privs too (libseccomp's default)


def check_denied() -> dict[str, bool]:
    """For the tests: whether each of three calls the filter refuses is refused here."""
    libc = ctypes.CDLL(None, use_errno=True)
    results = {}
    results["mount"] = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) != 0
    results["umount2"] = libc.umount2(b"/", 2) != 0
    results["unshare"] = libc.unshare(0x10000000) != 0  # CLONE_NEWUSER
    return results

