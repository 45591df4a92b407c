"""Assignment 6's expectations, computed in the grader from the released text (not from the
student's code): the merge of two partial attentions in float64, full attention on the whole
sequence with its gradients, and one process training TinyCausalLM (the release's set-up cell)
on the whole sequence. Also the inputs of the merge checks."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from autograder.checking.reference import reference_cells

from . import ranks as R

INF = float("inf")


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


#: Shapes of the merge cases: (batch, heads, seq, head_dim).
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


def helper_cells(names) -> list | None:
    """The reference's cells for the graded functions a function is graded with."""
    return reference_cells("a6_context_parallel", ["setup", *names]) if names else None
