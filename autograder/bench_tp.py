"""The old name of ``python -m autograder.bench tp`` (lesson 13 still gives it): the same
benchmark, :mod:`autograder.bench.tp`."""
import sys

from autograder.bench.tp import main

if __name__ == "__main__":
    sys.exit(main())
