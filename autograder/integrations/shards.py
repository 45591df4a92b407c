"""``--shard K/N``: the K-th of N disjoint slices of a class, for grading on N machines.

A student's slice comes from a hash of the student id alone, so it never changes when other
submissions are added or removed later (a resumed or repeated shard grades the same students),
and all notebooks of one student land in the same slice.
"""
from __future__ import annotations

import hashlib


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with 1 <= K <= N; ValueError with the reason otherwise."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N, e.g. 1/4") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text!r}: K must be between 1 and N")
    return k, n


def shard_of(student: str, n: int) -> int:
    """The slice (1..n) of ``student``."""
    digest = hashlib.sha256(student.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % n + 1


def select(subs: list, k: int, n: int) -> list:
    """The ``(student, ...)`` entries of slice ``k`` of ``n``, in their order."""
    return [s for s in subs if shard_of(s[0], n) == k]
