"""Assignment 9's grader, without a grading: Part 3's text states the grader's global batch and
tolerance, public_cases.json is the key's, the malformed traces are malformed and the random
ones cover every kind (the waits deciding some), and the planted faults recorded on gloo give
the diagnoses the grader expects. (Gradings of A9: tests/test_grader_a9.py.)

Tier: both: the texts and cases are quick; the recording on gloo is full.
"""
from __future__ import annotations

import json

import pytest

from conftest import REPO

from autograder.assignments.a9_resilience import expected as E
from autograder.assignments.a9_resilience import faults
from autograder.assignments.a9_resilience.spec import SPEC
from autograder.keys import answer_key

RELEASE = REPO / "assignments" / "a9_resilience" / "resilience.ipynb"


def key():
    k = answer_key(SPEC.assignment)
    assert k is not None, "solutions/a9_resilience/answer_key.py is missing"
    return k


def test_part_3_text_states_the_graders_global_batch_and_tolerance():
    """The ``global_batch`` that Part 3's text gives in full is the grader's (copied by a
    student, it reads what the sample check expects), and the text's ulps are the check's."""
    import re

    import nbformat
    import torch

    (text,) = [c.source for c in nbformat.read(RELEASE, as_version=4).cells
               if c.cell_type == "markdown" and c.source.startswith("## Part 3")]
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    ns = {"torch": torch}
    exec(code, ns)
    for seed in (0, 1, 286972012):
        for n, batch in ((24, 6), (12, 4), (10, 10)):
            for step in range(3 * n // batch + 1):
                assert ns["global_batch"](seed, step, n, batch) == E.global_batch(
                    seed, step, n, batch), (seed, n, batch, step)
    checks = (REPO / "autograder" / "assignments" / "a9_resilience" / "checks.py").read_text()
    (ulps,) = re.findall(r"^ULPS = (\d+)$", checks, re.M)
    assert f"within {ulps} ulps of max(1, |value|)" in " ".join(text.split())
    assert "noise_rng = torch.Generator().manual_seed(seed)" in text


def test_public_cases_json_is_the_keys():
    """public_cases.json is what the key's public_cases() gives (write it again with ``python
    solutions/a9_resilience/answer_key.py``), and covers every kind, None, the tie rules and the
    text's example (lesson 17's hang), whose divergence on the default group waits on the
    pair's."""
    K = key()
    assert json.loads(E.PUBLIC_CASES_PATH.read_text()) == K.public_cases() == E.public_cases()
    assert E.PUBLIC_CASES_PATH.read_text() == K.public_cases_text()
    cases = {c["what"].split(":")[0]: c for c in E.public_cases()["diagnose"]}
    expected = [c["expected"] for c in cases.values()]
    assert None in expected
    assert {e["kind"] for e in expected if e} == set(E.KINDS)
    hang = cases["lesson 17's hang"]
    assert hang["expected"] == {"group": "2", "seq": 2, "kind": "missing", "ranks": [3]}
    firsts, _ = K.group_divergences(hang["traces"])
    assert firsts["0"] == {"group": "0", "seq": 2, "kind": "missing", "ranks": [2, 3]}


def test_malformed_traces_raise_and_random_traces_cover_every_kind():
    import random

    K = key()
    for why, traces in E.BAD_TRACES:
        with pytest.raises(ValueError):
            K.diagnose(traces)
    kinds = {(d or {}).get("kind") for s in range(3)
             for d in map(K.diagnose, K.hidden_traces(random.Random(s)))}
    assert kinds >= {None, "missing", "op", "shape", "dtype"}, kinds
    # and the waits decide some of them: not the smallest of every group's divergence
    for s in range(3):
        decided = 0
        for traces in K.hidden_traces(random.Random(s)):
            firsts, members = K.group_divergences(traces)
            smallest = min(firsts.values(), default=None, key=lambda d: (
                d["seq"], members[d["group"]], d["group"], d["ranks"]))
            decided += K.diagnose(traces) != smallest
        assert decided >= 2, (s, decided)


@pytest.mark.full
@pytest.mark.slow
def test_planted_faults_recorded_on_gloo_give_the_expected_diagnoses():
    """The grader's own recording (4 gloo processes, ~3 s): each planted fault's traces are
    diagnosed as the grader expects by the answer key, and the fault is really in the trace
    (the clean runs have none); two groups of the same ranks are two groups."""
    recorded = faults.recorded()
    for name, what, want in faults.SCENARIOS:
        assert key().diagnose(recorded[name]) == faults.expected(want, recorded[name]), (
            name, recorded[name])
    twins = {(e["group"], tuple(e["members"])) for e in recorded["twins"][0]}
    assert len([g for g, members in twins if members == (0, 1)]) == 2, twins
    assert all(len(recorded[name]) == faults.WORLD for name, _, _ in faults.SCENARIOS)
