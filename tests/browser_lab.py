"""What the browser tests share (tests/test_browser.py): JupyterLab started as ``make lab``
starts it, headless Chromium, and reading and clicking JupyterLab's and Formgrader's pages.

Needs the distribution's ``chromium`` and ``chromium-driver`` and ``selenium`` (the ``dev``
extra); :func:`find_browser` skips with the reason otherwise.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from course.lab import lab_command, lab_environment

REPO = Path(__file__).resolve().parents[1]
SERVER_START_S = 60


def find_browser() -> tuple[str, str]:
    """Paths of Chromium and chromedriver, or skip with what is missing and how to get it."""
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    chromium = os.environ.get("COURSE_CHROMIUM") or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = os.environ.get("COURSE_CHROMEDRIVER") or shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path]
    if missing:
        pytest.skip(f"no {' and no '.join(missing)} on PATH: install the packages chromium and "
                    "chromium-driver (apt-get), or set COURSE_CHROMIUM / COURSE_CHROMEDRIVER")
    return chromium, driver


def free_port() -> int:
    """A port nothing listens on now (the server is told not to retry another one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def start_lab(mode: str, root: Path, home: Path,
              extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
    """JupyterLab in ``mode`` on ``root`` (also its working directory, as ``make lab`` has it),
    with ``extra_env``; returns the process, its base URL and token.

    The user's own Jupyter configuration, runtime files and workspaces are kept out
    (JUPYTER_CONFIG_DIR, JUPYTER_RUNTIME_DIR in ``home``): only the course's folder applies.
    The kernel imports this checkout's ``course`` and ``autograder`` (PYTHONPATH).
    """
    port, token = free_port(), secrets.token_hex(16)
    env = lab_environment(mode)
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               IPYTHONDIR=str(home / "ipython"), COURSE_OFFLINE="1", COURSE_DATA=str(home / "data"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update(extra_env or {})
    args = ["--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")
    log = open(home / f"{mode}-lab.log", "wb")
    proc = subprocess.Popen(lab_command(args), env=env, cwd=root, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n"
                        + (home / f"{mode}-lab.log").read_text(errors="replace")[-3000:])
        try:
            if http_status(f"{base}/api/status?token={token}") == 200:
                return proc, base, token
        except OSError:
            pass
        time.sleep(0.5)
    stop_lab(proc)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s")


def stop_lab(proc: subprocess.Popen) -> None:
    """Stop the server, its kernels and their grader processes (one session, ours)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # twice: no confirmation prompt
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of this session only
    except (ProcessLookupError, PermissionError):
        pass


def chromium(profile: Path):
    """Headless Chromium with a fresh profile in ``profile``, nothing fetched in the background."""
    chromium, driver_path = find_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    return driver


# ------------------------------------------------------------------------------- JupyterLab

def menu_labels(driver) -> list[str]:
    """The labels of JupyterLab's main menu bar (File, Edit, ..., Help)."""
    return [e.get_attribute("textContent").strip()
            for e in driver.find_elements("css selector", "#jp-MainMenu .lm-MenuBar-itemLabel")]


def open_lab(driver, base: str, token: str, path: str = "") -> None:
    """Open ``path`` in JupyterLab (a fresh workspace) and wait for its menu bar."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base}/lab{'/tree/' + path if path else ''}?token={token}&reset")
    WebDriverWait(driver, SERVER_START_S).until(lambda d: "Help" in menu_labels(d))


def click_menu(driver, menu: str, item: str) -> None:
    """Open the main menu ``menu`` and click its entry labelled ``item``."""
    from selenium.webdriver.support.ui import WebDriverWait

    next(e for e in driver.find_elements("css selector", "#jp-MainMenu .lm-MenuBar-item")
         if e.get_attribute("textContent").strip() == menu).click()

    def entry(d):
        return next((e for e in d.find_elements("css selector", ".lm-Menu li.lm-Menu-item")
                     if e.get_attribute("textContent").strip().startswith(item)
                     and "lm-mod-disabled" not in e.get_attribute("class")), None)

    WebDriverWait(driver, 10).until(entry).click()


def cells(driver) -> list[tuple[str, str]]:
    """(source, output text) of every cell of the open notebook, in order."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell'))
          .map(c => [(c.querySelector('.jp-InputArea-editor') || {}).textContent || '',
                     (c.querySelector('.jp-OutputArea') || {}).textContent || '']);""")


# ------------------------------------------------------------------------------- Formgrader

def wait(driver, condition, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(condition)


def page_text(driver) -> str:
    return driver.find_element("tag name", "body").get_attribute("innerText")


#: Formgrader's tables are redrawn (Backbone) whenever a model changes: rows are found and
#: clicked in one script, never kept between calls.
IN_ROW = """
const [name, selector, click] = arguments;
for (const row of document.querySelectorAll('table tbody tr')) {
  const names = row.querySelectorAll('td.name, td.student-id');
  if (![...names].some(c => c.innerText.trim() === name)) continue;
  const target = selector ? row.querySelector(selector) : row;
  if (!target) return null;
  if (click) { target.click(); return true; }
  return target.innerText;
}
return null;"""
#: The text of Formgrader's Success or Error window, once shown (and its id), else null.
MODAL = """
const m = [...document.querySelectorAll('#success-modal, #error-modal')]
  .find(m => m.classList.contains('in'));
return m ? [m.id, m.innerText] : null;"""


def row_text(driver, name: str, selector: str = "") -> str | None:
    """The text of ``name``'s row in the page's table (of its ``selector`` cell), or None."""
    return driver.execute_script(IN_ROW, name, selector, False)


def click_action(driver, name: str, action: str, timeout: float = 30) -> str:
    """Click the ``action`` link (a column's class: assign, release, collect, autograde,
    generate-feedback, release-feedback, num-submissions) in ``name``'s row; wait for
    Formgrader's answer (its Success or Error window), close it and return what it said."""
    wait(driver, lambda d: d.execute_script(IN_ROW, name, f"td.{action} a", True))
    if action == "num-submissions":
        return ""
    modal_id, said = wait(driver, lambda d: d.execute_script(MODAL), timeout)
    driver.execute_script("$('#' + arguments[0]).modal('hide')", modal_id)
    wait(driver, lambda d: not d.execute_script(MODAL))
    assert modal_id == "success-modal", said
    return said
