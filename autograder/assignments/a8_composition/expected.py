"""Assignment 8's public expectations: the inputs the checks share (models, machines, the
configurations that break one ValueError rule each), the public fixed cases of the cost model and
their expected values as data (:func:`public_cases`, from public_cases.json), and one process
training the dense TinyGPT on the full batch (float64), the truth of ``train_3d``'s checks. The
cost model itself, its hidden and random cases and ``best_config``'s hidden cases are in the
instructor's answer key (``solutions/a8_composition/answer_key.py``), never here."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from . import ranks as R

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "total")
TIME_KEYS = ("compute", "bubble", "tp", "dp", "pp", "total")
PAR_KEYS = ("dp", "tp", "pp", "micro_batches", "zero", "checkpoint", "schedule")
#: The public fixed cases of the cost model and their expected values, stored as data
#: (generated from the instructor's answer key; the hidden cases are not in it).
PUBLIC_CASES_PATH = Path(__file__).with_name("public_cases.json")


@functools.cache
def public_cases() -> dict:
    """``{"per_rank_memory": [...], "step_time": [...], "best_config": [...]}``: each case's
    inputs (by parameter name) and ``expected`` value, as stored in public_cases.json."""
    return json.loads(PUBLIC_CASES_PATH.read_text())


# ---------------------------------------------------------------------------- the inputs

TINY = dict(vocab=16, d_model=8, n_heads=4, n_layers=4, seq_len=6, batch=8)
SMALL = dict(vocab=50304, d_model=768, n_heads=12, n_layers=12, seq_len=1024, batch=32)
GPT8B = dict(vocab=128256, d_model=4096, n_heads=32, n_layers=32, seq_len=4096, batch=64)
GPT70B = dict(vocab=128256, d_model=8192, n_heads=64, n_layers=80, seq_len=4096, batch=64)
ODD = dict(vocab=1000, d_model=96, n_heads=6, n_layers=6, seq_len=50, batch=30)

H100 = dict(flops=989e12, memory=80 * 2**30, node_size=8, intra_bw=450e9, inter_bw=50e9)
SMALL_NODES = dict(flops=312e12, memory=40 * 2**30, node_size=4, intra_bw=300e9, inter_bw=25e9)
TOY = dict(flops=2e9, memory=1 << 20, node_size=2, intra_bw=1e9, inter_bw=1e8)


def par(dp, tp, pp, m, zero=0, checkpoint=False, schedule="1f1b") -> dict:
    return dict(dp=dp, tp=tp, pp=pp, micro_batches=m, zero=zero, checkpoint=checkpoint,
                schedule=schedule)


#: One rule broken in each: (model, par, the rule).
BAD_CASES = [
    (TINY, par(0, 1, 1, 1), "dp=0"), (TINY, par(1, 0, 1, 1), "tp=0"),
    (TINY, par(1, 1, 0, 1), "pp=0"), (TINY, par(1, 1, 1, 0), "micro_batches=0"),
    (TINY, par(1, 3, 1, 1), "tp=3 divides neither n_heads=4 nor d_model=8"),
    (dict(TINY, d_model=6), par(1, 4, 1, 1), "tp=4 does not divide d_model=6"),
    (dict(TINY, n_heads=2), par(1, 4, 1, 1), "tp=4 does not divide n_heads=2"),
    (TINY, par(1, 1, 3, 1), "pp=3 does not divide n_layers=4"),
    (TINY, par(3, 1, 1, 1), "dp * micro_batches = 3 does not divide batch=8"),
    (TINY, par(2, 1, 1, 3), "dp * micro_batches = 6 does not divide batch=8"),
    (TINY, par(1, 1, 1, 1, zero=4), "zero=4"), (TINY, par(1, 1, 1, 1, zero=-1), "zero=-1"),
    (TINY, par(1, 1, 1, 1, schedule="interleaved"), 'schedule="interleaved"'),
]


# ---------------------------------------------------------------------------- training

@functools.lru_cache(maxsize=4)
def one_process_training(seed: int):
    """``(losses, state)``: one process, the dense float64 TinyGPT on the full batch, the mean
    cross-entropy over every token, plain SGD."""
    model = R.seeded_model(seed)
    inputs, targets = R.train_data(seed)
    losses = []
    for _ in range(R.STEPS):
        model.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= R.LR * p.grad
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
