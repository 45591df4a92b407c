"""The student's JupyterLab, seen in a real browser (headless Chromium driven by Selenium).

Why a browser: what a student meets (which menus the lab shows, whether Run All reaches the
check cells and their verdicts render) is decided by JupyterLab's front end, its extensions
and the configuration ``make lab`` passes; none of it shows in nbclient runs. The server is
started the way ``make lab`` starts it (``course.lab``'s environment and command), in a
temporary root holding a copy of the released A1 notebook, on a free port with a token.

Needs the distribution's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them
where it can; Selenium Manager's downloads are never used) and ``selenium`` (the ``dev``
extra); skipped with the reason otherwise. ``COURSE_CHROMIUM`` / ``COURSE_CHROMEDRIVER`` name
other binaries.

Tier: both: the lab's configuration per mode is quick; the real lab in headless Chromium is full
(a minute, and the browser from apt).
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

from course.lab import config_dir, lab_command, lab_environment

REPO = Path(__file__).resolve().parents[1]
A1 = Path("assignments/a1_data_parallel/data_parallel.ipynb")
SERVER_START_S, CHECKS_S = 60, 90


@pytest.mark.parametrize("mode", ["student", "instructor"])
def test_lab_mode_configuration(mode, monkeypatch, tmp_path):
    """Without a browser: what each mode's server would load, read by Jupyter's own loaders.

    The environment enables every nbgrader server extension (nbgrader's install does); the
    student's folder switches each of them and the front-end extension off, the instructor's
    none; both turn the news off. The user's own folders stay on the path, after the course's.
    """
    from jupyter_server.serverapp import ServerApp
    from jupyterlab_server.config import get_page_config

    theirs = os.environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep)
    users = [str(tmp_path), *filter(None, theirs)]
    env = lab_environment(mode, {"JUPYTER_CONFIG_PATH": os.pathsep.join(users)})
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(config_dir(mode)), *users]
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", env["JUPYTER_CONFIG_PATH"])
    app = ServerApp()
    app.load_config_file()
    app.find_server_extensions()
    nbgrader = {k: v for k, v in app.jpserver_extensions.items() if k.startswith("nbgrader.")}
    assert "nbgrader.server_extensions.formgrader" in nbgrader, app.jpserver_extensions
    assert set(nbgrader.values()) == {mode == "instructor"}, nbgrader
    assert app.config.LabApp.news_url is None
    disabled = get_page_config([])["disabledExtensions"]
    assert "@jupyterlab/apputils-extension:announcements" in disabled
    assert ("@jupyter/nbgrader" in disabled) == (mode == "student"), disabled


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


def start_lab(mode: str, root: Path, home: Path) -> tuple[subprocess.Popen, str, str]:
    """JupyterLab in ``mode`` on ``root``; returns the process, its base URL and token.

    The user's own Jupyter configuration, runtime files and workspaces are kept out
    (JUPYTER_CONFIG_DIR, JUPYTER_RUNTIME_DIR in ``home``): only the course's folder applies.
    The kernel imports this checkout's ``course`` and ``autograder`` (PYTHONPATH).
    """
    port, token = free_port(), secrets.token_hex(16)
    env = lab_environment(mode)
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               IPYTHONDIR=str(home / "ipython"), COURSE_OFFLINE="1", COURSE_DATA=str(home / "data"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
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


@pytest.fixture
def lab(tmp_path):
    """Start JupyterLab in a given mode on a temporary root with the A1 notebook."""
    root, home = tmp_path / "root", tmp_path / "home"
    (root / A1.parent).mkdir(parents=True)
    home.mkdir()
    shutil.copy(REPO / A1, root / A1)
    procs = []

    def start(mode: str) -> tuple[str, str]:
        proc, base, token = start_lab(mode, root, home)
        procs.append(proc)
        return base, token

    yield start
    for proc in procs:
        stop_lab(proc)


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium with a fresh profile, nothing fetched in the background."""
    chromium, driver_path = find_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


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


@pytest.mark.slow
@pytest.mark.full
def test_student_runs_a1_and_sees_check_results_without_nbgrader(lab, browser, tmp_path):
    base, token = lab("student")
    started = time.monotonic()
    open_lab(browser, base, token, A1.as_posix())
    menus = menu_labels(browser)
    assert "Run" in menus and "Nbgrader" not in menus, menus
    assert http_status(f"{base}/formgrader?token={token}") == 404  # no formgrader server extension

    from selenium.webdriver.support.ui import WebDriverWait

    # Run All before the kernel is up runs nothing (JupyterLab 4.6): wait, as a student sees it,
    # for "Python 3 (workshop) | Idle" in the status bar.
    WebDriverWait(browser, SERVER_START_S).until(
        lambda d: any('check("copy_params")' in s for s, _ in cells(d))
        and "| Idle" in d.find_element("css selector", "#jp-main-statusbar").get_attribute("textContent"))
    click_menu(browser, "Run", "Run All Cells")  # as a student does

    def first_check(d):
        found = [out for src, out in cells(d) if 'check("copy_params")' in src]
        return found and "CheckFailed" in found[0] and found[0]

    try:
        output = WebDriverWait(browser, CHECKS_S, poll_frequency=1).until(first_check)
    finally:
        browser.execute_script(
            "const o = document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output');"
            "if (o.length) o[o.length - 1].scrollIntoView({block: 'center'});")
        browser.save_screenshot(str(tmp_path / "student_lab_a1.png"))
    # The stub raises NotImplementedError: every check of copy_params fails, for that reason
    # (not because the grader could not run), and Run All stops there.
    assert "FAIL" in output and "copy_params" in output, output[-2000:]
    assert "NotImplementedError" in output and "PASS" not in output, output[-2000:]
    assert "autograder/" not in output and "Traceback" not in output, output[-2000:]  # no grader frames
    body = browser.find_element("tag name", "body").get_attribute("textContent")
    assert "Jupyter news" not in body  # the announcements pop-up is off
    assert "Create Assignment" not in body  # nbgrader's side panel
    assert "Nbgrader" not in menu_labels(browser)
    assert (tmp_path / "student_lab_a1.png").stat().st_size > 10_000
    print(f"A1 opened and first check shown after {time.monotonic() - started:.1f} s; "
          f"screenshot {tmp_path / 'student_lab_a1.png'}")


@pytest.mark.slow
@pytest.mark.full
def test_instructor_lab_keeps_nbgrader(lab, browser, tmp_path):
    """The contrast to the student's lab: the same notebook with nbgrader's menu and panels."""
    from selenium.webdriver.support.ui import WebDriverWait

    base, token = lab("instructor")
    open_lab(browser, base, token, A1.as_posix())
    WebDriverWait(browser, 30).until(lambda d: "Nbgrader" in menu_labels(d)
                                     and any('check("copy_params")' in s for s, _ in cells(d)))
    browser.save_screenshot(str(tmp_path / "instructor_lab.png"))
    body = browser.find_element("tag name", "body").get_attribute("textContent")
    assert "Create Assignment" in body and "Jupyter news" not in body
    assert http_status(f"{base}/formgrader?token={token}") == 200
