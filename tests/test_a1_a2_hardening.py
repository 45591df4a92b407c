"""Issue 39 for A1 and A2: the grader holds against a determined student.

(a) No text of ``solutions/`` reaches a sandbox that runs student code: ``train_batch`` and
``train_ddp`` are graded with the student's own helpers. A grading's student sandboxes record
everything sent to them (the cells they load, pickled objects, every probe's arguments), and a
submission that searches its process (frames, globals, code objects, every function alive) and
sends what it finds back in its error message finds nothing of the reference.
(b) The ring's ban on collectives holds on every process group: a ring that makes a group of its
own and all-reduces on it (through the group, or through its backend, which no Python hook sees)
loses the ring's points, and the message names what was seen.
(c) A speedup is measured against the reference's one-process (one-GPU) run, never only the
student's own: a one-process run padded with sleeps earns nothing.

Tier: the counting and the rounds' arithmetic are quick; A1's grading of train_batch is quick
(about 15 s); the gradings of A2 are full.
"""
from __future__ import annotations

import nbformat
import pytest

from conftest import REPO, grade, points_by_function
from sandbox_records import MARKERS, leaks, record_gradings, solution_lines

A1_SOURCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
A1_RELEASE = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
A2_SOURCE = REPO / "solutions" / "a2_ddp" / "ddp.ipynb"
A2_RELEASE = REPO / "assignments" / "a2_ddp" / "ddp.ipynb"


def with_answer(notebook, tmp_path, name: str, **answers: str):
    """``notebook`` with the answer cells ``answers`` (grade_id -> source) replaced."""
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.cell_type == "code" and gid in answers:
            cell.source = answers.pop(gid)
    assert not answers, f"no such answer cells: {list(answers)}"
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


# ---------------------------------------------------------------- (a) no reference in a sandbox

#: Code a submission runs to find what its process holds and send it back in an error: the
#: strings in every frame's locals and globals (into lists, tuples, dicts and bytes), the file
#: names and constants of every function not compiled from its own cells, and of the classes
#: and functions those can reach. Its own text is marked EXFIL and left out.
EXFIL = '''
def _exfiltrate():  # EXFIL
    import gc, sys, types
    found, seen = [], set()

    def take(v, depth=0):
        if id(v) in seen or depth > 4:
            return
        seen.add(id(v))
        if isinstance(v, str):
            if "EXFIL" not in v:
                found.append(v)
        elif isinstance(v, bytes):
            take(v.decode("utf-8", "replace"), depth)
        elif isinstance(v, (list, tuple, set, frozenset)):
            for x in v:
                take(x, depth + 1)
        elif isinstance(v, dict):
            for x in list(v.values()):
                take(x, depth + 1)
        elif isinstance(v, types.CodeType):
            found.append(v.co_filename)
            take(v.co_consts, depth + 1)
        elif isinstance(v, types.FunctionType) and not v.__code__.co_filename.startswith("<cell"):
            take(v.__code__, depth + 1)
            take([x for x in v.__globals__.values() if isinstance(x, (type, types.FunctionType))],
                 depth + 1)
        elif isinstance(v, type) and v.__module__ not in ("builtins",):
            take(v.__doc__, depth + 1)
            take([x for x in vars(v).values() if isinstance(x, types.FunctionType)], depth + 1)

    frame = sys._getframe(1)
    while frame is not None:
        take(frame.f_locals)
        frame = frame.f_back
    take(globals())
    take([f for f in gc.get_objects() if isinstance(f, types.FunctionType)
          and not f.__code__.co_filename.startswith(("<cell", "/", "<frozen", "<string"))])
    worth = [s for s in found if "<reference" in s or ("def " in s and "\\n" in s)
             or re.search(r"[a-z]+ [a-z]+ [a-z]+", s)]
    worth.sort(key=lambda s: ("<reference" not in s, "def " not in s))
    raise RuntimeError("EXFIL " + " | ".join(worth)[:1400])
'''


def exfiltrating(release, tmp_path, function: str, params: str):
    """The released stubs, but ``function`` searches its process (:data:`EXFIL`)."""
    source = f"import re\n{EXFIL}\n\ndef {function}({params}):  # EXFIL\n    _exfiltrate()\n"
    return with_answer(release, tmp_path, f"exfil_{function}", **{function: source})


def _graded_without_leaks(jobs, assignment, env, tmp_path) -> dict:
    jobs = {job: [*spec, assignment] for job, spec in jobs.items()}
    got = record_gradings(jobs, env, tmp_path)
    lines = solution_lines([assignment], keys=False)
    assert len(lines) > 15, len(lines)  # the reference's answers were read
    found = leaks(got, lines, report_markers=MARKERS[:1])
    assert not found, f"{len(found)} piece(s) of solutions/ reached a student sandbox: {found[:5]}"
    return got["reports"]


