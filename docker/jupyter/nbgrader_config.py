"""nbgrader's configuration for students in the course image (copied to /etc/jupyter/).

Students use one nbgrader tool here: *Validate* (run the notebook and report failing cells).
The instructor's tools (Formgrader, Create Assignment, Course List) and the exchange's
Assignment List are turned off by docker/jupyter_student.sh; instructors grade with the
repository's own nbgrader_config.py (docs/instructor.md). This file exists so that nbgrader
finds a configuration instead of warning "No nbgrader_config.py file found" in the lab's log.
"""
c = get_config()  # noqa: F821 - provided by traitlets when nbgrader loads this file

c.CourseDirectory.course_id = "scale-pytorch"
