"""The course's JupyterLab, seen in a real browser (headless Chromium driven by Selenium).

Why a browser: what a student or an instructor meets (which menus the lab shows, whether Run
All reaches the check cells and their verdicts render, whether Formgrader's buttons do what
they say) is decided by JupyterLab's and Formgrader's front ends, their extensions and the
configuration ``make lab`` passes; none of it shows in nbclient runs. Servers are started the
way ``make lab`` and ``make lab-instructor`` start them (``course.lab``'s environment and
command; tests/browser_lab.py), in a temporary root, on a free port with a token.

- The student's lab: A1 opened, Run All, the first check's verdict shown; no nbgrader.
- The instructor's daily loop in Formgrader (docs/instructor.md, sections 3-6), read from what
  the pages show, not from HTTP codes: the lab has nbgrader's menu; Formgrader lists A1-A10; A1
  is generated and released into an exchange of the test's own (``make exchange
  COURSE_EXCHANGE=...``, the documented way); a student (another user where the test can make
  one, their own folder, nbgrader's own commands, the exchange in their
  ``nbgrader_config.py`` as the docs say) fetches it, answers it and submits; the instructor
  collects, autogrades, opens the submission in Manual Grading and sees each check's line,
  generates and releases feedback; the student fetches it. The student's notebook is the
  release with the reference's answers and the demo cells left out (nbgrader neither grades
  nor checks them), and nothing is timed (``AUTOGRADER_SPEED=skip``): grading itself is tested
  in tests/test_instructor_flow.py and tests/test_grader_a1.py.

Needs the distribution's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them
where it can; Selenium Manager's downloads are never used) and ``selenium`` (the ``dev``
extra); skipped with the reason otherwise. ``COURSE_CHROMIUM`` / ``COURSE_CHROMEDRIVER`` name
other binaries.

Tier: both: the lab's configuration per mode is quick; the real labs in headless Chromium are
full (about a minute each on 2 cores, and the browser from apt).
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from browser_lab import (SERVER_START_S, cells, chromium, click_action, click_menu, find_browser,
                         http_status, menu_labels, open_lab, page_text, row_text, start_lab,
                         stop_lab, wait)
from conftest import REPO, paste_reference_answers
from course.lab import config_dir, lab_environment

A1 = Path("assignments/a1_data_parallel/data_parallel.ipynb")
CHECKS_S = 90


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
    """Headless Chromium with a fresh profile (skipped without Chromium, with the reason)."""
    find_browser()
    driver = chromium(tmp_path / "chromium-profile")
    yield driver
    driver.quit()


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


# ------------------------------------------------------- the instructor's loop in Formgrader

ASSIGNMENT, NOTEBOOK = A1.parent.name, A1.name
AUTOGRADE_S = 300
#: The student is another user where the test can make one (as root: nobody, through setpriv),
#: else the user running the tests: nbgrader names a submission by the OS user who submitted it.
AS_STUDENT = (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
              if os.geteuid() == 0 and shutil.which("setpriv") else [])
STUDENT = pwd.getpwuid(65534 if AS_STUDENT else os.geteuid()).pw_name


def nbgrader(cwd: Path, env: dict, *args: str, student: bool = False) -> str:
    command = [*(AS_STUDENT if student else []), str(Path(sys.executable).parent / "nbgrader"), *args]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def student_answers(release: Path) -> nbformat.NotebookNode:
    """The release with the reference's code answers and a written answer, demo cells left out."""
    nb = nbformat.read(release, as_version=4)
    assert paste_reference_answers(nb, REPO / "solutions" / ASSIGNMENT / NOTEBOOK) > 0
    kept = []
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "markdown" and meta.get("solution"):
            cell.source = "Each step moved gradients between the devices, which cost more than it saved."
        if cell.cell_type != "code" or any(meta.get(k) for k in ("grade", "solution", "locked")):
            kept.append(cell)
    nb.cells = kept
    return nb