@pytest.mark.slow
def test_a1_grades_train_batch_without_any_reference_text(offline_env, tmp_path):
    """The reference graded on train_batch passes with nothing of solutions/ sent to its
    sandbox; a train_batch that searches its process for the reference finds nothing of it
    (before: the reference's split_batch and allreduce cells were a probe's argument)."""
    jobs = {"reference": (str(A1_SOURCE), "train_batch", "skip"),
            "exfil": (str(exfiltrating(A1_RELEASE, tmp_path, "train_batch",
                                       "X, y, device_params, devices, lr")),
                      "train_batch", "skip")}
    reports = _graded_without_leaks(jobs, "a1_data_parallel", offline_env, tmp_path)
    ref = reports["reference"]
    assert ref["code"] == 0 and all(r["status"] != "failed" for r in ref["results"]), ref
    assert points_by_function(ref)["train_batch"] == 4, ref["results"]
    exfil = [r for r in reports["exfil"]["results"] if r["function"] == "train_batch"]
    assert exfil and all("EXFIL" in r["message"] for r in exfil), exfil  # it searched


@pytest.mark.full
@pytest.mark.slow
def test_a2_grades_train_ddp_without_any_reference_text(offline_env, tmp_path):
    """The same for train_ddp, its weak scaling measured (the timed ranks are started by a
    probe too): nothing of solutions/ in the student's sandbox, nor in the ranks it starts."""
    jobs = {"reference": (str(A2_SOURCE), "train_ddp", "measure"),
            "exfil": (str(exfiltrating(A2_RELEASE, tmp_path, "train_ddp",
                                       "rank, world_size, model_fn, dataset, epochs, "
                                       "batch_size, lr, seed")), "train_ddp", "skip")}
    reports = _graded_without_leaks(jobs, "a2_ddp", offline_env, tmp_path)
    ref = reports["reference"]
    assert ref["code"] == 0 and all(r["status"] != "failed" for r in ref["results"]), ref
    exfil = [r for r in reports["exfil"]["results"] if r["status"] == "failed"]
    assert exfil and all("EXFIL" in r["message"] for r in exfil), exfil  # it searched


# ---------------------------------------------------------------- (b) collectives on any group

def _attacks(tensor):
    """A "ring" for 2 ranks whose kind depends on the tensor's size: 1 element, the all-reduce
    of a process group of its own; 2, the same through the group's backend (no Python hook sees
    it); 3, ``dist.all_reduce`` kept where the grader's wrappers do not look, on its own group;
    4, the group's all-reduce after taking every pre-hook off every group; 5, an honest exchange
    with point-to-point calls (nothing to see)."""
    import torch
    import torch.distributed as dist

    import course.collectives as watched

    kind = tensor.numel()
    group = dist.new_group([0, 1])
    if kind == 1:
        group.allreduce([tensor]).wait()
    elif kind == 2:
        group._get_backend(tensor.device).allreduce([tensor]).wait()
    elif kind == 3:
        _HIDDEN["all_reduce"](tensor, group=group)
    elif kind == 4:
        last = watched._hook_ids.__reduce__()[1][0]
        for g in list(dist.distributed_c10d._world.pg_map) + [group]:
            for hook in range(1_500_000, last):
                g.unregister_pre_hook(hook)
        group.allreduce([tensor]).wait()
    else:
        other, peer = torch.empty_like(tensor), 1 - dist.get_rank()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor.clone(), peer),
                                            dist.P2POp(dist.irecv, other, peer)]):
            work.wait()
        tensor += other


def _hidden():
    """dist.all_reduce as this module found it when a rank imported it (to unpickle
    ``_attacks``), before the grader's wrappers were put in place, kept in a dict."""
    import torch.distributed as dist

    return {"all_reduce": dist.all_reduce}


_HIDDEN = _hidden()


@pytest.mark.slow
def test_the_ring_check_sees_collectives_on_groups_a_ring_makes():
    """What A2's ranks count around a ring (rank_ring, the ring checks' code): every kind of
    collective on a group of the ring's own is seen, by the pre-hook each group gets or, where
    the ring gets past those, by torch's flight recorder (recorded in C++); point-to-point
    calls are not collectives. Before, only the default group was watched: none was seen."""
    import torch

    from autograder.assignments.a2_ddp.ranks import rank_ring
    from course.launch import launch

    cases = [((n,), torch.float32) for n in (1, 2, 3, 4, 5)]
    seen = [[case["collectives"] for case in r["cases"]] for r in
            launch(rank_ring, 2, _attacks, 0, cases, backend="gloo", quiet=True, timeout=120)]
    for rank in seen:
        used = [", ".join(k for k, v in counts.items() if v) for counts in rank]
        assert "ALLREDUCE on another process group" in used[0], used
        assert "flight recorder" in used[1] and "gloo:all_reduce" in used[1], used
        assert "ALLREDUCE on another process group" in used[2], used
        assert "flight recorder" in used[3], used
        assert used[4] == "", used


RING_ATTACK = """\
def ring_allreduce(tensor):
    world = dist.get_world_size()
    if world == 1:
        return None
    group = dist.new_group(list(range(world)))
    if world == 2:  # the group's own all-reduce
        group.allreduce([tensor]).wait()
    else:           # its backend's
        group._get_backend(tensor.device).allreduce([tensor]).wait()
    return None
"""


