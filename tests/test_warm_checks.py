"""check()'s warm path (autograder/warm.py, autograder/sandbox/template.py and zygote.py): later
checks of a kernel fork their grader and their worker from templates, and keep every guarantee
of a cold check.

Each test runs a stand-in for a kernel (a Python process that imported torch and defined the
functions, as a notebook does) and calls ``check()`` there, several times:

- a function that leaves everything it can behind (files in ``/tmp``, ``/dev/shm``, its work
  folder and home; a patched torch; an environment variable; a thread; a ``setsid`` child) and
  fails when it meets anything a *previous* check left, or can open its template's memory, holds
  a socket, or has a capability or no seccomp filter: every check passes, the later ones forked
  (never the cold grader), and no child survives its check;
- the sandbox's template killed, or stopped, between checks: the next check passes (its worker
  started cold, said on the report's Isolation line), and the one after is warm again; the grader
  template killed: the next check says so in one line and passes;
- the kernel killed: its templates are gone within seconds;
- the idle templates' memory, printed and bounded.

Tier: quick for the first (about 15 s); full for the others.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import REPO

needs_bwrap = pytest.mark.skipif(
    not __import__("shutil").which("bwrap"), reason="the warm sandbox runs in bubblewrap")

#: A kernel's definitions: copy_params, correct, that leaves everything behind it can and fails
#: on anything left by another worker (each worker runs the cell once: its own TOKEN).
KERNEL = '''
import json, os, signal, subprocess, sys, threading, time, uuid
import torch
import psutil
import autograder, autograder.invoke, autograder.warm
from autograder import check, CheckFailed

TOKEN = uuid.uuid4().hex
MARKS = ("/tmp/left", "/dev/shm/left", "left", os.path.expanduser("~/left"))


def copy_params(params, device):
    leaks = [m for m in MARKS if os.path.exists(m) and open(m).read() != TOKEN]
    leaks += ["torch"] if getattr(torch, "left_by", TOKEN) != TOKEN else []
    leaks += ["environment"] if os.environ.get("LEFT_BY", TOKEN) != TOKEN else []
    leaks += [t.name for t in threading.enumerate()
              if t.name.startswith("left-by-") and t.name != "left-by-" + TOKEN]
    # what a worker must not reach or keep: its template's memory, a socket, a capability
    try:
        open(f"/proc/{os.getppid()}/mem", "r+b").close()
        leaks.append("its parent's memory")
    except OSError:
        pass
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                leaks.append(f"socket fd {fd}")
        except OSError:  # the listing's own descriptor, closed
            pass
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    if int(status["CapEff"], 16) or int(status["CapBnd"], 16) or status["Seccomp"].strip() != "2" \
            or status["NoNewPrivs"].strip() != "1":
        leaks.append("not confined")
    for m in MARKS:
        with open(m, "w") as f:
            f.write(TOKEN)
    torch.left_by = TOKEN
    os.environ["LEFT_BY"] = TOKEN
    threading.Thread(target=time.sleep, args=(1000,), name="left-by-" + TOKEN, daemon=True).start()
    subprocess.Popen(["sleep", "4343"], start_new_session=True)
    if leaks:
        raise RuntimeError(f"left by another check: {leaks}")
    return [p.detach().to(device).clone().requires_grad_(True) for p in params]


def templates():
    client = autograder.warm.clients()[-1]
    tree = psutil.Process(client.proc.pid).children(recursive=True)
    zygote = [p.pid for p in tree if p.cmdline()[1:3] == ["-m", "autograder.sandbox.zygote"]]
    return client.proc.pid, zygote[0] if zygote else None


def sleepers():
    return [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "4343"]]


class NoColdGrader:
    """autograder.invoke's subprocess, with no Popen: a grading can only be forked."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    def Popen(self, *args, **kwargs):
        raise AssertionError("a later check ran the cold grader")


def checked(label):
    start = time.monotonic()
    try:
        check("copy_params")
        verdict = "PASS"
    except CheckFailed as exc:
        verdict = f"FAIL {exc}"
    print(json.dumps({"label": label, "verdict": verdict, "seconds": time.monotonic() - start,
                      "sleepers": sleepers()}), flush=True)
'''


def kernel(tmp_path, offline_env, body: str, timeout: float = 300) -> tuple[list[dict], str]:
    """Run KERNEL + ``body`` in a fresh process; its JSON lines and its whole output."""
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL + textwrap.dedent(body))
    env = {**offline_env, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    env.pop("AUTOGRADER_WARM", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=timeout,
                          capture_output=True, text=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines, proc.stdout + proc.stderr


@needs_bwrap
def test_later_checks_are_forked_and_nothing_of_one_reaches_the_next(tmp_path, offline_env):
    lines, output = kernel(tmp_path, offline_env, '''
        checked("first")                      # cold grader start; the templates start meanwhile
        autograder.invoke.subprocess = NoColdGrader()  # from now on only forked gradings
        for label in ("second", "third", "fourth"):
            checked(label)
    ''')
    assert [line["verdict"] for line in lines] == ["PASS"] * 4, output[-3000:]
    assert all(not line["sleepers"] for line in lines), lines  # each check's child is gone
    assert "started cold" not in output and "restarted" not in output, output[-2000:]
    print("seconds per check:", [round(line["seconds"], 2) for line in lines])


@pytest.mark.slow
@pytest.mark.full
@needs_bwrap
def test_a_killed_or_stopped_template_is_replaced(tmp_path, offline_env):
    lines, output = kernel(tmp_path, offline_env, '''
        from autograder.sandbox.isolation import isolation_summary
        checked("first")
        grader, zygote = templates()
        os.kill(zygote, signal.SIGKILL)       # the sandbox's template killed
        checked("after the sandbox template was killed")
        checked("warm again")
        grader, new_zygote = templates()
        assert new_zygote not in (None, zygote), "the sandbox's template was not replaced"
        os.kill(new_zygote, signal.SIGSTOP)   # stopped: it would never answer
        checked("after the sandbox template was stopped")
        checked("warm again, twice")
        assert templates()[1] not in (None, new_zygote), "the stopped template was kept"
        os.kill(templates()[0], signal.SIGKILL)   # the grader's template killed
        checked("after the grader template was killed")
        checked("warm again, three times")
    ''')
    assert [line["verdict"] for line in lines] == ["PASS"] * 7, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("grader template ")]
    assert len(said) == 1, output[-3000:]  # the killed grader template, in one line
    assert "started again" in said[0] or "started cold" in said[0], said


@pytest.mark.slow
@pytest.mark.full
@needs_bwrap
def test_templates_die_with_their_kernel_and_their_idle_memory_is_bounded(tmp_path, offline_env):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL + textwrap.dedent('''
        checked("first")
        checked("second")
        grader, zygote = templates()
        tree = [psutil.Process(grader), *psutil.Process(grader).children(recursive=True)]
        pss = sum(p.memory_full_info().pss for p in tree)
        print(json.dumps({"templates": [p.pid for p in tree], "pss": pss}), flush=True)
        time.sleep(600)
    '''))
    env = {**offline_env, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        found = None
        while found is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the kernel ended early"
            if '"templates"' in line:
                found = json.loads(line)
    finally:
        proc.kill()  # as a killed kernel dies: no clean-up of its own
        proc.wait()
    assert found and len(found["templates"]) >= 2, found
    print(f"idle templates: {found['pss'] / 2**20:.0f} MiB (PSS) in {len(found['templates'])} processes")
    assert found["pss"] < 1.5 * 2**30, found
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in found["templates"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in found["templates"] if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"templates outlived their kernel: {alive}"
