"""The DDP scripts in course/scripts/: torchrun trains and checkpoints; the shell scripts parse.

torchrun is the one next to this Python (the virtual environment's), never whatever is first
on PATH; every run has a timeout, so a hanging rendezvous fails the test instead of the suite.

Tier: both: the shell scripts' parsing is quick; torchrun training runs are full.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "course" / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"
TINY = ["--epochs", "1", "--limit", "256", "--batch-size", "32", "--timeout", "60"]


def run(cmd: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.slow
@pytest.mark.full
def test_torchrun_standalone_trains_checkpoints_and_resumes(tmp_path, offline_env):
    assert TORCHRUN.exists(), f"no torchrun next to {sys.executable}"
    # --data fashion reads the tiny Fashion-MNIST files of offline_env (rank 0 first).
    base = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
            str(SCRIPTS / "ddp_train.py"), *TINY, "--data", "fashion",
            "--checkpoint-dir", str(tmp_path)]
    first = run(base, offline_env)
    checkpoint = tmp_path / "ddp_train.pt"
    assert checkpoint.exists(), first.stdout
    state = torch.load(checkpoint, map_location="cpu")
    assert state["epoch"] == 0 and state["world_size"] == 2
    assert {"model", "optimizer"} <= state.keys()
    assert "rank 0/2" in first.stdout and "rank 1/2" in first.stdout
    assert "epoch 0:" in first.stdout
    assert "SYNTHETIC" not in first.stdout, "the Fashion-MNIST files were not found"
    if not torch.cuda.is_available():
        assert "standing in for a GPU" in first.stdout

    second = run([*base, "--epochs", "2", "--resume"], offline_env)
    assert "resumed from" in second.stdout and "epoch 1:" in second.stdout
    assert "epoch 0:" not in second.stdout
    assert torch.load(checkpoint, map_location="cpu")["epoch"] == 1


@pytest.mark.slow
@pytest.mark.full
def test_multinode_script_runs_as_a_single_node(tmp_path, offline_env):
    """The multi-node launcher, with one node and a c10d rendezvous on the loopback."""
    from course.launch import free_port

    env = {**offline_env, "NNODES": "1", "NODE_RANK": "0", "NPROC": "2",
           "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "TORCHRUN": str(TORCHRUN)}
    run(["bash", str(SCRIPTS / "multinode_torchrun.sh"), *TINY,
         "--checkpoint-dir", str(tmp_path)], env)
    assert (tmp_path / "ddp_train.pt").exists()


@pytest.mark.parametrize("name", ["multinode_torchrun.sh", "slurm_ddp.sbatch"])
def test_shell_scripts_parse(name):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (SCRIPTS / name).read_text()
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint",
                 "--node-rank", "ddp_train.py"):
        assert flag in text, f"{name} lacks {flag}"
