"""The course's sbatch scripts under a real Slurm: one node on this machine (tests/slurm_cluster.py).

tests/test_batch_grading.py and tests/test_ddp_scripts.py run the scripts with faked SLURM_*
variables; here Slurm itself schedules them. The grading array's two tasks run side by side
(one core each) and their shards merge to what one sequential grade-folder gives; the DDP job's
srun starts torchrun with 2 gloo processes, and its weights match one process trained on the
same data in the same order (the global batch is the same: 2 x 32 = 64).

Skipped, with the daemon's own reason, where the cluster cannot run: Slurm or munge not
installed (.ci/install-slurm installs them as root), or a daemon that refuses to start.

Tier: full (two real gradings of two A1 notebooks, two tiny trainings).
"""
from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slurm_cluster
from conftest import REPO
from course.launch import free_port

pytestmark = [pytest.mark.full, pytest.mark.slow]

SCRIPTS = REPO / "course" / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"
A1_REFERENCE = REPO / "solutions" / "a1_data_parallel" / "data_parallel.ipynb"
A1_STUB = REPO / "assignments" / "a1_data_parallel" / "data_parallel.ipynb"
GRADER_ARGS = ["--speed", "skip", "--seed", "1"]


@pytest.fixture(scope="module")
def cluster():
    try:
        running = slurm_cluster.start(cpus=2)
    except slurm_cluster.Unavailable as e:
        pytest.skip(f"no Slurm cluster on this machine: {e}")
    yield running
    left = running.stop()
    assert not left, f"processes outlived the cluster's daemons (killed now): {left}"


