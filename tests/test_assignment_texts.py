"""What the released assignment texts must (not) say: they cite lessons that exist, they do not
hand out an answer another part asks for, and their code runs on every operating system.

Tier: quick: reads the released texts, in seconds.
"""
from __future__ import annotations

import re

import nbformat
import pytest

from conftest import REPO

RELEASES = sorted((REPO / "assignments").glob("*/*.ipynb"))
LESSONS = REPO / "course" / "lessons"


def text_of(path) -> str:
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)


@pytest.mark.parametrize("path", RELEASES, ids=lambda p: p.parent.name)
def test_cited_lessons_exist(path):
    cited = set(re.findall(r"\b(\d\d[a-z]?_[a-z0-9_]+)\.ipynb", text_of(path)))
    missing = sorted(name for name in cited if not (LESSONS / f"{name}.ipynb").exists())
    assert not missing, f"{path.name} cites lessons that do not exist: {missing}"


def test_a2_cites_both_halves_of_lesson_04():
    text = text_of(REPO / "assignments" / "a2_ddp" / "ddp.ipynb")
    assert "04a_processes_and_launchers.ipynb" in text and "04b_ddp_training.ipynb" in text


def test_a3_points_to_lessons_05_06_07():
    first = nbformat.read(REPO / "assignments" / "a3_model_pipeline" / "model_pipeline.ipynb",
                          as_version=4).cells[0].source
    for lesson in ("05_collectives", "06_model_parallel", "07_pipeline_parallel"):
        assert lesson in first, lesson


@pytest.mark.parametrize("path", RELEASES, ids=lambda p: p.parent.name)
def test_no_release_states_the_bubble_formula_that_a3_part5_asks_for(path):
    flat = re.sub(r"[\s$*]", "", text_of(path))
    for formula in ("(p-1)/(m+p-1)", "m/(m+p-1)", "(m+p-1)/(pm)", "(m+p-1)/(p*m)",
                    "2m/(m+1)", "2*m/(m+1)", r"\frac{p-1}{m+p-1}"):
        assert formula.replace("*", "") not in flat, (path.name, formula)


@pytest.mark.parametrize("path", RELEASES, ids=lambda p: p.parent.name)
def test_sched_getaffinity_is_guarded(path):
    """os.sched_getaffinity exists on Linux only: every cell that calls it checks first."""
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code" and "sched_getaffinity(" in cell.source:
            assert 'hasattr(os, "sched_getaffinity")' in cell.source or \
                "except AttributeError" in cell.source, (path.name, cell.source[:200])


def test_a2_ring_states_the_rule_for_empty_chunks():
    text = text_of(REPO / "assignments" / "a2_ddp" / "ddp.ipynb")
    assert "Empty chunks" in text and "neither sent nor received" in text


def test_a1_allreduce_states_its_inputs():
    cells = nbformat.read(REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb",
                          as_version=4).cells
    part2 = next(c.source for c in cells if c.source.startswith("## Part 2: `allreduce"))
    for rule in ("at least one dimension", "float32, float64 or int64", "in place"):
        assert rule in part2, rule


def test_a5_points_to_lessons_05_and_13():
    first = nbformat.read(REPO / "assignments" / "a5_tensor_parallel" / "tensor_parallel.ipynb",
                          as_version=4).cells[0].source
    for lesson in ("05_collectives", "13_tensor_parallel"):
        assert lesson in first, lesson
