"""Assignment 6's expectations, computed in the grader from the released text (not from the
student's code) with torch's own ops in float64: attention over the concatenated keys of two
parts (the truth of the public merge check, and its inputs), full attention on the whole
sequence with its gradients, and one process training TinyCausalLM (the release's set-up cell)
on the whole sequence. No graded function is re-implemented here: the hidden merge cases and
their reference are in the instructor's answer key."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import ranks as R

INF = float("inf")


# ---------------------------------------------------------------------------- merge

#: The public merge cases: (batch, heads, queries, head_dim) and the keys of parts A and B.
MERGE_SHAPE, KEYS_A, KEYS_B = (2, 3, 7, 4), 5, 3


def attention_over(scores: torch.Tensor, v: torch.Tensor):
    """``(out, lse)`` of softmax attention with these (scaled, biased) scores, by torch's own
    ops: ``softmax(scores) @ v`` and ``logsumexp(scores)`` (a row of -inf scores gives NaN and
    -inf, as a fully masked row does)."""
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def merge_parts(g: torch.Generator, dtype) -> list[dict]:
    """Public merge cases: queries against keys A (5) and B (3), each part's ``(out, lse)`` from
    torch's ops on its own keys, and the truth from the same ops over the concatenated keys, in
    float64: ``{"inputs": [out_a, lse_a, out_b, lse_b] in dtype, "out", "lse" (float64 truth),
    "strided", "what"}``. A per-row offset of each part's scores (an additive score bias, as
    ALiBi or an attention mask of floats) moves the lse to around 0, near +1000 and near -1000;
    -inf masks rows: rows 0-2 of every head of the masked case are masked in A, in B, in both
    (a masked part's out row comes out NaN, or is set to inf). The float64 inputs to the ops
    are values of ``dtype``, so the truth is that of what a float32 run starts from too."""
    b, h, s, d = MERGE_SHAPE

    def case(centre, spread, masked=False):
        q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, h, KEYS_A + KEYS_B, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, h, KEYS_A + KEYS_B, d, generator=g, dtype=torch.float64)
        bias = centre + spread * torch.randn(b, h, s, 2, generator=g, dtype=torch.float64)
        q, k, v, bias = (t.to(dtype).double() for t in (q, k, v, bias))
        if masked:
            bias[:, :, 0, 0] = bias[:, :, 1, 1] = bias[:, :, 2, 0] = bias[:, :, 2, 1] = -INF
        per_key = torch.cat([bias[..., :1].expand(-1, -1, -1, KEYS_A),
                             bias[..., 1:].expand(-1, -1, -1, KEYS_B)], -1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d) + per_key
        out_a, lse_a = attention_over(scores[..., :KEYS_A], v[:, :, :KEYS_A])
        out_b, lse_b = attention_over(scores[..., KEYS_A:], v[:, :, KEYS_A:])
        if masked:
            out_b[:, :, 1] = INF                       # anything may stand in a masked row
        out, lse = attention_over(scores, v)
        return [out_a, lse_a, out_b, lse_b], out, lse

    cases = [(case(0.0, 3.0), False, "lse around 0"),
             (case(1000.0, 4.0), True, "lse near +1000 (strided views)"),
             (case(-1000.0, 4.0), False, "lse near -1000"),
             (case(2.0, 3.0, masked=True), True, "rows masked in one part (their out NaN or "
                                                 "inf) and in both (strided views)")]
    return [{"inputs": [t.to(dtype) for t in inputs], "out": out, "lse": lse,
             "strided": strided, "what": what}
            for (inputs, out, lse), strided, what in cases]


# ---------------------------------------------------------------------------- attention

@functools.lru_cache(maxsize=64)
def attention(seed: int, n: int, causal: bool, heads: int, length: int, dtype: str):
    """Full attention on the whole sequence of a case and the gradients of q, k, v:
    ``(float64 [out, dq, dk, dv], the same computed in float32 or None)``. The float64 truth is
    computed from the very inputs the ranks got (float32 ones where the case is float32)."""
    inputs = R.full_inputs(seed, n, heads, length, dtype)

    def run(tensors):
        q, k, v = (t.clone().requires_grad_() for t in tensors[:3])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        (out * tensors[3]).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    return run([t.double() for t in inputs]), (run(inputs) if dtype == "float32" else None)


# ---------------------------------------------------------------------------- training

def setup_source() -> str:
    """The release's set-up cell (trusted: the student's copy never reaches the grader)."""
    from ...notebook import runnable_cells
    from ...registry import get

    ((_, source),) = runnable_cells(get("a6_context_parallel").release, ["setup"])
    return source


def one_process_training(seed: int, source: str):
    """``(losses, params)``: plain SGD in one process on the whole sequence, the grader's own
    causal attention, the mean cross-entropy over all tokens."""
    model = R.seeded_model(source, seed)
    tokens = R.train_tokens(seed + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.size(1))
    losses = []
    for _ in range(R.T_STEPS):
        model.zero_grad(set_to_none=True)
        logits = model(inputs, positions, R.causal_attention)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= R.T_LR * p.grad
    return losses, [p.detach().clone() for p in model.parameters()]
