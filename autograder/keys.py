"""The instructor's answer keys: where they live, how the grader loads them, what it says without.

Public checks travel with the course; answer keys do not (otter-grader's public and hidden tests,
nbgrader's hidden tests). An assignment's key is ``solutions/<assignment>/answer_key.py``, beside
its reference notebook: reference implementations of the functions students write, hidden cases
and their expected values. Everything that keeps ``solutions/`` from students keeps the key from
them too: the student edition and the lab image leave ``solutions/`` out, the sandbox hides it
from graded code behind an empty mount, nbgrader does not release it (``CourseDirectory.ignore``
in nbgrader_config.py).

A check that needs the key says so in its spec (``Check(..., hidden=True)``). Where the key is
absent (the student edition, a student's ``check()``), such a check is SKIPPED with
:data:`RESERVED` as its reason and its points are reported as "checked when your instructor
grades", never as earned or lost. A key is only ever imported by the grader's own process, never
in the sandbox.

A leaf module beside :mod:`autograder.registry`: it imports nothing else of the grader.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from .registry import REPO

#: The key's file name inside ``solutions/<assignment>/``.
KEY_FILE = "answer_key.py"

#: A hidden check's SKIP reason where the key is absent; reports count these points apart.
RESERVED = ("checked when your instructor grades (hidden cases and the answer key are not in "
            "the student edition); no points were earned or lost here")


def key_path(assignment: str) -> Path:
    return REPO / "solutions" / assignment / KEY_FILE


#: ``AUTOGRADER_ANSWER_KEY=absent`` grades as the student edition does, with the key on disk:
#: hidden checks SKIP as reserved (to see what a student sees; the tests use it).
WITHOUT_KEY_ENV = "AUTOGRADER_ANSWER_KEY"


def has_key(assignment: str) -> bool:
    if os.environ.get(WITHOUT_KEY_ENV, "").lower() == "absent":
        return False
    return key_path(assignment).is_file()


def answer_key(assignment: str) -> ModuleType | None:
    """The key module of ``assignment``, or None where this copy of the course has none. Loaded
    once per process, as ``autograder_answer_keys.<assignment>``."""
    name = f"autograder_answer_keys.{assignment}"
    if name in sys.modules:
        return sys.modules[name]
    if not has_key(assignment):
        return None
    path = key_path(assignment)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def is_reserved(result: dict | object) -> bool:
    """A result that is a hidden check skipped for want of the key."""
    status = result["status"] if isinstance(result, dict) else getattr(result, "status")
    message = result["message"] if isinstance(result, dict) else getattr(result, "message")
    return status == "skipped" and (message or "").startswith(RESERVED[:40])


def reserved_points(results) -> float:
    return sum((r["max_points"] if isinstance(r, dict) else r.max_points)
               for r in results if is_reserved(r))
