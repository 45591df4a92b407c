#!/usr/bin/env python3
"""Print the project's requirements from pyproject.toml, one per line.

pyproject.toml is the single source of the course's Python requirements. The Docker image
installs them through this script (in a layer of its own, so that editing the course does not
download PyTorch again), and nothing in docker/ keeps a list of its own
(tests/test_docker.py checks both).

    python docker/pyproject_requirements.py pyproject.toml [--only torch torchvision] [--extra dev]
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib


def requirement_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement string."""
    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: str, only: list[str] | None = None,
                 extras: list[str] | None = None) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in extras or []:
        reqs += project.get("optional-dependencies", {})[extra]
    if only:
        wanted = {requirement_name(n) for n in only}
        reqs = [r for r in reqs if requirement_name(r) in wanted]
        missing = wanted - {requirement_name(r) for r in reqs}
        if missing:
            raise SystemExit(f"{pyproject} does not require {', '.join(sorted(missing))}")
    return reqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pyproject")
    p.add_argument("--only", nargs="+", metavar="NAME", help="just these distributions")
    p.add_argument("--extra", action="append", default=[], help="add an optional group")
    args = p.parse_args(argv)
    print("\n".join(requirements(args.pyproject, args.only, args.extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