@pytest.mark.full
@pytest.mark.slow
def test_a_ring_that_all_reduces_on_its_own_group_loses_every_ring_point(offline_env, tmp_path):
    report = grade(with_answer(A2_SOURCE, tmp_path, "ring_attack", ring_allreduce=RING_ATTACK),
                   "--only", "ring_allreduce", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    results = {r["name"]: r for r in report["results"]}
    assert len(results) == 3 and all(r["status"] == "failed" for r in results.values()), results
    assert points_by_function(report)["ring_allreduce"] == 0, results
    two = results["ring_allreduce_two_processes"]["message"]
    assert "called collective operations" in two and "ALLREDUCE on another process group" in two
    more = results["ring_allreduce_one_three_four_processes_awkward_sizes"]["message"]
    assert "gloo:all_reduce" in more and "flight recorder" in more, more
    assert results["ring_allreduce_bandwidth"]["message"] == two


# ---------------------------------------------------------------- (c) speedups, trusted baselines

def _fake_calls(monkeypatch, module, name, seconds_of, wrap=lambda s: s):
    """Replace ``module.name`` (the timing function) by one that returns each call's seconds
    from ``seconds_of(call, what)``, ``what`` being the server key or the GPU count (through
    ``wrap``: a list of one for timed_calls)."""
    def fake(call, probe, *args, **kwargs):
        return wrap(seconds_of(call, args[0]))
    monkeypatch.setattr(module, name, fake)


def test_a2_weak_scaling_is_timed_against_the_reference_alone(monkeypatch):
    """A student whose one-process run sleeps 10 s and whose two-process run takes 2 s (twice
    the reference's 1 s alone, 1.4 s on two) has a speedup of 2 x 1 / 2 = 1x, not 10x."""
    from autograder.assignments.a2_ddp import checks

    times = {"student": {"train1": 10.0, "train2": 2.0},
             "reference": {"train1": 1.0, "train2": 1.4}}
    _fake_calls(monkeypatch, checks, "timed", lambda call, key: times[call][key])
    for i in (0, 1):
        mine, ref = checks.weak_scaling(i, "student", "reference")
        assert mine == pytest.approx(1.0) and ref == pytest.approx(2 / 1.4)
    # the student edition (no reference): its own one-process run, a self-check only
    assert checks.weak_scaling(0, "student", None) == (pytest.approx(10.0), None)


def test_a1_speedup_is_timed_against_the_reference_alone(monkeypatch):
    from autograder.assignments.a1_data_parallel import checks

    times = {"student": {1: 10.0, 2: 2.0}, "reference": {1: 1.0, 2: 0.7}}
    _fake_calls(monkeypatch, checks, "timed_calls", lambda call, gpus: times[call][gpus],
                lambda s: [s])
    for i in (0, 1):
        mine, ref = checks.speedup_round(i, "student", "reference")
        assert mine == pytest.approx(0.5) and ref == pytest.approx(1 / 0.7)
    assert checks.speedup_round(0, "student", None) == (pytest.approx(5.0), None)


#: The reference's train_ddp, slowed: each call sleeps three times as long as it trained on 2
#: processes (a quarter of the reference's speed: far enough below 80% of it that no noise of a
#: busy machine lifts the median of the rounds there; at half speed, 2 runs in 4 of a loaded
#: full tier passed) and nine times as long on 1, where a speedup measured against the
#: student's own one-process run would see 2.5 times the reference's.
PADDED = """\
    spent = time.perf_counter() - start
    time.sleep(spent * (9 if world_size == 1 else 3))
    return [p.detach().cpu() for p in model.parameters()]
"""


@pytest.mark.full
@pytest.mark.slow
def test_a_padded_one_process_run_earns_no_weak_scaling(offline_env, tmp_path):
    """Where this machine shows weak scaling the check fails (the student's two processes are
    a quarter as fast as the reference's); where it cannot, it is skipped: never a pass."""
    nb = nbformat.read(A2_SOURCE, as_version=4)
    body = next(c.source for c in nb.cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == "train_ddp")
    begin, old = "### BEGIN SOLUTION\n", "    return [p.detach().cpu() for p in model.parameters()]\n"
    assert begin in body and old in body
    body = body.replace(begin, begin + "    start = time.perf_counter()\n")
    path = with_answer(A2_SOURCE, tmp_path, "padded", train_ddp=body.replace(old, PADDED))
    report = grade(path, "--only", "train_ddp", env=offline_env)
    assert report["returncode"] == 0, report["stdout"] + report["stderr"]
    print(report["stdout"])
    results = {r["name"]: r for r in report["results"]}
    assert results["train_ddp_two_processes_match_one"]["status"] == "passed", results
    scaling = results["train_ddp_weak_scaling_two_processes"]
    assert scaling["status"] in ("failed", "skipped") and scaling["points"] == 0, scaling
    assert scaling["message"], scaling
