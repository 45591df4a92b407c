"""Unit tests of the `course` toolkit: devices, timing, data (on tiny files), models, launch.

Tier: quick: the toolkit's units, launches included.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from course import data, devices, models, timing
from course.launch import LaunchError, launch


def test_cpu_stand_ins_are_labelled():
    if devices.gpu_count():
        pytest.skip("this machine has GPUs: stand-ins are only used without them")
    ds = devices.available_devices(3)
    assert ds == [torch.device("cpu")] * 3
    text = devices.describe(ds)
    assert "stand-in" in text and "no GPU" in text
    assert "no CUDA GPU" in devices.hardware_summary()


def test_cpu_bf16_can_be_disabled_without_probing(monkeypatch):
    """COURSE_DISABLE_CPU_BF16=1 answers False at once: no probe process, no oneDNN cap."""
    import subprocess

    def no_probe(*args, **kwargs):
        raise AssertionError("cpu_bf16_ok probed although bf16 was disabled")

    monkeypatch.setattr(subprocess, "run", no_probe)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(devices.DISABLE_CPU_BF16, "1")
    assert devices.DISABLE_CPU_BF16 == "COURSE_DISABLE_CPU_BF16"
    assert devices.cpu_bf16_ok() is False
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ
    monkeypatch.setenv(devices.DISABLE_CPU_BF16, "0")  # any other value: probe as usual
    with pytest.raises(AssertionError, match="probed"):
        devices.cpu_bf16_ok()


def test_benchmark_reports_median_after_warmup():
    calls = []

    def work(delay):
        calls.append(delay)
        time.sleep(delay)

    m = timing.benchmark(work, 0.01, warmup=2, repeats=5)
    assert len(calls) == 7 and len(m.times) == 5
    assert 0.009 < m.median < 0.1
    fast = timing.benchmark(work, 0.001, warmup=0, repeats=3)
    assert timing.speedup(m, fast) > 2
    with timing.Timer() as t:
        time.sleep(0.02)
    assert t.seconds >= 0.02


def test_fashion_mnist_loader_reads_real_files(tiny_data):
    train, test = data.load_fashion_mnist(32, root=tiny_data, download=False)
    X, y = next(iter(train))
    assert X.shape == (32, 1, 28, 28) and X.dtype == torch.float32 and 0 <= X.min() <= X.max() <= 1
    assert y.dtype == torch.int64 and len(train.dataset) == 512 and len(test.dataset) == 128
    _, _, real = data.fashion_mnist_datasets(root=tiny_data, download=False)
    assert real


def test_missing_data_falls_back_to_an_announced_synthetic_set(tmp_path, capsys):
    train, test, real = data.fashion_mnist_datasets(root=tmp_path, download=False)
    assert not real and "SYNTHETIC" in capsys.readouterr().out
    X, y = train[0]
    assert X.shape == (1, 28, 28) and 0 <= int(y) < 10


def test_models_have_the_expected_shapes():
    params = models.lenet_params()
    X = torch.rand(4, 1, 28, 28)
    assert models.lenet(X, params).shape == (4, 10)
    assert models.resnet18()(X).shape == (4, 10)
    assert models.mlp((8, 16, 3))(torch.rand(2, 8)).shape == (2, 3)
    for p in params:
        p.requires_grad_()
    models.loss(models.lenet(X, params), torch.tensor([0, 1, 2, 3])).sum().backward()
    before = [p.detach().clone() for p in params]
    models.sgd(params, 0.1, 4)
    assert all(not torch.equal(a, b) for a, b in zip(before, params[::2]))
    assert all(not p.grad.any() for p in params)


def _sum_ranks(rank, world_size, offset):
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print("sum is", t.item())
    return t.item() + offset


def _fail_on_rank_one(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one broke")
    dist.barrier()


def _sleep(rank, world_size):
    time.sleep(60)


@pytest.mark.slow
def test_launch_runs_ranks_and_reports_failures(capfd):
    assert launch(_sum_ranks, 3, 10.0) == [13.0, 13.0, 13.0]
    assert "[rank 2] sum is 3.0" in capfd.readouterr().out
    with pytest.raises(LaunchError, match="rank 1 exited with code 1") as err:
        launch(_fail_on_rank_one, 2, collective_timeout=10, quiet=True)
    assert str(err.value).index("rank 1") < str(err.value).find("rank 0") or "rank 0" not in str(err.value)
    assert "rank one broke" in str(err.value)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        launch(_sleep, 2, timeout=3, quiet=True)
    assert time.monotonic() - start < 20


def test_synthetic_train_and_test_sets_share_their_classes():
    train = data.synthetic_fashion_mnist(200, seed=0)
    test = data.synthetic_fashion_mnist(200, seed=1)
    Xtr, ytr = train.tensors
    Xte, yte = test.tensors
    centroids = torch.stack([Xtr[ytr == k].mean(0) for k in range(10)]).flatten(1)
    nearest = torch.cdist(Xte.flatten(1), centroids).argmin(1)
    assert (nearest == yte).float().mean() > 0.9


def _ddp_steps(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    for _ in range(3):
        ddp(torch.randn(8, 32)).sum().backward()
    return rank


def _timed_out_collective(rank, world_size):
    import torch.distributed as dist

    if rank == 0:
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1))
    else:
        time.sleep(3)
    return rank


@pytest.mark.slow
def test_finished_ranks_exit_cleanly():
    """A rank whose function returned must not die in teardown. Before launch freed the DDP
    reducer and met its peers at a barrier, gloo aborted about one DDP launch in three at exit
    ("terminate called without an active exception"); 6 launches all pass by chance with
    probability ~0.1. A group broken by a timed-out collective must not fail the rank either."""
    for _ in range(6):
        assert launch(_ddp_steps, 2, quiet=True, timeout=60) == [0, 1]
    assert launch(_timed_out_collective, 2, quiet=True, collective_timeout=1, timeout=60) == [0, 1]


@pytest.mark.slow
def test_launch_without_the_fork_server(monkeypatch, capfd):
    """The fallback (Windows, or COURSE_LAUNCH_START=exec): a fresh interpreter per rank."""
    from course.launch import start_method

    monkeypatch.setenv("COURSE_LAUNCH_START", "exec")
    assert start_method() == "exec"
    assert launch(_sum_ranks, 2, 1.0) == [2.0, 2.0]
    assert "[rank 1] sum is 1.0" in capfd.readouterr().out
    with pytest.raises(LaunchError, match="rank one broke"):
        launch(_fail_on_rank_one, 2, collective_timeout=10, quiet=True)
