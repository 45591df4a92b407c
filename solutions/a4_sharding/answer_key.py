"""Assignment 4's answer key (instructor only: never in the student edition, never imported in
the sandbox): the reference versions of the four functions whose values are graded
(``assign_buckets``, ``shard_bounds``, ``model_state_bytes``, ``comm_bytes_per_step``), the
public fixed cases with their expected values (:func:`public_cases`, stored as data in
``autograder/assignments/a4_sharding/public_cases.json``; a test keeps the two equal), and the
hidden checks' fresh random cases (:func:`hidden_cases`).

Regenerate the JSON after changing the fixed cases::

    .venv/bin/python solutions/a4_sharding/answer_key.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

ASSIGNMENT = "a4_sharding"
PUBLIC_CASES = (Path(__file__).resolve().parents[2] / "autograder" / "assignments" / ASSIGNMENT
                / "public_cases.json")


# ---------------------------------------------------------------------------- the references

def assign_buckets(param_numels, bucket_bytes, element_size=4):
    """The text's walk: last index first; a new bucket iff the current one is not empty and its
    bytes plus the next parameter's exceed ``bucket_bytes`` (so a zero-size parameter after one
    larger than ``bucket_bytes`` starts a new bucket, as the text says)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out, current, size = [], [], 0
    for i in range(len(param_numels) - 1, -1, -1):
        b = param_numels[i] * element_size
        if current and size + b > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += b
    return out + ([current] if current else [])


