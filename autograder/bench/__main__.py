"""``python -m autograder.bench``: the benchmarks' registry (see :mod:`autograder.bench`)."""
import sys

from autograder.bench import main

if __name__ == "__main__":
    sys.exit(main())
