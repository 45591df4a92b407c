"""Assignment 9's public expectations: the fixed traces ``diagnose`` is checked on (their
expected values are data, in public_cases.json, generated from the instructor's answer key), the
malformed traces that must raise ValueError, and the states the checkpoint checks save. The
reference implementations and the hidden random traces are in the answer key
(``solutions/a9_resilience/answer_key.py``), never here."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

#: The ops a trace may hold (course.collectives' names, without RECVANYSOURCE).
OPS = ("ALLREDUCE", "BROADCAST", "REDUCE", "ALLGATHER", "REDUCE_SCATTER", "ALLTOALL", "BARRIER",
       "GATHER", "SCATTER", "SEND", "RECV")
KINDS = ("missing", "op", "shape", "dtype", "order")
PUBLIC_CASES_PATH = Path(__file__).with_name("public_cases.json")


@functools.cache
def public_cases() -> dict:
    return json.loads(PUBLIC_CASES_PATH.read_text())


def entry(seq, group, op, shape=(4,), dtype="float32", peer=None, state="completed"):
    """A record on ``group`` = ``(name, members)``."""
    name, members = group
    return {"seq": seq, "group": name, "members": list(members), "op": op,
            "shapes": [list(shape)] if shape else [], "dtype": dtype, "peer": peer, "state": state}


def _run(n, calls):
    """Traces of ``n`` ranks from ``calls``: ``(ranks, group, op, shape, dtype, peer)`` issued
    in order by each of ``ranks`` (seq counted per rank and group)."""
    traces, counts = [[] for _ in range(n)], {}
    for ranks, group, op, shape, dtype, peer in calls:
        for r in ranks:
            seq = counts.get((r, group[0]), 0)
            counts[(r, group[0])] = seq + 1
            traces[r].append(entry(seq, group, op, shape, dtype, peer))
    return traces


def _stuck(per_rank):
    """The last entry of every rank still "started", as a hung rank leaves it."""
    for t in per_rank:
        if t:
            t[-1]["state"] = "started"
    return per_rank


def _tensor_parallel_pairs_stuck():
    """Lesson 17's hang: 4 ranks, pairs [0, 1] and [2, 3]; a broadcast on the default group,
    then each step two all-reduces on the pair and one on everyone; rank 3 is stuck in compute
    at step 1 (blocking calls: each rank stops in the first call that cannot complete)."""
    pair = {0: P01, 1: P01, 2: P23, 3: P23}
    calls = [((0, 1, 2, 3), D4, "BROADCAST", (3,), F, None)]
    for step in range(2):
        for r in range(4):
            if step == 1 and r in (2, 3):
                continue
            calls += [((r,), pair[r], "ALLREDUCE", (4,), F, None)] * 2
        calls.append(((0, 1, 2, 3), D4, "ALLREDUCE", (8,), F, None))
    calls[-1] = ((0, 1), D4, "ALLREDUCE", (8,), F, None)
    calls.append(((2,), P23, "ALLREDUCE", (4,), F, None))
    traces = _run(4, calls)
    for r in (0, 1, 2):  # rank 3's last call completed: it is stuck outside any call
        traces[r][-1]["state"] = "started"
    return traces


#: groups as (name, members): torch names the default group "0", then each new group "1", "2",
#: ... in the order they are made
D3, D4 = ("0", [0, 1, 2]), ("0", [0, 1, 2, 3])
P01, P23 = ("1", [0, 1]), ("2", [2, 3])
F = "float32"
#: (what, traces): the public fixed cases (expected values: public_cases.json)
FIXED_TRACES = [
    ("a clean run on one group", _run(3, [((0, 1, 2), D3, "ALLREDUCE", (4,), F, None),
                                          ((0, 1, 2), D3, "BROADCAST", (2, 2), F, None)])),
    ("no calls at all", [[], [], []]),
    ("a clean run on two groups and point-to-point",
     _run(4, [((0, 1, 2, 3), D4, "ALLREDUCE", (4,), F, None),
              ((1, 3), ("1", [1, 3]), "ALLGATHER", (2,), F, None),
              ((0,), ("2", [0, 2]), "SEND", (3,), F, 2), ((2,), ("2", [0, 2]), "RECV", (3,), F, 0),
              ((0, 1, 2, 3), D4, "BARRIER", (), "", None)])),
    ("a clean run on two groups of the same ranks, used in different orders (asynchronous "
     "calls): each group counts its own calls",
     _run(2, [((0,), ("0", [0, 1]), "ALLREDUCE", (4,), F, None),
              ((0, 1), ("1", [0, 1]), "ALLGATHER", (2,), F, None),
              ((1,), ("0", [0, 1]), "ALLREDUCE", (4,), F, None),
              ((0, 1), ("0", [0, 1]), "BROADCAST", (3,), F, None)])),
    ("rank 2 never issues the second all-reduce",
     _stuck(_run(3, [((0, 1, 2), D3, "ALLREDUCE", (4,), F, None),
                     ((0, 1), D3, "ALLREDUCE", (4,), F, None)]))),
    ("rank 0 broadcasts where the others all-reduce",
     _stuck(_run(3, [((0, 1, 2), D3, "ALLREDUCE", (4,), F, None),
                     ((0,), D3, "BROADCAST", (4,), F, None),
                     ((1, 2), D3, "ALLREDUCE", (4,), F, None)]))),
    ("rank 3 sends a float64 tensor in an all-reduce",
     _stuck(_run(4, [((0, 1, 2), D4, "ALLREDUCE", (4,), F, None),
                     ((3,), D4, "ALLREDUCE", (4,), "float64", None)]))),
    ("ranks 1 and 2 swap an all-gather and an all-reduce (asynchronous calls)",
     _run(4, [((0, 3), D4, "ALLREDUCE", (8,), F, None), ((1, 2), D4, "ALLGATHER", (2,), F, None),
              ((0, 3), D4, "ALLGATHER", (2,), F, None), ((1, 2), D4, "ALLREDUCE", (8,), F, None)])),
    ("rank 2 swaps a broadcast and an all-reduce with blocking calls: it hangs at the first, "
     "with no record at seq + 1 (op, not order)",
     _stuck(_run(3, [((0, 1, 2), D3, "ALLREDUCE", (4,), F, None),
                     ((0, 1), D3, "ALLREDUCE", (4,), F, None),
                     ((2,), D3, "BROADCAST", (4,), F, None)]))),
    ("rank 3 swaps two calls and rank 2 stopped after seq 0: the reference call at seq + 1 is "
     "the most common among the members that made one",
     _run(4, [((0, 1, 2), D4, "ALLREDUCE", (4,), F, None), ((3,), D4, "ALLGATHER", (2,), F, None),
              ((0, 1), D4, "ALLGATHER", (2,), F, None), ((3,), D4, "ALLREDUCE", (4,), F, None)])),
    ("rank 3's call at seq 0 is the others' call at seq 1, but its call at seq 1 is not their "
     "call at seq 0: half a swap is another op, not order",
     _run(4, [((0, 1, 2), D4, "ALLREDUCE", (8,), F, None), ((3,), D4, "ALLGATHER", (2,), F, None),
              ((0, 1, 2), D4, "ALLGATHER", (2,), F, None),
              ((3,), D4, "BROADCAST", (8,), F, None)])),
    ("two ranks disagree with two others: the lowest rank's call is the reference",
     _stuck(_run(4, [((0, 1), D4, "ALLREDUCE", (4,), F, None),
                     ((2, 3), D4, "ALLREDUCE", (5,), F, None)]))),
    ("a receive that was never sent",
     _stuck(_run(3, [((0, 1, 2), D3, "ALLREDUCE", (4,), F, None),
                     ((1,), D3, "RECV", (3,), F, 2)]))),
    ("a send and its receive of different shapes",
     _run(2, [((0,), ("0", [0, 1]), "SEND", (3,), F, 1),
              ((1,), ("0", [0, 1]), "RECV", (4,), F, 0)])),
    ("rank 3 never joins two groups: neither waits on the other, the smaller seq is first",
     _stuck(_run(4, [((0, 1, 2, 3), D4, "ALLREDUCE", (4,), F, None),
                     ((0, 1, 2, 3), D4, "ALLREDUCE", (4,), F, None),
                     ((2,), P23, "ALLREDUCE", (2,), F, None),
                     ((0, 1, 2), D4, "BROADCAST", (4,), F, None)]))),
    ("a shape at seq 0 on rank 2 comes before rank 0's missing call at seq 1",
     _stuck(_run(3, [((0, 1), D3, "ALLREDUCE", (4,), F, None),
                     ((2,), D3, "ALLREDUCE", (5,), F, None),
                     ((1, 2), D3, "ALLREDUCE", (4,), F, None)]))),
    ("two groups diverge at the same seq, neither waiting on the other: the smaller members "
     "list is first (not the smaller name)",
     _stuck(_run(4, [((0, 1), ("2", [0, 1]), "ALLREDUCE", (4,), F, None),
                     ((2, 3), ("1", [2, 3]), "ALLREDUCE", (4,), F, None),
                     ((0,), ("2", [0, 1]), "ALLREDUCE", (4,), F, None),
                     ((3,), ("1", [2, 3]), "ALLREDUCE", (4,), F, None)]))),
    ("lesson 17's hang: pairs [0, 1] and [2, 3], two all-reduces per pair per step, rank 3 "
     "stuck in compute at step 1: the divergence on the default group waits on the pair's",
     _tensor_parallel_pairs_stuck()),
    ("a cycle of waits across three groups of two ranks (blocking calls: rank 0 waits for rank "
     "1 on one, rank 1 for rank 2 on the next, rank 2 for rank 0 on the last): the smallest of "
     "all, by seq then members",
     _stuck(_run(3, [((0, 1), ("1", [0, 1]), "ALLREDUCE", (4,), F, None),
                     ((1, 2), ("2", [1, 2]), "ALLREDUCE", (4,), F, None),
                     ((0, 2), ("3", [0, 2]), "ALLREDUCE", (4,), F, None),
                     ((0,), ("1", [0, 1]), "ALLREDUCE", (4,), F, None),
                     ((1,), ("2", [1, 2]), "ALLREDUCE", (4,), F, None),
                     ((2,), ("3", [0, 2]), "ALLREDUCE", (4,), F, None)]))),
    ("two groups of the same ranks entered in opposite orders by blocking calls (a deadlock): "
     "the same seq and members, Python's order of the names decides",
     _stuck(_run(2, [((0,), ("9", [0, 1]), "ALLREDUCE", (4,), F, None),
                     ((1,), ("10", [0, 1]), "ALLREDUCE", (4,), F, None)]))),
]


def _bad():
    ok = lambda: _run(2, [((0, 1), ("0", [0, 1]), "ALLREDUCE", (4,), F, None)])  # noqa: E731
    cases = []

    def case(why, change):
        traces = ok()
        change(traces)
        cases.append((why, traces))

    def both(**fields):
        return lambda t: [t[r][0].update(fields) for r in (0, 1)]

    case("an unknown op", lambda t: t[1][0].update(op="ALLREDUCE_SOMETIMES"))
    case("seqs that skip one (ragged)", lambda t: t[0][0].update(seq=1))
    case("a seq repeated", lambda t: t[0].append(dict(t[0][0])))
    case("an entry without its dtype", lambda t: t[0][0].pop("dtype"))
    case("an entry without its members (the old seven keys)", lambda t: t[0][0].pop("members"))
    case("a rank's entry on a group it is not in",
         lambda t: t[1][0].update(group="1", members=[0]))
    case("a send without a peer", lambda t: t[0][0].update(op="SEND"))
    case("a trace that is not a list", lambda t: t.__setitem__(1, "rank 1 hung"))
    case("a group name that is not a string", both(group=0))
    case("an empty group name", both(group=""))
    case("members as a comma-joined string", both(members="0,1"))
    case("members not sorted", both(members=[1, 0]))
    case("a member repeated", both(members=[0, 1, 1]))
    case("a member that is not a rank of the run", both(members=[0, 1, 2]))
    case("members that are not ints", both(members=[0.0, 1.0]))
    case("one group with other members on another rank", lambda t: t[1][0].update(members=[1]))
    case("one group with other members on the same rank",
         lambda t: t[0].append(dict(t[0][0], seq=1, members=[0])))
    cases.append(("traces that are not a list", "0,1: ALLREDUCE"))
    return cases


#: (what is wrong, traces): diagnose must raise ValueError for each
BAD_TRACES = _bad()


# ---------------------------------------------------------------------------- checkpoints

def checkpoint_state(step: int, seed: int, numel: int = 1000) -> dict:
    """A state dict of tensors and Python values that differs in every entry from step to
    step (``numel``: the big tensor's size, to make a save take measurable time)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return {"weight": torch.randn(numel, generator=g),
            "bias": torch.randn(3, generator=g, dtype=torch.float64),
            "counts": torch.randint(0, 100, (2, 2), generator=g),
            "epoch": step, "lr": 0.1 / step, "note": f"after step {step}",
            "history": [step, step * 0.5]}


