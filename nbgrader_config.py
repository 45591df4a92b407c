"""nbgrader configuration for the instructor: sources in solutions/, releases in assignments/.

``nbgrader generate_assignment a1_data_parallel`` turns solutions/a1_data_parallel/ into the
student notebook in assignments/a1_data_parallel/ (commit it: tests/test_release_in_sync.py
fails when it is out of date).
"""
import os

c = get_config()  # noqa: F821 - provided by nbgrader

c.CourseDirectory.course_id = "scale-pytorch"
# "." (the folder nbgrader runs in, where it finds this file), made absolute: nbgrader warns
# on every command about a relative root
c.CourseDirectory.root = os.getcwd()
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "assignments"
# The answer keys (solutions/<assignment>/answer_key.py, autograder/keys.py) stay with the
# instructor: generate_assignment copies every other file of a source folder into the release.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback",
                            "answer_key.py"]
# No list of assignments: generate_assignment adds each one to the gradebook the first time
# (nbgrader's GenerateAssignment.create_assignment, on by default); nbgrader 0.9 has no
# CourseDirectory.db_assignments.

# The exchange (release_assignment, fetch_assignment, submit, collect, release_feedback): a
# folder every user of the machine can write. nbgrader's default is
# /usr/local/share/nbgrader/exchange; COURSE_EXCHANGE names another. Students' nbgrader must use
# the same folder: their own nbgrader_config.py (or /etc/jupyter/nbgrader_config.py for a whole
# JupyterHub) says c.Exchange.root = "<folder>" (docs/instructor.md, "Releasing to students").
if os.environ.get("COURSE_EXCHANGE"):
    c.Exchange.root = os.path.abspath(os.environ["COURSE_EXCHANGE"])

# nbgrader 0.9 on SQLAlchemy 2 warns "SAWarning: Object of type <SubmittedAssignment> not in
# session, add operation along 'Student.submissions' will not proceed" (or <SubmittedNotebook>,
# <Grade>, <Comment>) once per new object of every autograde: it builds each object with its
# parent set, and SQLAlchemy 2 no longer adds such an object to the session through the parent
# (the removed cascade_backrefs); nbgrader then adds the whole submission (api.py,
# Gradebook.add_submission: db.add(submission)), so nothing is lost (tests/test_instructor_flow.py
# and tests/test_browser.py read the scores it stores). Only that message is silenced.
import warnings  # noqa: E402

from sqlalchemy.exc import SAWarning  # noqa: E402

warnings.filterwarnings("ignore", message=r"Object of type <\w+> not in session",
                        category=SAWarning)

# Students see "raise NotImplementedError()" in their answer cells.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Autograding executes whole notebooks (the experiments run in their quick mode), then the
# test cells' verdicts are replaced by an isolated grading run: nothing a student's cells do
# in the kernel (redefining check, patching modules) can change them. See
# autograder/nbgrader_plugin.py.
from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, Execute,  # noqa: E402
                                    IgnorePattern, LimitOutput, SaveAutoGrades)

from autograder.integrations.nbgrader_plugin import DeferChecks, GradeInSandbox  # noqa: E402

c.Autograde.autograde_preprocessors = [
    DeferChecks, Execute, GradeInSandbox, IgnorePattern, ClearMetadataPreprocessor,
    LimitOutput, SaveAutoGrades, AssignLatePenalties, CheckCellMetadata,
]
c.Execute.timeout = 300
c.Execute.interrupt_on_timeout = True
