"""Assignment 4's expectations, computed in the grader from the released contracts (not from
the student's code), independently of the functions the students write: each rank's chunk of a
flat vector as ``torch.chunk`` cuts it, the optimizer state torch's own optimizers keep,
one-process training with the same optimizer on the full batch, dense layers and models in
float64. (The reference implementations of the graded functions live in the answer key,
``solutions/a4_sharding/answer_key.py``, which the student edition has not.)"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .ranks import make_data, optimizer_state_nbytes, seeded_model, step_rows


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Every rank's ``(start, end)`` in a flat vector of ``numel`` elements split over ``world``
    ranks, as the text promises them (Part 3): the chunks of ``torch.chunk`` (ceil(numel /
    world) elements each, the last one fewer), ``(numel, numel)`` (empty) for the ranks past
    the last chunk. Computed by torch on the elements' indices; for the grader's small
    vectors (layers and models of at most a few dozen elements or rows)."""
    chunks = [c for c in torch.arange(numel).chunk(world) if c.numel()]
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    return bounds + [(numel, numel)] * (world - len(bounds))


def optimizer_state_of(optimizer_name: str, kwargs: dict, elements: int) -> int:
    """Bytes of the state tensors (not scalars) that ``torch.optim.<optimizer_name>(**kwargs)``
    keeps for one float64 parameter of ``elements`` elements after a step: what
    ``.optimizer`` over a shard of that size keeps (torch's own count, computed here)."""
    param = torch.zeros(elements, dtype=torch.float64, requires_grad=True)
    param.grad = torch.ones_like(param)
    optimizer = getattr(torch.optim, optimizer_name)([param], **kwargs)
    optimizer.step()
    return optimizer_state_nbytes(optimizer)


def one_process(kind: str, seed: int, optimizer_name: str, kwargs: dict, steps: int,
                per_rank: int, world_size: int) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of ``optimizer_name`` in one process on each step's
    full batch (float64): what every rank's sharded training must equal."""
    model = seeded_model(kind, seed)
    X, y = make_data(kind, seed, steps * per_rank * world_size)
    opt = getattr(torch.optim, optimizer_name)(model.parameters(), **kwargs)
    for step in range(steps):
        rows = step_rows(step, per_rank, world_size)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(X[rows]), y[rows]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def one_process_ddp(seed: int, shape, steps: int, per_rank: int, world_size: int, lr: float
                    ) -> tuple[list[list[torch.Tensor | None]], list[int]]:
    """(each step's gradients of the managed parameters in one process on the full batch, with
    rank 0's model and the same SGD between steps; the managed parameters' sizes)."""
    from .ddp_ranks import ddp_model, ddp_seed

    width = shape[0]
    model = ddp_model(ddp_seed(seed, 0), shape)
    managed = [p for p in model.parameters() if p.requires_grad]
    X, y = (torch.randn(steps * per_rank * world_size, width, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed + i)) for i in (1, 2))
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        rows = step_rows(step, per_rank, world_size)
        F.mse_loss(model(X[rows]), y[rows]).backward()
        out.append([None if p.grad is None else p.grad.detach().clone() for p in managed])
        with torch.no_grad():
            for p in managed:
                if p.grad is not None:
                    p -= lr * p.grad
    return out, [p.numel() for p in managed]


def linear_case(seed: int, case, world_size: int) -> dict:
    """What every rank of a ShardedLinear case must see: its initial shard (``nn.Linear`` under
    ``torch.manual_seed(seed)`` in float64), each rank's output and input gradient, and each
    rank's slice of the mean over ranks of the dense weight and bias gradients."""
    from .ranks import linear_inputs, linear_values

    in_f, out_f, bias, batch, _ = case
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(seed)
        dense = torch.nn.Linear(in_f, out_f, bias)
    finally:
        torch.set_default_dtype(default)
    flat_init = torch.cat([t.detach().reshape(-1) for t in dense.parameters()])
    weight, b = linear_values(seed, in_f, out_f, bias)
    outputs, input_grads, grads = [], [], []
    for rank in range(world_size):
        x, grad_out = linear_inputs(seed, rank, batch, in_f, out_f)
        outputs.append(F.linear(x, weight, b))
        input_grads.append(grad_out @ weight)
        parts = [(grad_out.T @ x).reshape(-1)] + ([grad_out.sum(0)] if bias else [])
        grads.append(torch.cat(parts))
    mean = torch.stack(grads).mean(0)
    numel = flat_init.numel()
    bounds = chunk_bounds(numel, world_size)
    return {"numel": numel, "weight_numel": in_f * out_f, "bounds": bounds,
            "initial": [flat_init[s:e] for s, e in bounds], "outputs": outputs,
            "input_grads": input_grads, "grads": [mean[s:e] for s, e in bounds]}