@pytest.fixture
def course(tmp_path, tiny_data):
    """An instructor's course directory (config and sources of A1-A10), an empty exchange
    (``make exchange COURSE_EXCHANGE=...``), and a student's own folder and nbgrader
    configuration naming the same exchange. The exchange and the student's folder lie in a
    folder the student can reach (pytest's are the runner's alone)."""
    shared = Path(tempfile.mkdtemp(prefix="formgrader-"))
    shared.chmod(0o755)
    course, exchange, student = tmp_path / "course", shared / "exchange", shared / "student"
    course.mkdir()
    subprocess.run(["make", "-s", "-C", str(REPO), "exchange", f"COURSE_EXCHANGE={exchange}"],
                   check=True, capture_output=True, timeout=60)  # docs/instructor.md's way
    assert exchange.is_dir() and exchange.stat().st_mode & 0o777 == 0o777
    shutil.copy(REPO / "nbgrader_config.py", course)
    shutil.copytree(REPO / "solutions", course / "solutions",
                    ignore=shutil.ignore_patterns(".*", "__pycache__"))
    (student / "config").mkdir(parents=True)
    (student / "config" / "nbgrader_config.py").write_text(
        "c = get_config()  # noqa: F821\n"
        f"c.Exchange.root = {str(exchange)!r}\n"
        "c.CourseDirectory.course_id = 'scale-pytorch'\n")
    env = {"COURSE_EXCHANGE": str(exchange), "COURSE_DATA": str(tiny_data),
           "AUTOGRADER_SPEED": "skip",
           "AUTOGRADER_CALIBRATION": str(tiny_data / "no-calibration.json")}
    if AS_STUDENT:
        shutil.chown(student, "nobody", 65534)
        shutil.chown(student / "config", "nobody", 65534)
    student_env = {**os.environ, "HOME": str(student), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   "JUPYTER_CONFIG_DIR": str(student / "config"),
                   "PYTHONWARNINGS": "ignore"}
    yield course, exchange, student, env, student_env
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.full
def test_formgrader_release_collect_autograde_feedback(course, browser, tmp_path):
    course, exchange, student, env, student_env = course
    (tmp_path / "home").mkdir()
    proc, base, token = start_lab("instructor", course, tmp_path / "home", env)
    try:
        started = time.monotonic()
        open_lab(browser, base, token)
        assert "Nbgrader" in menu_labels(browser)
        wait(browser, lambda d: "Create Assignment" in page_text(d))  # nbgrader's side panel

        # Manage Assignments: every assignment of solutions/, ASSIGNMENT a draft
        browser.get(f"{base}/formgrader?token={token}")
        names = [f"a{i}_" for i in range(1, 11)]
        wait(browser, lambda d: all(n in page_text(d) for n in names), 60)
        assert "draft" in wait(browser, lambda d: row_text(d, ASSIGNMENT, "td.status"))

        said = click_action(browser, ASSIGNMENT, "assign", 120)  # Generate
        assert f"Successfully created the student version of '{ASSIGNMENT}'" in said, said
        said = click_action(browser, ASSIGNMENT, "release")
        assert f"Successfully released '{ASSIGNMENT}'" in said, said
        wait(browser, lambda d: "released" in (row_text(d, ASSIGNMENT, "td.status") or ""))
        assert (exchange / "scale-pytorch" / "outbound" / ASSIGNMENT / NOTEBOOK).exists()

        # The student: fetch, answer, submit (nbgrader's commands, their own name and folder)
        nbgrader(student, student_env, "fetch_assignment", ASSIGNMENT, student=True)
        fetched = student / ASSIGNMENT / NOTEBOOK
        assert "BEGIN SOLUTION" not in fetched.read_text()
        nbformat.write(student_answers(fetched), fetched)
        nbgrader(student, student_env, "submit", ASSIGNMENT, student=True)

        # Collect, then Manage Submissions: autograde alice's submission
        browser.get(f"{base}/formgrader?token={token}")
        said = click_action(browser, ASSIGNMENT, "collect")
        assert "Successfully collected" in said, said
        assert (course / "submitted" / STUDENT / ASSIGNMENT / NOTEBOOK).exists(), said
        click_action(browser, ASSIGNMENT, "num-submissions")  # the count of submissions, 1
        wait(browser, lambda d: "needs autograding" in page_text(d))
        said = click_action(browser, STUDENT, "autograde", AUTOGRADE_S)
        assert f"Successfully autograded '{ASSIGNMENT}' for student '{STUDENT}'" in said, said
        wait(browser, lambda d: "needs manual grading" in (row_text(d, STUDENT) or ""))
        score = row_text(browser, STUDENT, "td.score")

        # Manual Grading: the submission shows each check's verdict and the points
        browser.get(f"{base}/formgrader/gradebook/{ASSIGNMENT}/{NOTEBOOK.removesuffix('.ipynb')}?token={token}")
        wait(browser, lambda d: d.find_elements("css selector", "td.name a"))
        browser.find_element("css selector", "td.name a").click()
        wait(browser, lambda d: "copy_params" in page_text(d) and "PASS" in page_text(d), 60)
        text = page_text(browser)
        browser.save_screenshot(str(tmp_path / "formgrader_submission.png"))
        for function in ("copy_params", "allreduce", "train_batch"):
            assert f"PASS  {function}" in text or f"PASS {function}" in text, text[:4000]
        assert "FAIL" not in text and "Traceback" not in text, text[:4000]
        assert "point(s) not given" in text  # the speed check, not timed, earns nothing

        # Feedback: generated from Formgrader, released into the exchange, fetched by the student
        browser.get(f"{base}/formgrader?token={token}")
        said = click_action(browser, ASSIGNMENT, "generate-feedback", 120)
        assert "Successfully generated feedback" in said, said
        said = click_action(browser, ASSIGNMENT, "release-feedback")
        assert "Successfully released feedback" in said, said
        nbgrader(student, student_env, "fetch_feedback", ASSIGNMENT, student=True)
        feedback = list((student / ASSIGNMENT / "feedback").glob(f"*/{NOTEBOOK.replace('.ipynb', '.html')}"))
        assert feedback, sorted(p.relative_to(student) for p in student.rglob("*"))
        html = feedback[0].read_text()
        assert "PASS" in html and "copy_params" in html and "BEGIN SOLUTION" not in html
        print(f"Formgrader loop done in {time.monotonic() - started:.0f} s; {STUDENT} scored {score}")
    finally:
        stop_lab(proc)
    log = (tmp_path / "home" / "instructor-lab.log").read_text(errors="replace")
    assert "SAWarning" not in log, log[-3000:]
    assert "alembic" not in log or "FileNotFoundError" not in log, log[-3000:]
