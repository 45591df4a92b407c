"""``make gpu-check`` (``python -m autograder.gpu_check``): every GPU path of the course and the
grader, run on this machine, with a report (docs/gpu-check.md).

One module per concern: :mod:`.cli` (the command, its sections, the start-up checks),
:mod:`.lessons` (lessons in quick mode, which cells used CUDA), :mod:`.grading` (solutions and
stubs through the grader's CLI), :mod:`.distributed` (NCCL, torchrun, ``course.launch`` with
CUDA ranks, bandwidth) with :mod:`.ranks` (what those ranks run), and :mod:`.report`.

Kept out of the student edition (``autograder/integrations/edition.py``): it grades and executes
the reference solutions. This file imports nothing: the ranks import :mod:`.ranks` by name.
"""
