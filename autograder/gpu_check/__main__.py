"""``python -m autograder.gpu_check``: see :mod:`autograder.gpu_check.cli`. Nothing but the call
below runs here: ranks that import the main module again must not start another check."""
import sys

from autograder.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
