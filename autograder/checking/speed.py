"""Speed checks: measured, never assumed, and never failing correct code.

Every figure is a ratio of times that the grader measures itself (wall-clock round trips into
the sandbox, with the device synchronized inside each timed call), so student code cannot fake
it. The reference solution is measured in a sandbox of its own, started from the reference's
cells alone (:func:`reference_sandbox`): no student code ever ran in its processes, so nothing a
submission patches can slow it or break it. A trusted baseline (``dist.all_reduce``, a
one-process step) is timed there too (:func:`against_trusted_baseline`), never beside student
code, which could slow it to inflate its own speedup.

:func:`judge_rounds` compares the two from *rounds*: each round times the student's code and the
reference's once, back to back, in alternating order, so a machine that gets busier or quieter
meanwhile moves both alike, and each round gives one paired sample. The student passes while
the median of their speedup over the reference's is at least :data:`FRACTION_OF_REFERENCE`;
it fails only when a sign test says, at 1% error, that it is below that fraction, after more
rounds where the first ones cannot tell. The same code measured against itself therefore
passes. A reference that does not reach its own bar in the same run makes the check a SKIP with
that reason: the hardware cannot show the speedup, which is no fault of the student's.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

from .capacity import FREE_FRACTION, Capacity

#: The student passes at this fraction of the reference solution's speedup.
FRACTION_OF_REFERENCE = 0.8
#: A failure needs this much evidence (one-sided sign test).
SIGNIFICANCE = 0.01


def timed_calls(call, probe, *args, warmup: int = 1, repeats: int = 5) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``probe`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call(probe, *args)
    return [timed(call, probe, *args) for _ in range(repeats)]


def timed(call, probe, *args) -> float:
    """Seconds of one call, measured here."""
    start = time.perf_counter()
    call(probe, *args)
    return time.perf_counter() - start


def usable_cores() -> int:
    """CPU cores this process may run on (what its ranks share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def median(times: list[float]) -> float:
    return statistics.median(times)


@contextlib.contextmanager
def reference_sandbox(assignment: str, timeout: float = 120.0):
    """A ``call(probe, *args)`` into a fresh sandbox holding only the reference solution, or
    None in the student edition. Its processes never see student code."""
    from functools import partial

    from ..sandbox import Sandbox
    from .reference import reference_cells

    cells = reference_cells(assignment)
    if cells is None:
        yield None
        return
    from .spec import load_spec

    with Sandbox(cells=cells, rank_modules=load_spec(assignment).rank_modules) as box:
        box.start()
        yield partial(box.call, timeout=timeout)


def in_turn(i: int, measure, student_call, reference_call) -> tuple[float, float | None]:
    """One round: ``measure(call)`` for the student's sandbox and the reference's (if any),
    the student first in even rounds and second in odd ones."""
    calls = [("student", student_call), ("reference", reference_call)]
    got = {name: measure(call) for name, call in (calls if i % 2 == 0 else calls[::-1])
           if call is not None}
    return got["student"], got.get("reference")


def against_trusted_baseline(i: int, baseline, part, student_call, reference_call
                             ) -> tuple[float, float | None]:
    """One round of a speedup whose baseline is trusted code (``dist.all_reduce``, a
    one-process step): the baseline is timed in the reference's sandbox only, where no student
    code ran, so a submission cannot slow it to inflate its own speedup. Returns (baseline /
    the student's ``part``, baseline / the reference's ``part``); without a reference (the
    student edition's self-check) the baseline is timed beside the student's code."""
    if reference_call is None:
        return baseline(student_call) / part(student_call), None
    calls = [("student", student_call), ("reference", reference_call)]
    base = baseline(reference_call)
    got = {name: part(call) for name, call in (calls if i % 2 == 0 else calls[::-1])}
    return base / got["student"], base / got["reference"]


def _sign_test_below(ratios: list[float], bar: float) -> float:
    """P(at most this many of the ratios reach ``bar``) if each reached it with probability
    1/2: small when they are clearly below it."""
    n, k = len(ratios), sum(r >= bar for r in ratios)
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def judge_rounds(one_round, *, what: str, fixed_threshold: float, reference_minimum: float,
                 has_reference: bool, processes: int | None = None, min_rounds: int = 3,
                 max_rounds: int = 15) -> None:
    """Pass, fail (AssertionError) or skip a speedup from paired rounds.

    ``one_round(i)`` returns ``(student speedup, reference speedup or None)`` from one round
    (it alternates who goes first by ``i``). With the reference, the student needs
    :data:`FRACTION_OF_REFERENCE` of it, and the reference needs ``reference_minimum`` (else
    SKIP); without it (the student edition), the student needs ``fixed_threshold``, judged
    only where the machine gives the ``processes`` CPU processes timed their cores (each round
    also measures :class:`~.capacity.Capacity`; below :data:`~.capacity.FREE_FRACTION` of them,
    SKIP). ``processes`` is None for checks timed on GPUs.
    ``min_rounds`` is few on purpose: a pass needs only the median, and a failure needs at least
    seven rounds whatever it is (a sign test at 1% cannot reject on fewer).
    """
    capacity = Capacity(processes) if processes and not has_reference else None
    with capacity or contextlib.nullcontext():
        mine, ref, free = _rounds(one_round, capacity, fixed_threshold, reference_minimum,
                                  has_reference, min_rounds, max_rounds)
    _verdict(mine, ref, free, capacity, what, fixed_threshold, reference_minimum, has_reference)


def _ratios(mine, ref, fixed_threshold, has_reference) -> list[float]:
    """Each round's speedup over the bar it is judged against: the reference's, or the fixed
    threshold without one."""
    return ([a / b for a, b in zip(mine, ref)] if has_reference
            else [a / fixed_threshold for a in mine])


def _rounds(one_round, capacity, fixed_threshold, reference_minimum, has_reference,
            min_rounds, max_rounds) -> tuple[list[float], list[float], list[float]]:
    """Take rounds until they can tell (see :func:`judge_rounds`): the student's speedups, the
    reference's, and the machine's capacity in each round (where it is measured)."""
    mine, ref, free = [], [], []
    while True:
        s, r = one_round(len(mine))
        mine.append(s)
        if has_reference:
            ref.append(r)
        if capacity is not None:
            free.append(capacity.measure())
        if len(mine) < min_rounds:
            continue
        ratios = _ratios(mine, ref, fixed_threshold, has_reference)
        bar = FRACTION_OF_REFERENCE if has_reference else 1.0
        if len(mine) >= max_rounds:
            break
        if (has_reference and median(ref) < reference_minimum) or \
                (free and not capacity.enough(median(free))):
            if len(mine) >= 2 * min_rounds:  # a second look, then SKIP: the hardware cannot
                break                        # show the speedup in this run
            continue
        if median(ratios) >= bar or _sign_test_below(ratios, bar) < SIGNIFICANCE:
            break
    return mine, ref, free


def _verdict(mine, ref, free, capacity, what, fixed_threshold, reference_minimum,
             has_reference) -> None:
    """Pass (print), fail (AssertionError) or SKIP the rounds :func:`_rounds` took."""
    from .harness import skip_unless

    ratios = _ratios(mine, ref, fixed_threshold, has_reference)
    rounds = f"median of {len(mine)} interleaved rounds"
    if has_reference:
        skip_unless(median(ref) >= reference_minimum,
                    f"{what}: the timed code is correct (your speedup {median(mine):.2f}x), but "
                    f"even the reference solution reached only {median(ref):.2f}x on this "
                    f"machine in this run ({rounds}; it needs {reference_minimum:.2f}x to show a "
                    "speedup here), so the hardware cannot judge one: not graded here")
        need = FRACTION_OF_REFERENCE * median(ref)
        p = _sign_test_below(ratios, FRACTION_OF_REFERENCE)
        assert median(ratios) >= FRACTION_OF_REFERENCE or p >= SIGNIFICANCE, (
            f"{what}: your speedup is {median(mine):.2f}x; the reference solution reached "
            f"{median(ref):.2f}x in this same run ({rounds}), and {FRACTION_OF_REFERENCE:.0%} "
            f"of it ({need:.2f}x) is needed; yours stayed below it in {len(mine) - sum(r >= FRACTION_OF_REFERENCE for r in ratios)} "
            f"of {len(mine)} rounds")
        print(f"{what}: {median(mine):.2f}x (reference {median(ref):.2f}x; {rounds})")
    else:
        if capacity is not None:
            skip_unless(capacity.enough(median(free)), (
                f"{what}: the timed code is correct (your speedup {median(mine):.2f}x), but "
                f"this machine gave the {capacity.processes} timed processes only "
                f"{median(free):.2f} cores' worth of CPU ({rounds}, measured by the grader; "
                f"{FREE_FRACTION * capacity.processes:.1f} are needed: other programs are "
                "using the cores). This student edition has no reference solution to compare "
                "with on a busy machine, so the speedup is not judged here; run the check "
                "again with the machine otherwise idle"))
        p = _sign_test_below(ratios, 1.0)
        assert median(mine) >= fixed_threshold or p >= SIGNIFICANCE, (
            f"{what}: your speedup is {median(mine):.2f}x ({rounds}); this student edition has "
            f"no reference solution, so it asks for a fixed {fixed_threshold:.2f}x (your "
            "instructor's grade compares with the reference on the grading machine and may "
            "differ)")
        print(f"{what}: {median(mine):.2f}x (needed {fixed_threshold:.2f}x; {rounds})")


class CountingCalls:
    """A ``call(probe, *args)`` into a sandbox that counts the commands it sent to ranks that
    stay up (:func:`~.ranks.probe_server_run` calls that returned): ``sent(key, command)``.

    Why: the speed checks time round trips into the sandbox, whose Python the submission
    controls; a cell can replace a probe with one that returns at once. A timed run counts only
    if its ranks did all the work the grader asked for: each check compares what the ranks
    report they did (steps run, commands completed) with this count, which is the grader's own,
    and fails "the timed run did N ... where the grader asked for M" otherwise."""

    def __init__(self, call):
        self._call = call
        self._sent: dict[tuple[str, str], int] = {}

    def __call__(self, probe, *args):
        from .ranks import probe_server_run

        result = self._call(probe, *args)
        if probe is probe_server_run:
            key, command, *count = args
            n = count[0] if count else 1
            self._sent[key, command] = self._sent.get((key, command), 0) + n
        return result

    def sent(self, key: str, command: str) -> int:
        """How many ``command`` s the ranks of ``key`` were asked to run (in calls that
        returned)."""
        return self._sent.get((key, command), 0)


def check_work_done(done, sent: int, what: str, unit: str = "steps") -> None:
    """The ranks of a timed run report ``done`` (one count per rank) where the grader sent
    ``sent``: every timed call must have done its work."""
    assert isinstance(done, list) and done and all(type(d) is int for d in done), \
        f"{what}: the ranks' reply was tampered with"
    for rank, d in enumerate(done):
        assert d == sent, (
            f"{what}: the timed run did {d} {unit} where the grader asked for {sent}"
            + (f" (rank {rank})" if len(done) > 1 else "")
            + ": a timed call returned without doing its work")


def timed_rounds(student, assignment: str, servers, one_round, verify, *, reference_only=(),
                 **judging) -> None:
    """Start ``servers`` ([(key, function, setup, world size, args, backend, warm-up
    commands)]: :class:`~.ranks.RankServer` s) in the student's sandbox and in a reference
    sandbox; judge ``one_round(i, student_call, reference_call)`` in interleaved rounds
    (:func:`judge_rounds`, with ``judging``); then stop the student's and ``verify(results,
    sent)`` what their ranks returned (``results``: {key: ranks' results}) and did (``sent``:
    the :meth:`CountingCalls.sent` of the calls into the student's sandbox, to compare with the
    work the ranks report), even when the speed is not judged here (a SKIP is raised only after
    that: a timed run that did less than it was asked fails). ``reference_only``: keys of
    servers that run the baseline (:func:`against_trusted_baseline`): started in the reference's
    sandbox alone where there is one, so ``verify`` gets no results for them; in the student
    edition, in the student's."""
    import pytest

    from .ranks import probe_server_run, probe_server_start, probe_server_stop
    from .spec import load_spec

    spec = load_spec(assignment)
    student_call = CountingCalls(student.call)
    with reference_sandbox(assignment) as reference:
        mine = [s for s in servers if reference is None or s[0] not in reference_only]
        sides = ((student_call, mine), (reference, servers))
        for call, started in sides:
            for key, function, setup, world_size, args, backend, warmup in started:
                if call is None:  # the student edition: no reference to compare with
                    break
                f = spec.function(function)
                call(probe_server_start, key, f, setup, world_size, args, backend)
                for command in warmup:
                    call(probe_server_run, key, command)
        skipped = None
        try:
            judge_rounds(lambda i: one_round(i, student_call, reference),
                         has_reference=reference is not None, **judging)
        except pytest.skip.Exception as exc:  # the reference cannot show it: still verify
            skipped = exc
        verify({key: student.call(probe_server_stop, key) for key, *_ in mine}, student_call.sent)
    if skipped is not None:
        raise skipped