def fsdp_local_shapes(kind: str, shards: int, coordinate: int) -> list[tuple[str, list[int]]]:
    """(name, local shape) of each parameter of ``kind`` sharded on dim 0 over ``shards``
    ranks: the chunk of its rows that the rank at ``coordinate`` holds (FSDP2 chunks dim 0 as
    ``torch.chunk`` does: ceil(rows / shards) rows each, the last ones fewer; Part 3's bounds,
    :func:`chunk_bounds`)."""
    out = []
    for name, p in seeded_model(kind, 0).named_parameters():
        start, end = chunk_bounds(p.shape[0], shards)[coordinate]
        out.append((name, [end - start, *p.shape[1:]]))
    return out


#: One bfloat16 rounding, relative: 8 bits of significand.
BF16_ULP = 2.0 ** -8


def bf16_tolerance(references64: list, references_bf16: list) -> float:
    """One absolute tolerance for all the results of one computation done in bfloat16 with
    float32 reductions: twice how far the same computation done densely in the grader strays
    from float64, at most over all the results (per tensor the stray is a noisy estimate:
    :func:`autograder.checking.expect.float32_tolerance_of_all`), plus one bfloat16 rounding of
    the largest result."""
    stray = max((b - r).abs().max().item() for r, b in zip(references64, references_bf16))
    scale = max(r.abs().max().item() for r in references64)
    return 2 * stray + BF16_ULP * scale


def fsdp_case(kind: str, seed: int, per_rank: int, world_size: int) -> dict:
    """What one forward and backward of apply_fsdp's model must give, each rank on its share
    of the batch: each rank's output and the gradients of the mean loss, in float64 (the dense
    model), within :func:`bf16_tolerance` of the same computation in bfloat16 (the parameters
    and inputs rounded to bf16, each rank's backward in bf16, the ranks' gradients summed in
    float32 and divided by the number of ranks)."""
    from .fsdp_ranks import cap_onednn

    cap_onednn()
    model = seeded_model(kind, seed)
    X, y = make_data(kind, seed, per_rank * world_size)
    ranks = [step_rows(0, per_rank, world_size, r) for r in range(world_size)]
    exact = copy.deepcopy(model).double()
    outputs = [exact(X[rows].double()) for rows in ranks]
    torch.stack([F.mse_loss(o, y[rows].double()) for o, rows in zip(outputs, ranks)]
                ).mean().backward()
    outputs = [o.detach() for o in outputs]
    grads = [p.grad.detach() for p in exact.parameters()]
    low = copy.deepcopy(model).to(torch.bfloat16)
    low_outputs = []
    low_grads = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    for rows in ranks:  # each rank's bf16 backward, reduced in float32
        low.zero_grad(set_to_none=True)
        out = low(X[rows].to(torch.bfloat16))
        F.mse_loss(out.float(), y[rows]).backward()
        low_outputs.append(out.detach().double())
        for total, p in zip(low_grads, low.parameters()):
            total += p.grad.float()
    low_grads = [(g / world_size).double() for g in low_grads]
    return {"outputs": outputs, "output_tol": bf16_tolerance(outputs, low_outputs),
            "grads": grads, "grad_tol": bf16_tolerance(grads, low_grads),
            "bf16_outputs": low_outputs, "bf16_grads": low_grads}
