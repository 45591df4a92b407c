"""Unit tests of the `course` toolkit: devices, timing, data (on tiny files), models, launch,
planning (against the figures its sources print).

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


@pytest.mark.slow
def test_a_long_tmpdir_starts_ranks_by_exec(monkeypatch, tmp_path):
    """The fork server listens on a Unix socket below TMPDIR, whose path has at most 107 bytes:
    below a long TMPDIR ranks start by exec instead, and run."""
    import tempfile

    from course.launch import fork_server_socket_fits, start_method

    assert fork_server_socket_fits()  # this machine's own TMPDIR is short
    deep = tmp_path / ("t" * 80)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches the folder it chose
    monkeypatch.delenv("COURSE_LAUNCH_START", raising=False)
    assert not fork_server_socket_fits() and start_method() == "exec"
    assert launch(_sum_ranks, 2, 1.0) == [2.0, 2.0]


def test_planning_reproduces_published_figures():
    """course.planning against the figures its sources print (lesson 16's memory and time model)."""
    from course import planning

    # 16 bytes per parameter: bf16 weights and gradients + fp32 master and Adam's moments (ZeRO 3.1,
    # K = 12; the Playbook), and Adam entirely in fp32 (lesson 10) alike
    for precision in (planning.MIXED, planning.FP32):
        assert precision.param + precision.grad + precision.optimizer == 16
    # ZeRO paper, Figure 1: 7.5 B parameters, K = 12, Nd = 64: 120, 31.4, 16.6 and 1.9 GB per GPU
    # (the model's shape plays no part in its states: one layer of width 1 stands in for it)
    paper = planning.Model(7.5e9, layers=1, hidden=1, heads=1, seq=1)
    totals = [sum(planning.model_state_memory(paper, planning.Layout(dp=64, zero=z)).values()) / 1e9
              for z in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert planning.model_state_memory(paper, planning.Layout(dp=64, zero=3))["params"] == 7.5e9 * 2 / 64
    # tensor and pipeline parallelism spread the parameters evenly before ZeRO divides (Playbook)
    spread = planning.model_state_memory(paper, planning.Layout(dp=4, tp=2, pp=3, zero=1), planning.FP32)
    assert spread == {"params": 7.5e9 / 6 * 4, "grads": 7.5e9 / 6 * 4, "optimizer": 7.5e9 / 6 * 8 / 4}
    with pytest.raises(ValueError):
        planning.model_state_memory(paper, planning.Layout(zero=4))
    # Korthikanti et al., Table 2, for GPT-3's shape (s 2048, h 12288, a 96: 5as/h = 80), t = 8
    s, h, a, t = 2048, 12288, 96, 8
    sbh = s * h

    def act(**options):
        return planning.activation_bytes(s, 1, h, a, **options)

    assert act() == sbh * (34 + 80)
    assert act(tp=t) == pytest.approx(sbh * (10 + 24 / t + 80 / t))
    assert act(tp=t, sp=True) == pytest.approx(act() / t)
    assert act(tp=t, sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert act(tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert act(recompute="full") == 2 * sbh
    assert round(1 - act(recompute="selective") / act(), 2) == 0.70  # section 5: "70 %" for GPT-3
    assert act(bytes_per_value=4) == 2 * act()                         # the fp32 runs: twice the bytes
    assert planning.activation_bytes(s, 2, h, a, layers=3) == 6 * act()
    # the bubble: (p - 1) / m, and / v interleaved (Narayanan et al. 2021, 2.2.1-2.2.2)
    assert planning.pipeline_bubble(4, 8) == 3 / 8 and planning.pipeline_bubble(4, 8, interleave=2) == 3 / 16
    # in flight on the first stage: GPipe m, 1F1B p (so L / p layers x p = L layers' worth)
    assert planning.first_stage_in_flight(4, 8, "gpipe") == 8
    assert planning.first_stage_in_flight(4, 8) == 4 and planning.first_stage_in_flight(4, 2) == 2
    # ring collectives: 2 (n - 1) / n and (n - 1) / n of the bytes per link
    assert planning.allreduce_seconds(8e9, 8, 1e9) == pytest.approx(14.0)
    assert planning.allgather_seconds(8e9, 8, 1e9) == pytest.approx(7.0)
    # Llama 3 8B and 70B from their shapes: 8.03 B and 70.6 B parameters (Meta's model cards)
    assert round(planning.llama_params(32, 4096, 32, 8, 14336, 128256) / 1e9, 2) == 8.03
    assert round(planning.llama_params(80, 8192, 64, 8, 28672, 128256) / 1e9, 1) == 70.6


def test_planning_estimates_add_up():
    from course import planning

    model = planning.Model(n_params=1e9, layers=16, hidden=2048, heads=16, seq=2048)
    one = planning.Layout(global_batch=8, micro_batch=8)
    step = planning.estimate_step(model, one, planning.H100, tp_bandwidth=1, dp_bandwidth=1, pp_bandwidth=1,
                                  efficiency=0.4)
    assert step["compute"] == pytest.approx(6e9 * 8 * 2048 / (989e12 * 0.4))
    assert step["total"] == step["compute"] and step["mfu"] == pytest.approx(0.4)
    memory = planning.estimate_memory(model, one, planning.FP32)
    assert memory["params"] + memory["grads"] + memory["optimizer"] == 16e9
    assert memory["activations"] == planning.activation_bytes(2048, 8, 2048, 16, 16, bytes_per_value=4)
    assert memory["total"] == pytest.approx(16e9 + memory["activations"])
    piped = planning.Layout(dp=2, tp=2, pp=4, zero=1, micro_batch=1, global_batch=16)
    assert piped.gpus == 16 and piped.micro_batches == 8
    memory = planning.estimate_memory(model, piped)
    assert memory["params"] == 1e9 / 8 * 2 and memory["optimizer"] == 1e9 / 8 * 12 / 2
    assert memory["activations"] == 4 * planning.activation_bytes(2048, 1, 2048, 16, 4, tp=2)
    step = planning.estimate_step(model, piped, planning.H100, tp_bandwidth=450e9, dp_bandwidth=50e9,
                                  pp_bandwidth=50e9)
    assert step["bubble"] == pytest.approx(step["compute"] * 3 / 8)
    assert step["total"] == pytest.approx(sum(step[k] for k in ("compute", "bubble", "tp", "exposed_dp", "pp")))
    for bad in (dict(zero=4), dict(recompute="some")):
        with pytest.raises(ValueError):
            planning.estimate_memory(model, planning.Layout(global_batch=8, **bad))
    with pytest.raises(ValueError, match="multiple"):
        planning.Layout(dp=3, global_batch=8).micro_batches


def _llama(layers, hidden, heads, ffn, seq=8192):
    from course import planning

    n_params = planning.llama_params(layers, hidden, heads, 8, ffn, 128256)
    return planning.Model(n_params, layers, hidden, heads, seq, vocab=128256, kv_heads=8)


def test_planning_interleaved_first_stage_counts_chunks_not_micro_batches():
    """Korthikanti 4.2.3: an interleaved first stage holds 1 + (p - 1) / (p v) times 1F1B's, v the model
    chunks per rank (the paper's m); it was computed with the micro-batches, which hid lesson 16's answer
    16.4 (Llama 3 405B, v = 2: about 106 GB of activations, 113 GB in all, not 74 and 81)."""
    from course import planning

    llama405 = _llama(126, 16384, 128, 53248)
    base = dict(tp=8, pp=16, dp=64, zero=2, sp=True, recompute="selective", micro_batch=1, global_batch=2048)
    one, two = planning.Layout(**base), planning.Layout(**base, interleave=2)
    assert planning.stage_in_flight(one) == 16 and planning.stage_in_flight(two) == 16 * (1 + 15 / (16 * 2))
    memory = planning.estimate_memory(llama405, two)
    assert memory["activations"] == pytest.approx(
        planning.estimate_memory(llama405, one)["activations"] * (1 + 15 / 32))
    assert round(memory["activations"] / 1e9) == 106 and round(memory["total"] / 1e9) == 113
    assert round(memory["grads"] / 1e9, 2) == 0.10                    # ZeRO-2: 405.9e9 / 128 x 2 / 64
    # the last rank: ((v - 1) p + 1) / v micro-batches' worth; Megatron's warm-up is capped at m v chunks
    assert planning.stage_in_flight(two, "last") == (16 + 1) / 2
    assert planning.stage_in_flight(planning.Layout(**dict(base, global_batch=1024), interleave=2)) == 16
    for bad in (dict(interleave=2, schedule="gpipe"), dict(interleave=0)):
        with pytest.raises(ValueError):
            planning.stage_in_flight(planning.Layout(**base, **bad))


def test_planning_zero_traffic_under_gradient_accumulation():
    """ZeRO-3 gathers the weights again in every micro-batch (1.5 all-reduces' bytes each, hidden at most
    behind that micro-batch's compute); ZeRO-0/1 accumulate locally and reduce once, behind the last
    micro-batch's backward only; ZeRO-2 reduce-scatters every micro-batch. Lesson 16 called ZeRO-3
    'free' for 70B as TP 8 x DP 8 (64 micro-batches per replica): by the model it costs 3.2 s a step."""
    from course import planning

    h100, links = planning.H100, dict(tp_bandwidth=450e9, dp_bandwidth=50e9, pp_bandwidth=50e9)
    llama8 = _llama(32, 4096, 32, 14336)
    psi = llama8.n_params * 2
    for zero, m in [(0, 8), (1, 8), (2, 8), (3, 8), (3, 1)]:
        layout = planning.Layout(dp=64, zero=zero, global_batch=64 * m, recompute="selective")
        compute = planning.estimate_step(llama8, layout, h100, **links)["compute"]
        traffic, exposed = planning.data_parallel_seconds(llama8, layout, compute, 50e9)
        ring = planning.allreduce_seconds(psi, 64, 50e9)
        backward = compute / m * 2 / 3
        if zero < 2:
            assert traffic == pytest.approx(ring) and exposed == pytest.approx(max(0, ring - backward))
        elif zero == 2:
            assert traffic == pytest.approx((m + 1) / 2 * ring)
        else:
            assert traffic == pytest.approx(1.5 * m * ring)
            assert exposed == pytest.approx(m * max(0, 1.5 * ring - compute / m))
    # lesson 16's 8B on 64 GPUs: ZeRO-1 0.10 s exposed (not 0), ZeRO-3 7.6 s of traffic, 1.2 s exposed
    zero1, zero3 = (planning.estimate_step(llama8, planning.Layout(dp=64, zero=z, global_batch=512,
                                                                   recompute="selective"), h100, **links)
                    for z in (1, 3))
    assert round(zero1["exposed_dp"], 2) == 0.10 and round(zero1["mfu"], 2) == 0.49
    assert round(zero3["dp"], 1) == 7.6 and round(zero3["exposed_dp"], 1) == 1.2
    assert round(zero3["mfu"], 2) == 0.42
    llama70 = _llama(80, 8192, 64, 28672)
    tp8 = dict(tp=8, dp=8, sp=True, global_batch=512, recompute="selective")
    zero1, zero3 = (planning.estimate_step(llama70, planning.Layout(zero=z, **tp8), h100, **links)
                    for z in (1, 3))
    assert zero3["total"] - zero1["total"] == pytest.approx(3.1, abs=0.05)
    assert (round(zero1["mfu"], 2), round(zero3["mfu"], 2)) == (0.42, 0.40)
    plain_dp = planning.Layout(dp=64, global_batch=512)
    unhidden = planning.estimate_step(llama8, plain_dp, h100, overlap_dp=False, **links)
    assert unhidden["exposed_dp"] == pytest.approx(planning.allreduce_seconds(psi, 64, 50e9))


def test_planning_counts_the_output_layer_on_the_last_stage():
    """Korthikanti 4.3: 4 s b h / t (1 + V / h) bytes for the final norm, the output layer and the fp32
    logits: 4.3 GB per 8192-token sequence at Llama 3's 128,256 vocabulary and h = 4096, which made
    lesson 16's 'ZeRO-1 just fits (70 GB)' about 74 GB. On the last stage only."""
    from course import planning

    assert planning.output_layer_bytes(8192, 1, 4096, 128256) == 4 * 8192 * (4096 + 128256)
    assert round(planning.output_layer_bytes(8192, 1, 4096, 128256) / 1e9, 1) == 4.3
    assert planning.output_layer_bytes(8192, 2, 4096, 128256, tp=8, cp=2) == pytest.approx(
        planning.output_layer_bytes(8192, 1, 4096, 128256) / 8)
    llama8 = _llama(32, 4096, 32, 14336)
    zero1 = planning.Layout(dp=64, zero=1, global_batch=512, recompute="selective")
    memory = planning.estimate_memory(llama8, zero1)
    assert memory["output"] == planning.output_layer_bytes(8192, 1, 4096, 128256)
    assert round(memory["total"] / 1e9, 1) == 74.5
    piped = planning.Layout(tp=8, pp=4, dp=2, zero=1, sp=True, global_batch=512, recompute="selective")
    llama70 = _llama(80, 8192, 64, 28672)
    first, last = (planning.estimate_memory(llama70, piped, stage=s) for s in ("first", "last"))
    assert first["output"] == 0 and last["output"] == planning.output_layer_bytes(8192, 1, 8192, 128256, tp=8)
    assert last["activations"] == first["activations"] / 4                  # 1F1B: pp micro-batches against one
    gpipe = planning.Layout(pp=4, global_batch=8, schedule="gpipe")
    assert planning.estimate_memory(llama8, gpipe, stage="last")["output"] == 8 * planning.output_layer_bytes(
        8192, 1, 4096, 128256)
    assert planning.estimate_memory(planning.Model(1e9, 4, 64, 4, 16), gpipe, stage="last")["output"] == 0
    with pytest.raises(ValueError):
        planning.estimate_memory(llama8, gpipe, stage="middle")


def test_planning_attention_flops_zero_bubble_and_context_parallelism():
    """Attention's FLOPs (Kaplan Table 1: 2 L s h a token forward, 6 L s h in training) against 6N for a
    405B model: 4 % at 8,192 tokens, two thirds more at 131,072; ZB-H1's bubble (Qi et al. 2024) is a
    third of 1F1B's; context parallelism splits the tokens, shards ZeRO over dp x cp and all-gathers
    K and V (Llama 3, 3.3.2)."""
    from course import planning

    llama405 = _llama(126, 16384, 128, 53248)
    share = [planning.attention_flops(126, 16384, s, 1) / planning.training_flops(llama405.n_params, 1)
             for s in (8192, 131072)]
    assert round(share[0], 3) == 0.042 and round(share[1], 2) == 0.67
    assert planning.attention_flops(2, 8, 16, 10, "full") == 8 * 2 * 16 * 8 * 10
    h100, links = planning.H100, dict(tp_bandwidth=450e9, dp_bandwidth=50e9, pp_bandwidth=50e9)
    layout = planning.Layout(tp=8, pp=16, dp=64, zero=2, sp=True, recompute="selective", global_batch=2048)
    plain, counted = (planning.estimate_step(llama405, layout, h100, attention=a, **links)
                      for a in (False, True))
    assert counted["compute"] == pytest.approx(plain["compute"] * (1 + share[0]))
    parts = ("compute", "bubble", "tp", "cp", "exposed_dp", "pp")
    assert plain["total"] == pytest.approx(sum(plain[k] for k in parts))
    one_f_one_b = planning.pipeline_bubble(16, 32)
    assert planning.pipeline_bubble(16, 32, schedule="zb-h1") == pytest.approx(one_f_one_b / 3)
    for bad in (dict(interleave=2, schedule="zb-h1"), dict(schedule="other")):
        with pytest.raises(ValueError):
            planning.pipeline_bubble(16, 32, **bad)
    zb_layout = planning.Layout(**{**layout.__dict__, "schedule": "zb-h1"})
    zb = planning.estimate_step(llama405, zb_layout, h100, **links)
    assert zb["bubble"] == pytest.approx(plain["bubble"] / 3)
    assert planning.stage_in_flight(planning.Layout(pp=16, global_batch=32, schedule="zb-h1")) == 16
    # context parallelism: Llama 3's long-context row (TP 8, CP 16, PP 16, DP 8, 131,072 tokens)
    long = _llama(126, 16384, 128, 53248, seq=131072)
    cp = planning.Layout(tp=8, cp=16, pp=16, dp=8, zero=2, sp=True, recompute="selective", global_batch=128)
    assert cp.gpus == 16384 and cp.micro_batches == 16
    assert planning.estimate_memory(long, cp)["activations"] == pytest.approx(
        planning.estimate_memory(llama405, layout)["activations"])          # 8,192 of each sequence's tokens
    assert planning.model_state_memory(long, cp)["grads"] == pytest.approx(llama405.n_params / 128 * 2 / 128)
    assert planning.activation_bytes(1024, 1, 64, 4, cp=4) == pytest.approx(
        256 * 64 * (34 + 5 * 4 * 1024 / 64))                                  # s / cp tokens against all s keys
    step = planning.estimate_step(long, cp, h100, cp_bandwidth=50e9, **links)
    kv = 2 * 131072 * 16384 * 8 / 128 * 2 / 8          # K and V bytes per tp rank and layer
    assert step["cp"] == pytest.approx(126 / 16 * 16 * 2 * planning.allgather_seconds(kv, 16, 50e9))
    with pytest.raises(ValueError, match="cp_bandwidth"):
        planning.estimate_step(long, cp, h100, **links)