def finished(cluster, job: str, timeout: float, logs: list[Path]) -> list[dict]:
    """The job's tasks once done; each must have COMPLETED with exit code 0 (else its log)."""
    tasks = cluster.wait(job, timeout)
    bad = [t for t in tasks if t.get("JobState") != "COMPLETED" or t.get("ExitCode") != "0:0"]
    assert tasks and not bad, (bad or "no task", "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists()))
    return tasks


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    return proc


def test_grading_array_shards_merge_to_the_sequential_grades(cluster, offline_env, tmp_path):
    """sbatch --array=0-1: each task grades its shard (ann's reference in shard 1, cid's stub
    in shard 2), at the same time; merged by a job that depends on the array, the shards'
    grades.csv, checks.csv and gradebook.csv are those of one sequential run with the same
    seed."""
    from autograder.integrations.shards import shard_of

    subs = tmp_path / "subs"
    subs.mkdir()
    for student, notebook in (("ann", A1_REFERENCE), ("cid", A1_STUB)):
        (subs / f"{student}.ipynb").write_bytes(notebook.read_bytes())
    assert [shard_of(s, 2) for s in ("ann", "cid")] == [1, 2]
    env = {**offline_env, "PYTHON": sys.executable, "GRADE_JOBS": "1", "OMP_NUM_THREADS": "1"}
    job = cluster.sbatch("--array=0-1", "--cpus-per-task=1", "--gpus-per-task=0",
                         f"--output={tmp_path}/grade-%A_%a.out",
                         str(SCRIPTS / "slurm_grade.sbatch"), str(subs), str(tmp_path / "grades"),
                         *GRADER_ARGS, cwd=REPO, env=env)
    shard_dirs = [tmp_path / "grades" / f"shard-{k}-of-2" for k in (1, 2)]
    # the merge as docs/instructor.md submits it: a job that waits for the whole array
    merging = cluster.sbatch(f"--dependency=afterany:{job}", f"--output={tmp_path}/merge.out",
                             "--wrap", f"{sys.executable} -m autograder merge "
                             f"{' '.join(map(str, shard_dirs))} --out {tmp_path / 'merged'}",
                             cwd=REPO, env=env)
    [merged] = finished(cluster, merging, 300, [*sorted(tmp_path.glob("grade-*.out")),
                                                 tmp_path / "merge.out"])
    tasks = finished(cluster, job, 10, sorted(tmp_path.glob("grade-*.out")))
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1"]
    first, second = sorted(tasks, key=lambda t: t["ArrayTaskId"])
    # side by side: each task started before the other ended (one core each of the two)
    assert first["StartTime"] <= second["EndTime"] and second["StartTime"] <= first["EndTime"]
    assert merged["StartTime"] >= max(first["EndTime"], second["EndTime"])
    for k, shard in enumerate(shard_dirs, 1):
        with open(shard / "grades.csv") as f:
            assert [r["student"] for r in csv.DictReader(f)] == [["ann", "cid"][k - 1]]
    run([sys.executable, "-m", "autograder", "grade-folder", str(subs), str(tmp_path / "seq"),
         "--jobs", "1", *GRADER_ARGS], env, 300)
    for name in ("grades.csv", "checks.csv", "gradebook.csv"):
        assert (tmp_path / "merged" / name).read_text() == (tmp_path / "seq" / name).read_text()
    with open(tmp_path / "seq" / "grades.csv") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    # not two equally broken runs: the reference earns every point not timed, the stub none
    ann = rows["ann"]
    assert float(ann["score"]) == float(ann["max_score"]) - float(ann["not_graded_points"]) > 0
    assert float(rows["cid"]["score"]) == 0


def lenet_initial_weights(seed: int) -> dict:
    """ddp_train.py's model as it starts: its lenet() right after torch.manual_seed(seed)."""
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPTS / "ddp_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return module.lenet().state_dict()


def test_ddp_job_trains_with_srun_like_one_process(cluster, tmp_path):
    """slurm_ddp.sbatch on one node: srun starts torchrun, which starts 2 gloo processes (batch
    32 each); one process with batch 64 takes the same steps on the same examples (the sampler
    shuffles the same way, and rank r reads every other example of it), so the weights agree
    up to float32 rounding. Adam moves a weight by about lr at most per step, so 1% of lr x
    steps bounds the rounding here (measured: 1.2e-5 of a 1.6e-4 bound); a wrong global batch
    (2 x 64) differs by 1.6e-2, a run that split nothing would too."""
    epochs, limit, lr = 2, 256, 2e-3
    common = ["--epochs", str(epochs), "--limit", str(limit), "--lr", str(lr), "--timeout", "60"]
    env = {**cluster.env, "GPUS_PER_NODE": "2", "RDZV_PORT": str(free_port()),
           "TORCHRUN": str(TORCHRUN), "OMP_NUM_THREADS": "1"}
    job = cluster.sbatch("--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
                         f"--output={tmp_path}/ddp-%j.out", str(SCRIPTS / "slurm_ddp.sbatch"),
                         *common, "--batch-size", "32", "--checkpoint-dir",
                         str(tmp_path / "slurm"), cwd=REPO, env=env)
    log = tmp_path / f"ddp-{job}.out"
    finished(cluster, job, 240, [log])
    text = log.read_text()
    assert f"job {job}: 1 node(s) x 2" in text and "rank 0/2" in text and "rank 1/2" in text, text
    assert "batch 32 per process x 2 processes = 64 per step" in text, text
    run([str(TORCHRUN), "--standalone", "--nproc-per-node", "1", str(SCRIPTS / "ddp_train.py"),
         *common, "--batch-size", "64", "--checkpoint-dir", str(tmp_path / "one")],
        {**os.environ, "OMP_NUM_THREADS": "1"}, 180)
    two = torch.load(tmp_path / "slurm" / "ddp_train.pt", map_location="cpu")
    one = torch.load(tmp_path / "one" / "ddp_train.pt", map_location="cpu")
    assert (two["world_size"], two["epoch"], one["world_size"], one["epoch"]) == (
        2, epochs - 1, 1, epochs - 1)
    steps = epochs * limit // 64
    atol = 0.01 * lr * steps
    start = lenet_initial_weights(seed=0)
    moved = max((one["model"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 10 * atol, f"training barely moved the weights ({moved:.2e}): nothing to compare"
    for name, weight in one["model"].items():
        torch.testing.assert_close(two["model"][name], weight, rtol=0, atol=atol, msg=lambda m:
                                   f"{name}: 2 processes under Slurm vs 1 process: {m}")