def shard_bounds(numel, world_size, rank):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid world_size {world_size} or rank {rank}")
    c = -(-numel // world_size)
    start = min(rank * c, numel)
    return start, min(start + c, numel)


def model_state_bytes(num_params, world_size, *, stage, mixed_precision):
    if world_size < 1 or stage not in (0, 1, 2, 3):
        raise ValueError(f"invalid world_size {world_size} or stage {stage}")
    per = (2, 2, 12) if mixed_precision else (4, 4, 8)
    c = -(-num_params // world_size)
    held = [c if stage >= s else num_params for s in (3, 2, 1)]  # params, grads, state
    return sum(b * n for b, n in zip(per, held))


def comm_bytes_per_step(num_params, world_size, *, stage, element_size=4):
    if world_size < 1 or stage not in (0, 1, 2, 3):
        raise ValueError(f"invalid world_size {world_size} or stage {stage}")
    k = 3 if stage == 3 else 2
    return (k * (world_size - 1) * num_params * element_size) // world_size


# ---------------------------------------------------------------------------- the cases

#: assign_buckets' fixed cases ((param_numels, bucket_bytes), kwargs): every rule of the text.
BUCKET_CASES = [
    (([3, 0, 5, 2, 10], 16), {}), (([], 8), {}), (([0, 0, 0], 4), {}), (([2, 2, 2, 2], 16), {}),
    (([100, 1, 1], 8), {}), (([1, 1, 100], 8), {}), (([3, 3, 0, 1], 12), {}), (([7], 1), {}),
    (([1, 2, 3, 4, 5], 10), {"element_size": 2}), (([4, 4, 4], 64), {"element_size": 8}),
    (([5, 5, 5], 20), {"element_size": 4}),
    # a zero-size parameter after one larger than bucket_bytes starts a new bucket
    (([0, 100], 8), {}), (([2, 0, 9, 0, 1], 8), {}), (([0, 0, 3], 4), {"element_size": 2}),
    # a bucket exactly full, then a zero-size parameter: it joins (bytes not exceeded)
    (([0, 4], 16), {}), (([1, 0, 2, 2], 16), {}), (([0, 0, 3, 1], 8), {"element_size": 2}),
    # a zero-size parameter alone is a bucket that is not empty: the next one is new
    (([7, 0], 8), {}), (([3, 0, 0], 4), {"element_size": 8}),
    # longer lists, zero-size parameters among them (drawn once, fixed here)
    (([12, 0, 41, 7, 7, 60, 0, 3, 25, 18, 1, 0, 33], 100), {"element_size": 2}),
    (([5, 9, 0, 0, 14, 2, 40, 8, 8, 1, 19, 27, 0, 6, 11, 3], 40), {"element_size": 1}),
    (([50, 2, 2, 0, 31, 16, 9, 0, 58, 4], 256), {"element_size": 8}),
]
#: shard_bounds' fixed (numel, world_size): uneven, empty shards, one rank, 10**12.
SHARD_SIZES = [(10, 3), (0, 1), (0, 4), (1, 4), (4, 3), (7, 7), (5, 8), (100, 1), (9, 4),
               (34, 3), (1_000_003, 64), (10 ** 12 + 1, 7), (10 ** 12, 4096)]
#: The byte counts' fixed (parameters, world size): up to 10**12, empty, uneven.
BYTE_PARAMS = [0, 1, 7, 10, 1_000_003, 10 ** 12, 10 ** 12 + 3, 987_654_321]
BYTE_WORLDS = [1, 2, 3, 8, 1000]


def _ranks(world: int):
    """The ranks a case of ``world`` ranks asks about: all of them up to 16, else the ends and
    the middle."""
    return range(world) if world <= 16 else sorted({0, 1, world // 2, world - 2, world - 1})


def _shard_cases(sizes):
    return [((numel, world, r), {}) for numel, world in sizes for r in _ranks(world)]


def _state_cases(sizes):
    return [((p, w), {"stage": s, "mixed_precision": m}) for p, w in sizes
            for s in range(4) for m in (False, True)]


def _comm_cases(sizes):
    cases = []
    for k, (p, w) in enumerate(sizes):
        for s in range(4):
            cases.append(((p, w), {"stage": s}))  # the default element size
            # every element size at every stage, in turn over the sizes
            cases.append(((p, w), {"stage": s, "element_size": (1, 2, 4, 8)[(k + s) % 4]}))
    return cases


REFERENCES = {"assign_buckets": assign_buckets, "shard_bounds": shard_bounds,
              "model_state_bytes": model_state_bytes,
              "comm_bytes_per_step": comm_bytes_per_step}


def expected_values(name: str, cases) -> list:
    """The reference's value of each ``(args, kwargs)`` of ``cases`` (shard_bounds' as tuples)."""
    fn = REFERENCES[name]
    return [fn(*args, **kwargs) for args, kwargs in cases]


def public_cases() -> dict:
    """``{function: [{"args": [...], "kwargs": {...}, "expected": value}, ...]}``: the fixed
    cases of the public checks and their expected values, as JSON stores them (tuples as
    lists)."""
    byte_sizes = [(p, w) for p in BYTE_PARAMS for w in BYTE_WORLDS]
    cases = {"assign_buckets": BUCKET_CASES, "shard_bounds": _shard_cases(SHARD_SIZES),
             "model_state_bytes": _state_cases(byte_sizes),
             "comm_bytes_per_step": _comm_cases(byte_sizes)}
    out = {}
    for name, listed in cases.items():
        out[name] = [{"args": list(args), "kwargs": dict(kwargs),
                      "expected": list(want) if isinstance(want, tuple) else want}
                     for (args, kwargs), want in zip(listed, expected_values(name, listed))]
    return json.loads(json.dumps(out))  # exactly what the JSON file holds


def hidden_cases(name: str, rng: random.Random) -> tuple[list, list]:
    """(cases ``(args, kwargs)``, the reference's values) of a hidden check: fresh random
    inputs from ``rng`` (the run's seed)."""
    if name == "assign_buckets":
        cases = []
        for _ in range(12):  # sizes from the run's seed, zero-size parameters among them
            numels = [0 if rng.random() < 0.2 else rng.randint(1, 60)
                      for _ in range(rng.randint(1, 30))]
            cases.append(((numels, rng.choice([8, 40, 100, 256, 1000])),
                          {"element_size": rng.choice([1, 2, 4, 8])}))
    elif name == "shard_bounds":
        sizes = [(rng.randint(0, 10 ** 6), rng.randint(1, 64)) for _ in range(6)]
        sizes += [(rng.randint(0, 10 ** 12), rng.randint(1, 4096)) for _ in range(4)]
        cases = _shard_cases(sizes)
    else:
        params = [rng.randint(1, 10 ** 6), rng.randint(1, 10 ** 9), rng.randint(1, 10 ** 12)]
        worlds = [rng.randint(2, 16), rng.randint(4, 1024)]
        sizes = [(p, w) for p in params for w in worlds]
        if name == "model_state_bytes":
            cases = _state_cases(sizes)
        elif name == "comm_bytes_per_step":
            cases = _comm_cases(sizes)
        else:
            raise KeyError(name)
    return cases, expected_values(name, cases)


if __name__ == "__main__":
    lines = []
    for name, listed in public_cases().items():  # one case a line
        rows = ",\n".join("  " + json.dumps(case) for case in listed)
        lines.append(f"{json.dumps(name)}: [\n{rows}\n ]")
    PUBLIC_CASES.write_text("{" + ",\n".join(lines) + "}\n")
    print(f"wrote {PUBLIC_CASES}")
