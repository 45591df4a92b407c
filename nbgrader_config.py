"""nbgrader configuration for the instructor: sources in solutions/, releases in assignments/.

``nbgrader generate_assignment a1_data_parallel`` turns solutions/a1_data_parallel/ into the
student notebook in assignments/a1_data_parallel/ (commit it: tests/test_release_in_sync.py
fails when it is out of date).
"""
c = get_config()  # noqa: F821 - provided by nbgrader

c.CourseDirectory.course_id = "scale-pytorch"
c.CourseDirectory.root = "."
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "assignments"
c.CourseDirectory.db_assignments = [{"name": "a1_data_parallel"}]

# Students see "raise NotImplementedError()" in their answer cells.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Autograding executes whole notebooks; the experiments run in their quick mode.
c.Execute.timeout = 300
c.Execute.interrupt_on_timeout = True
