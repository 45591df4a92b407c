"""One check module per assignment; each is a pytest file run by :func:`autograder.harness.run_checks`."""
