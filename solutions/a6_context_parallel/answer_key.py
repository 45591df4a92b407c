"""Assignment 6's answer key (instructor only; never released, never imported in the sandbox).

- :func:`merge`: the reference ``merge_attention``, the truth of the hidden merge cases;
- :func:`merge_cases`: fresh random hidden merge cases (lse around 0, near +1000 and near
  -1000, rows masked in one part, their ``out`` rows NaN or inf, and in both, strided views);
- :func:`zigzag_positions`: the zig-zag layout, from which :func:`public_cases` writes the
  layouts the grader uses (``autograder/assignments/a6_context_parallel/public_cases.json``,
  as values: ``tests/test_grader_a6.py`` asserts that the file equals :func:`public_cases`).

Regenerate the JSON with ``python solutions/a6_context_parallel/answer_key.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

INF = float("inf")
ASSIGNMENT = "a6_context_parallel"
PUBLIC_CASES = (Path(__file__).resolve().parents[2] / "autograder" / "assignments" / ASSIGNMENT
                / "public_cases.json")


# ---------------------------------------------------------------------------- merge

def merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) over A and B, in the inputs' dtype: the log of the summed exponentials from
    torch.logaddexp (exact where one part is empty), each part weighted by exp(lse_x - lse),
    a part with no key contributing exactly nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    anything = lse > -INF
    out = torch.zeros_like(out_a)
    for part_out, part_lse in ((out_a, lse_a), (out_b, lse_b)):
        present = anything & (part_lse > -INF)
        weight = torch.exp(torch.where(present, part_lse - lse, torch.zeros_like(lse)))
        out = out + torch.where(present[..., None], weight[..., None] * part_out, 0.0)
    return out, lse


#: Shapes of the hidden merge cases: (batch, heads, seq, head_dim).
MERGE_SHAPE = (2, 3, 7, 4)


def merge_cases(g: torch.Generator, dtype) -> list[dict]:
    """Partial attentions with lse around 0, near +1000 and near -1000, rows masked in one part
    (its out row NaN or inf) or both, some given as strided views: ``{"inputs", "strided",
    "what"}``. Rows 0-2 of every head of the masked case: A masked, B masked, both masked."""
    b, h, s, d = MERGE_SHAPE

    def parts(centre, spread):
        outs = [torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(2)]
        lses = [centre + spread * torch.randn(b, h, s, generator=g, dtype=torch.float64)
                for _ in range(2)]
        return [outs[0], lses[0], outs[1], lses[1]]

    cases = [(parts(0.0, 3.0), False, "lse around 0"),
             (parts(1000.0, 4.0), True, "lse near +1000 (strided views)"),
             (parts(-1000.0, 4.0), False, "lse near -1000")]
    masked = parts(2.0, 3.0)
    out_a, lse_a, out_b, lse_b = masked
    lse_a[:, :, 0] = lse_b[:, :, 1] = lse_a[:, :, 2] = lse_b[:, :, 2] = -INF
    out_a[:, :, 0] = float("nan")
    out_b[:, :, 1] = INF
    out_a[:, :, 2, ::2], out_a[:, :, 2, 1::2] = float("nan"), -INF
    out_b[:, :, 2] = float("nan")
    cases.append((masked, True, "rows masked in one part (their out NaN or inf) and in both "
                                "(strided views)"))
    return [{"inputs": [t.to(dtype) for t in inputs], "strided": strided, "what": what}
            for inputs, strided, what in cases]


# ---------------------------------------------------------------------------- zig-zag

def zigzag_positions(size: int, n: int, r: int) -> list[int]:
    """The positions (along the sequence) that rank ``r`` of ``n`` holds in the zig-zag layout:
    chunk r, then chunk 2n-1-r, of 2n chunks of size // 2n."""
    c = size // (2 * n)
    return [*range(r * c, (r + 1) * c), *range((2 * n - 1 - r) * c, (2 * n - r) * c)]


#: Group sizes and chunk lengths of the layouts the grader uses: the zig-zag checks' sizes are
#: 2n * (1, 2, 3), the ring's n * L = 2n * 4 (``ranks.L = 8``).
GROUP_SIZES, CHUNKS = (1, 2, 3, 4), (1, 2, 3, 4)


def public_cases() -> dict:
    """What ``public_cases.json`` holds: ``{"zigzag_positions": {n: {size: [positions of rank
    0, ..., rank n-1]}}}`` (string keys, as JSON has them)."""
    return {"zigzag_positions": {
        str(n): {str(2 * n * c): [zigzag_positions(2 * n * c, n, r) for r in range(n)]
                 for c in CHUNKS}
        for n in GROUP_SIZES}}


def public_cases_text() -> str:
    """The JSON text, one layout (n, size) per line."""
    layouts = public_cases()["zigzag_positions"]
    lines = [",\n".join(f'  "{n}": {{' + ", ".join(f'"{size}": {json.dumps(ranks)}'
                                                     for size, ranks in sizes.items()) + "}"
                        for n, sizes in layouts.items())]
    return '{"zigzag_positions": {\n' + lines[0] + "\n}}\n"


if __name__ == "__main__":
    PUBLIC_CASES.write_text(public_cases_text())
    print(f"wrote {PUBLIC_CASES}")
