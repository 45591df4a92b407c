"""The models and inputs of Assignment 3's checks, and what the grader derives from them by
itself: parameter counts, the balanced split (by brute force), micro-batch sizes.

Used in the grader, in the sandbox and in ranks, so it imports nothing heavier than torch.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn


def rand_int(g: torch.Generator, low: int, high: int) -> int:
    """A random integer in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


# ---------------------------------------------------------------------------- small models

def build_model(g: torch.Generator, spec: list) -> nn.Sequential:
    """An ``nn.Sequential`` from a spec: ints are Linear widths chained in order, strings are
    parameter-free layers ("relu", "tanh") or "norm" (a LayerNorm of the current width)."""
    layers, width = [], None
    for item in spec:
        if isinstance(item, int):
            if width is not None:
                layers.append(nn.Linear(width, item))
            width = item
        elif item == "relu":
            layers.append(nn.ReLU())
        elif item == "tanh":
            layers.append(nn.Tanh())
        elif item == "norm":
            layers.append(nn.LayerNorm(width))
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def random_mlp_spec(g: torch.Generator, n_linear: int, low: int = 2, high: int = 24) -> list:
    spec = [rand_int(g, low, high)]
    for i in range(n_linear):
        spec.append(rand_int(g, low, high))
        if i < n_linear - 1:
            spec.append("relu")
    return spec


def layer_counts(model: nn.Sequential) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def input_width(model: nn.Sequential) -> int:
    for layer in model:
        if isinstance(layer, nn.Linear):
            return layer.in_features
        if isinstance(layer, nn.LayerNorm):
            return layer.normalized_shape[0]
    raise ValueError("a model without Linear or LayerNorm layers")


def model_text(model: nn.Sequential) -> str:
    """``[Linear 5->7 (42), ReLU, ...]``: layers and their parameter counts, for messages."""
    parts = []
    for layer, n in zip(model, layer_counts(model)):
        if isinstance(layer, nn.Linear):
            parts.append(f"Linear {layer.in_features}->{layer.out_features} ({n})")
        else:
            parts.append(f"{type(layer).__name__}" + (f" ({n})" if n else ""))
    return "[" + ", ".join(parts) + "]"


def balanced_sizes(counts: list[int], k: int) -> list[int]:
    """Layers per stage of the notebook's balanced split, by brute force over every split into
    ``k`` contiguous non-empty stages: the largest stage (in parameters) as small as possible,
    then the lexicographically largest stage sizes (earlier stages take as many layers as they
    can)."""
    n, best = len(counts), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        sizes = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        largest = max(sum(counts[a:b]) for a, b in zip(bounds, bounds[1:]))
        key = (largest, tuple(-s for s in sizes))
        if best is None or key < best[0]:
            best = (key, list(sizes))
    return best[1]


def bounds_of(sizes: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(sizes))
    return list(zip([0, *ends[:-1]], ends))


def microbatch_sizes(batch: int, num_microbatches: int) -> list[int]:
    """``x.tensor_split(min(num_microbatches, batch))``: the first ones one row larger."""
    n = min(num_microbatches, batch)
    return [batch // n + (1 if i < batch % n else 0) for i in range(n)]


# ---------------------------------------------------------------------------- timed workloads

def wide_mlp(seed: int, width: int, depth: int, classes: int | None = 10) -> nn.Sequential:
    """``depth`` (Linear width->width, ReLU) blocks and, unless ``classes`` is None, a Linear
    width->classes head; weights from ``seed`` (N(0, 1/width)), biases zero."""
    g = torch.Generator().manual_seed(seed)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.Sequential(*layers, *([nn.Linear(width, classes)] if classes else []))
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * width ** -0.5)
                layer.bias.zero_()
    return model


def half_cut(model: nn.Sequential) -> int:
    """Where the two-stage pipeline of a :func:`wide_mlp` is cut: whole (Linear, ReLU) blocks."""
    return len(model) // 2 - (len(model) // 2) % 2


def workload(seed: int, batch: int, width: int, classes: int = 10):
    """``(X, y)``: a batch of ``batch`` rows of ``width`` features and labels below ``classes``."""
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(batch, width, generator=g),
            torch.randint(0, classes, (batch,), generator=g))