def blank_state(numel: int = 1000) -> dict:
    """What load_latest gets: the same keys, other values."""
    return {"weight": torch.zeros(numel), "bias": torch.zeros(3, dtype=torch.float64),
            "counts": torch.zeros(2, 2, dtype=torch.int64), "epoch": -1, "lr": 0.0,
            "note": "", "history": []}


# ---------------------------------------------------------------------------- train_resumable

def global_batch(seed: int, step: int, n: int, batch_size: int) -> list[int]:
    """The sample ids of global batch ``step``: the text's definition, word for word (each
    epoch reads a permutation of ``range(n)`` seeded by ``seed + epoch``)."""
    epoch, k = divmod(step, n // batch_size)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


def batch_ids(seed: int, step: int) -> list[int]:
    """The global batch of ``step`` in the grader's job."""
    from . import ranks as R

    return global_batch(seed, step, R.SAMPLES, R.BATCH)


@functools.lru_cache(maxsize=4)
def one_process_training(seed: int):
    """``(losses, state)``: the text's computation, one process on the whole global batch,
    float64: ``global_batch``'s ids, the noise drawn once a step for the whole batch from
    ``torch.Generator().manual_seed(seed)``, momentum SGD. Torch's global generator plays no
    part (the grader's model seeds it itself)."""
    from . import ranks as R

    model = R.grader_model(seed)
    x, y = R.samples(seed)
    noise_rng = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    velocity = {n: torch.zeros_like(p) for n, p in params.items()}
    losses = []
    for step in range(R.STEPS):
        ids = torch.tensor(batch_ids(seed, step))
        noise = 0.01 * torch.randn(R.BATCH, R.D_IN, generator=noise_rng, dtype=torch.float64)
        loss = ((model(x[ids] + noise) - y[ids]) ** 2).sum() / R.BATCH
        grads = torch.autograd.grad(loss, list(params.values()))
        losses.append(loss.item())
        with torch.no_grad():
            for (n, p), grad in zip(params.items(), grads):
                velocity[n].mul_(0.9).add_(grad)
                p.sub_(R.LR * velocity[n])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
