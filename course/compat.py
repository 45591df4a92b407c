"""What the course uses from newer torch, on the older releases it supports (2.11 to 2.15).

The lessons and assignments are written against torch 2.14 (the pinned default). Two kinds of
difference are bridged, each in one place:

- names: ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` (new in 2.13) are
  aliases of ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with the same signatures;
  :func:`install` adds them where they are missing. Every rank that ``course.launch`` starts
  and the grader's sandbox call it; a script of your own can too.
- watching collectives (``ProcessGroup.register_pre_hook``, new in 2.14, renamed ops in 2.15):
  :mod:`course.collectives`.

A lesson cell that needs a newer release than the one running says so and skips itself
(:func:`needs`).
"""
from __future__ import annotations

#: new name -> the older function it aliases (same signature and behaviour)
ALIASES = {"all_gather_single": "all_gather_into_tensor",
           "reduce_scatter_single": "reduce_scatter_tensor"}


def install() -> None:
    """Add the newer names to ``torch.distributed`` where this release lacks them."""
    import torch.distributed as dist

    for new, old in ALIASES.items():
        if not hasattr(dist, new) and hasattr(dist, old):
            setattr(dist, new, getattr(dist, old))


def torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def needs(major: int, minor: int, what: str) -> bool:
    """True when this torch is at least ``major.minor``; else print that ``what`` needs it
    (the cell then skips that part) and return False."""
    if torch_version() >= (major, minor):
        return True
    import torch

    print(f"skipped: {what} needs torch >= {major}.{minor}; this is torch {torch.__version__}")
    return False
