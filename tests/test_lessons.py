"""Every lesson notebook runs top to bottom in quick mode on CPU (nbclient, offline, tiny data), has
the parts every lesson must have, and hands out no assignment's answer.

Tier: quick: every lesson in quick mode, and the lessons' static promises.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
LESSONS = sorted((REPO / "course" / "lessons").glob("*.ipynb"))
#: What Python and torch leave in the temporary folder by themselves, not the lesson's doing:
#: multiprocessing's folder (removed at a clean exit, which a kernel's shutdown may not give it),
#: torchrun's log folder and torch.compile's cache (kept on purpose).
TORCH_LEFTOVERS = ("pymp-", "torchelastic_", "torchinductor_")


def _run_quick(path: Path, offline_env: dict, monkeypatch, tmp_path: Path) -> str:
    """Run the lesson top to bottom in quick mode; fail on any error, or on files it left in the
    temporary folder (a student runs a lesson many times); return its printed text."""
    for key in ("COURSE_DATA", "COURSE_OFFLINE", "COURSE_FULL", "MPLBACKEND", "PATH"):
        monkeypatch.setenv(key, offline_env[key])
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the kernel's, and so its processes' tempfile
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith(TORCH_LEFTOVERS))
    assert not left, f"the lesson left these in the temporary folder: {left}"
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


@pytest.mark.slow
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs_in_quick_mode(path, offline_env, monkeypatch, tmp_path):
    _run_quick(path, offline_env, monkeypatch, tmp_path)


@pytest.mark.slow
def test_lesson_10_runs_where_cpu_bf16_does_not(offline_env, monkeypatch, tmp_path):
    """Lesson 10's fp16 path, the one it takes on a CPU whose bf16 products crash, forced with
    COURSE_DISABLE_CPU_BF16=1 on the CPU (no GPU visible: with CUDA the lesson uses bf16)."""
    monkeypatch.setenv("COURSE_DISABLE_CPU_BF16", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    text = _run_quick(REPO / "course" / "lessons" / "10_memory.ipynb", offline_env, monkeypatch,
                      tmp_path)
    assert "the 16-bit cells below use fp16 instead" in text
    assert "autocast torch.float16" in text and "autocast torch.bfloat16" not in text


def _markdown(path: Path) -> str:
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")


def _numbered_items(text: str) -> int:
    return len(re.findall(r"^\d+\. ", text, flags=re.MULTILINE))


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_has_goals_time_exercises_and_reading(path):
    """Every lesson opens with learning goals and a time estimate, and ends with 2-4 exercises
    (answered in docs/instructor-answers.md) and further reading; it is committed without outputs."""
    text = _markdown(path)
    assert "**Learning goals.**" in text and "**Time:**" in text
    assert "## Exercises" in text and "## Further reading" in text
    exercises = text.split("## Exercises", 1)[1].split("## Further reading", 1)[0]
    count = _numbered_items(exercises)
    assert 2 <= count <= 4, count
    reading = text.split("## Further reading", 1)[1]
    assert reading.count("\n- ") >= 2
    answers = (REPO / "docs" / "instructor-answers.md").read_text()
    number = path.stem.split("_", 1)[0]
    section = re.search(rf"^## {number} .*?(?=^## |\Z)", answers, flags=re.MULTILINE | re.DOTALL)
    assert section, f"no answers for lesson {number}"
    assert _numbered_items(section.group(0)) == count
    nb = nbformat.read(path, as_version=4)
    assert not [c for c in nb.cells if c.cell_type == "code" and c.get("outputs")]


def test_no_lesson_states_the_bubble_formula_that_a3_asks_for():
    """Assignment 3 has students measure the bubble on their own schedules (Part 5) and find
    its closed form from those measurements (Part 8): no lesson may state it."""
    for path in LESSONS:
        flat = re.sub(r"[\s$]", "", "\n".join(c.source for c in nbformat.read(path, as_version=4).cells))
        for formula in ("(p-1)/(m+p-1)", r"\frac{p-1}{m+p-1}", "m/(m+p-1)", r"\frac{m}{m+p-1}"):
            assert formula not in flat, (path.name, formula)


def test_no_lesson_writes_a4s_functions():
    """Assignment 4 asks for these: the module 4 lessons use PyTorch's own tools instead."""
    names = ("assign_buckets", "BucketedDDP", "shard_bounds", "ShardedOptimizer", "ShardedLinear",
             "model_state_bytes", "comm_bytes_per_step", "apply_fsdp")
    for path in LESSONS:
        code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        for name in names:
            assert not re.search(rf"^\s*(def|class)\s+{name}\b", code, flags=re.MULTILINE), (path.name, name)


def test_no_lesson_writes_a8s_functions_or_formulas():
    """Assignment 8 asks for these functions, with its own stated formulas (float32 everywhere, its
    activation count, FLOP count and bandwidth-by-group rule): lesson 16 and `course.planning` model
    memory and time the published way (mixed precision, Korthikanti's bytes, 6N FLOPs) and search
    no configurations; no lesson defines A8's functions or states its formulas."""
    names = ("per_rank_memory", "step_time", "best_config", "train_3d")
    fragments = ("12sh/tp", "(a/tp)s", "24mbsh", "min(pp-i", "size*stride")
    sources = [(path.name, "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)) for path in LESSONS]
    for module in ("planning.py", "planning_moe.py"):
        sources.append((f"course/{module}", (REPO / "course" / module).read_text()))
    for name, source in sources:
        for function in names:
            assert not re.search(rf"^\s*(def|class)\s+{function}\b", source, flags=re.MULTILINE), (name, function)
        flat = re.sub(r"[\s$*\u00b7`]", "", source)
        for fragment in fragments:
            assert re.sub(r"[\s$*\u00b7`]", "", fragment) not in flat, (name, fragment)


def test_no_lesson_wraps_blocks_the_way_a4_part_7_asks():
    """A4 Part 7 asks for FSDP2 per block with a mixed-precision policy, the last block kept
    unsharded after forward and HSDP on a 2-D mesh: lesson 11 teaches these APIs on one unit at
    the root, never inside a loop over blocks (which would be Part 7's answer)."""
    for path in LESSONS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            for loop in re.finditer(r"^(\s*)for (.*):\n((?:\1\s+.*\n?)+)", cell.source,
                                    flags=re.MULTILINE):
                header, body = loop.group(2), loop.group(3)
                over_blocks = re.search(r"children|modules|blocks|layers|\bmodel\b", header)
                if over_blocks and "fully_shard(" in body:
                    assert not re.search(r"mp_policy\s*=|reshard_after_forward\s*=", body), (path.name, body)
