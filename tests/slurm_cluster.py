"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd on this machine.

Why a real one: the course's sbatch scripts (course/scripts/slurm_*.sbatch) are otherwise only
run with faked ``SLURM_*`` variables, which cannot show that Slurm accepts their options, that an
array's tasks really run side by side, or that ``srun`` starts the training. Everything lives in
one temporary folder (munge key and socket, slurm.conf, state, spool, logs), on ports free a
moment before, so the machine's own Slurm or munge (if any) is neither used nor disturbed. The
daemons run in the foreground as children of the test; :meth:`Cluster.stop` cancels what is
still queued, stops them, reaps them, and kills whatever job process outlived them (found by this
cluster's own ``SLURM_CONF`` in its environment).

Where a daemon cannot run here (binary missing, no privileges, a node that never becomes idle),
:func:`start` raises :class:`Unavailable` with the daemon's own error line; the tests skip on it.
Installed by ``.ci/install-slurm`` (Debian's slurm-wlm and munge). Tested with Slurm 22.05.
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.launch import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
NODE = "localhost"


class Unavailable(Exception):
    """This machine cannot run the cluster; the message says why (a daemon's own words)."""


def which(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))
    if not found:
        raise Unavailable(f"{name} not found: install Debian's slurm-wlm and munge "
                          "(.ci/install-slurm does, as root)")
    return found


def short_tmp() -> str:
    """A folder for the cluster: munge's socket path must fit in 108 bytes (sun_path)."""
    base = tempfile.gettempdir()
    return base if len(base) <= 40 else "/tmp"


def slurm_conf(root: Path, cpus: int, user: str) -> str:
    return f"""\
ClusterName=coursetest
SlurmctldHost={NODE}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
NodeName={NODE} CPUs={cpus} RealMemory=1024 State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def error_line(log: Path, last: bool = True) -> str:
    """The daemon's own reason: its last fatal line, else its last error line (PMIx's
    complaints apart: this Slurm is built with a PMIx it may not find), else its last line
    (``last``) or nothing."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for word in ("fatal", "error"):
        hits = [ln for ln in lines if word in ln.lower() and "pmix" not in ln.lower()]
        if hits:
            return hits[-1]
    return (lines[-1] if lines else "(no output)") if last else ""


@dataclass
class Cluster:
    root: Path
    conf: Path
    env: dict                      # SLURM_CONF set, no SLURM_* of an enclosing job
    procs: dict = field(default_factory=dict)    # daemon name -> Popen

    def run(self, *cmd: str, timeout: float = 30, check: bool = True
            ) -> subprocess.CompletedProcess:
        proc = subprocess.run([which(cmd[0]), *cmd[1:]], env=self.env, text=True,
                              capture_output=True, timeout=timeout)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str, cwd: Path, env: dict) -> str:
        """Submit; return the job id (the jobs start in ``cwd``: SLURM_SUBMIT_DIR)."""
        env = {**without_slurm(env), "SLURM_CONF": str(self.conf)}
        proc = subprocess.run([which("sbatch"), "--parsable", *args], cwd=cwd, env=env,
                              text=True, capture_output=True, timeout=30)
        if proc.returncode:
            raise RuntimeError(f"sbatch exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def wait(self, job: str, timeout: float) -> list[dict]:
        """Wait until no task of ``job`` is queued or running (polled every half second, not
        ``sbatch --wait``, which polls at growing intervals: up to half a minute late); return
        each task's JobState and ExitCode. Past ``timeout`` the job is cancelled."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-j", job, "-o", "%i", check=False).stdout.strip():
            if time.monotonic() > deadline:
                self.run("scancel", job, check=False)
                raise TimeoutError(f"job {job} still queued or running after {timeout:.0f} s")
            time.sleep(0.5)
        shown = self.run("scontrol", "-o", "show", "job", job).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in shown.splitlines() if line]

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), reap them; kill any
        process still carrying this cluster's SLURM_CONF. Returns what had to be killed so."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--partition", "debug", check=False)
                deadline = time.monotonic() + 15
                while (time.monotonic() < deadline
                       and self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip()):
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass                      # a stuck controller: the daemons are stopped below
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        deadline = time.monotonic() + 5      # a slurmstepd may take a moment to exit
        while (left := stray_processes(self.conf)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, what in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        return [f"{pid} {what}" for pid, what in left]


def without_slurm(env) -> dict:
    """``env`` less the variables of an enclosing Slurm job (the tests may run inside one)."""
    return {k: v for k, v in env.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}


def stray_processes(conf: Path) -> list[tuple[int, str]]:
    """Processes (other than this one) whose environment holds this cluster's SLURM_CONF:
    slurmstepd and job processes, which Slurm detaches from slurmd."""
    mark = f"SLURM_CONF={conf}".encode() + b"\0"
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark in (d / "environ").read_bytes():
                found.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ")
                              .decode(errors="replace").strip()))
        except OSError:
            continue
    return found


def start(cpus: int = 2, ready_s: float = 30) -> Cluster:
    """Start munged, slurmctld and slurmd; return once ``sinfo`` shows the node idle."""
    for name in (*DAEMONS, *CLIENTS):
        which(name)
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir=short_tmp()))
    root.chmod(0o755)               # munge's socket must be reachable by the jobs' user
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    (root / "munge").mkdir(mode=0o711)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, cpus, getpass.getuser()))
    env = {**without_slurm(os.environ), "SLURM_CONF": str(conf)}
    cluster = Cluster(root, conf, env)
    commands = {
        "munged": [which("munged"), "--foreground", "--force", f"--key-file={key}",
                   f"--socket={root}/munge/munge.socket", f"--pid-file={root}/munge/munged.pid",
                   f"--seed-file={root}/munge/munged.seed", f"--log-file={root}/log/munged.log"],
        "slurmctld": [which("slurmctld"), "-D"],
        "slurmd": [which("slurmd"), "-D", "-N", NODE],
    }
    try:
        for name, cmd in commands.items():
            with open(root / "log" / f"{name}.out", "wb") as log:
                cluster.procs[name] = subprocess.Popen(cmd, env=env, stdout=log,
                                                       stderr=subprocess.STDOUT)
            if name == "munged":
                wait_for(lambda: (root / "munge" / "munge.socket").exists(), cluster, 10,
                         "munged made no socket")
        wait_for(lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
                 .stdout.strip() == "idle", cluster, ready_s, "the node never became idle")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_for(ready, cluster: Cluster, seconds: float, what: str) -> None:
    """Poll ``ready`` until true; a daemon that exits, or the time running out, is Unavailable
    with the daemon's own last error line (and the node's state and reason from sinfo)."""
    deadline = time.monotonic() + seconds
    while not ready():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise Unavailable(f"{name} exited {proc.returncode}: "
                                  f"{error_line(cluster.root / 'log' / f'{name}.out')}")
        if time.monotonic() > deadline:
            state = ""
            if "slurmctld" in cluster.procs:
                state = cluster.run("sinfo", "-h", "-N", "-o", "%T %E", check=False).stdout
            logs = "; ".join(f"{n}: {line}" for n in cluster.procs
                             if (line := error_line(cluster.root / "log" / f"{n}.out", False)))
            raise Unavailable(f"{what} in {seconds:.0f} s (node: {state.strip() or '?'}); {logs}")
        time.sleep(0.3)
