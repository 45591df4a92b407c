"""What each process of Assignment 4's checks runs, case by case (:mod:`.cases` runs the cases
and hands their results over), and the models and data it shares with the grader (BucketedDDP's
ranks: :mod:`.ddp_ranks`; apply_fsdp's: :mod:`.fsdp_ranks`).

Trusted harness code: a probe in the sandbox starts these on N processes and they return plain
data for the grader to judge. Every rank imports this module, so it imports nothing heavier
than torch (no pytest, no nbformat).
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.nn.functional as F
from torch import nn

from autograder.checking.collectives import collectives_counted
from autograder.checking.probes import describe
from course.collectives import watch_group


# ---------------------------------------------------------------------------- counting, sized

@contextlib.contextmanager
def collectives_sized(log: list | None = None):
    """While inside, each collective issued on the default process group is logged as
    ``(op, elements in its inputs, elements in its outputs)`` in the yielded list (``log``,
    where given: other events can go in between), point-to-point calls too; the ops as torch
    2.14.1's pre-hook names them, on every torch (:func:`course.collectives.watch_group`)."""
    log = [] if log is None else log

    def seen(op, inputs, outputs, peer):
        log.append((op, sum(t.numel() for t in inputs), sum(t.numel() for t in outputs)))

    with watch_group(None, seen):
        yield log


# ---------------------------------------------------------------------------- models and data

#: (input features, output features) of each model a ShardedOptimizer or apply_fsdp check trains.
SHAPES = {"mlp": (5, 2), "tiny": (1, 2), "even": (3, 3), "blocks": (3, 3), "sequential": (3, 3)}
#: apply_fsdp's models: float32, what mixed precision starts from (the others are float64).
FSDP_KINDS = ("blocks", "sequential")


class WithBlocks(nn.Module):
    """A model whose blocks are ``.blocks`` (an ``nn.ModuleList`` of residual tanh layers), with
    other submodules around them (``embed``, ``head``) whose parameters belong to the root."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def seeded_model(kind: str, seed: int) -> nn.Module:
    """The model of a case, the same on every rank and in the grader. ``mlp`` has 34 elements
    (not divisible by 3 or 4), ``tiny`` 4 (3 ranks leave rank 2 an empty shard), ``even`` 12
    (divisible by 1, 2 and 3: no padding, for the byte counts' cross-checks), all float64;
    ``blocks`` and ``sequential`` are apply_fsdp's two shapes of model, float32 (odd first
    dimensions: uneven Shard(0) chunks; the nn.Sequential's children alternate layers and
    parameterless activations, an activation last, so its last block, the last child that
    holds parameters, is not its last child); tanh, not ReLU, so no gradient element is zero in
    one summation order and not in another."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "mlp":
            return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        if kind == "tiny":
            return nn.Linear(1, 2).double()
        if kind == "even":
            return nn.Linear(3, 3).double()
        if kind == "blocks":
            return WithBlocks().float()
        if kind == "sequential":
            return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(),
                                 nn.Linear(4, 3), nn.Tanh()).float()
        raise ValueError(kind)


def fsdp_blocks(kind: str, model: nn.Module) -> list[nn.Module]:
    """The blocks of one of apply_fsdp's models, by the grader's knowledge of its kind."""
    return list(model.blocks) if kind == "blocks" else list(model.children())


def make_data(kind: str, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples (inputs, regression targets) in the dtype of ``kind``'s model, the same in
    every process."""
    g = torch.Generator().manual_seed(seed + 1)
    d_in, d_out = SHAPES[kind]
    dtype = torch.float32 if kind in FSDP_KINDS else torch.float64
    return (torch.randn(n, d_in, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(n, d_out, generator=g, dtype=torch.float64).to(dtype))


def step_rows(step: int, per_rank: int, world_size: int, rank: int | None = None) -> slice:
    """The rows of a step's global batch (``rank`` None) or of one rank's share of it."""
    start = step * per_rank * world_size
    if rank is None:
        return slice(start, start + per_rank * world_size)
    return slice(start + rank * per_rank, start + (rank + 1) * per_rank)


# ---------------------------------------------------------------------------- ShardedOptimizer

def optimizer_state_nbytes(optimizer) -> int:
    """Bytes of an optimizer's state tensors that have at least one dimension (not scalars
    such as AdamW's ``step``)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


def buffer_layout(params, padded: int) -> dict:
    """Where the parameters' values live: do they all view one storage, each contiguous, at
    consecutive offsets in the order given, with room for ``padded`` elements from the first?"""
    params = list(params)
    if not params:
        return {"one_storage": False, "in_order": False, "room": 0}
    first = params[0]
    ptr, base = first.untyped_storage().data_ptr(), first.storage_offset()
    offsets, at = [], base
    for p in params:
        offsets.append(p.storage_offset() == at and p.is_contiguous())
        at += p.numel()
    return {"one_storage": all(p.untyped_storage().data_ptr() == ptr for p in params),
            "in_order": all(offsets),
            "room": first.untyped_storage().nbytes() // first.element_size() - base}


def rank_sharded_optimizer_case(rank, world_size, i, case, cls, seed, steps, per_rank):
    """Case ``(model kind, optimizer name, kwargs)``: the model (equal on every rank), the
    student's ShardedOptimizer over its parameters and where they live afterwards, ``steps``
    steps of backward on this rank's share of the batch (mean squared error) then ``step()``,
    with the collectives issued inside ``step()`` logged; what the parameters, gradients and
    ``.optimizer`` ended as."""
    kind, optimizer_name, kwargs = case
    optimizer_cls = getattr(torch.optim, optimizer_name)
    model = seeded_model(kind, seed + i)
    X, y = make_data(kind, seed + i, steps * per_rank * world_size)
    numel = sum(p.numel() for p in model.parameters())
    opt = cls(model.parameters(), optimizer_cls, **kwargs)
    layout = buffer_layout(model.parameters(), world_size * -(-numel // world_size))
    logs, counts, grads_none = [], [], []
    for step in range(steps):
        rows = step_rows(step, per_rank, world_size, rank)
        F.mse_loss(model(X[rows]), y[rows]).backward()
        with collectives_counted(opt.step) as counted, collectives_sized() as log:
            opt.step()
        logs.append(list(log))
        counts.append(dict(counted))
        grads_none.append(all(p.grad is None for p in model.parameters()))
    inner = getattr(opt, "optimizer", None)
    is_optimizer = isinstance(inner, optimizer_cls)
    held = [p for g in inner.param_groups for p in g["params"]] if is_optimizer else []
    return {"params": describe([p.detach() for p in model.parameters()]),
            "grads_none": grads_none, "sized": logs, "counted": counts, "layout": layout,
            "optimizer": f"{type(inner).__module__}.{type(inner).__qualname__}",
            "is_optimizer": is_optimizer, "held": len(held),
            "owned": sum(p.numel() for p in held) if is_optimizer else None,
            "state_bytes": optimizer_state_nbytes(inner) if is_optimizer else None}


# ---------------------------------------------------------------------------- ShardedLinear

def linear_values(seed: int, in_f: int, out_f: int, bias: bool):
    """The full (weight, bias) that a case loads, float64, the same in every process."""
    g = torch.Generator().manual_seed(seed + 5)
    weight = torch.randn(out_f, in_f, generator=g, dtype=torch.float64)
    return weight, (torch.randn(out_f, generator=g, dtype=torch.float64) if bias else None)


def linear_inputs(seed: int, rank: int, batch: int, in_f: int, out_f: int):
    """Rank ``rank``'s input and the gradient its output receives (float64)."""
    g = torch.Generator().manual_seed(seed + 1009 * (rank + 1))
    return (torch.randn(batch, in_f, generator=g, dtype=torch.float64),
            torch.randn(batch, out_f, generator=g, dtype=torch.float64))


def _scan_only_what_comes_next() -> None:
    """From now on :func:`_alive_storages` sees only objects made after this call: everything
    alive now goes to the collector's permanent generation (``gc.freeze``), which
    ``gc.get_objects`` and ``gc.collect`` skip, and stays there (a rank lives for one run;
    ``gc.unfreeze`` would hand the rank's imports back to every later collection, see
    course.launch._worker). Why: a scan of every object of a rank that imported
    torch.distributed took about 0.2 s, several per case; a scan of what one case made takes
    microseconds. And why not weak references to the tensors the layer makes: a layer can keep
    a storage through an alias (``.data``, a view made in C++) whose tracked tensor is gone; the
    scan finds every live Python tensor, whatever made it."""
    gc.collect()
    gc.freeze()


def _alive_storages() -> dict[int, int]:
    """{storage address: elements} of the float64 storages that live Python tensors of this
    process hold (after :func:`_scan_only_what_comes_next`: those made since)."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        # the type, not isinstance: that reads obj.__class__, and deprecated objects in torch's
        # modules (torch.distributed.reduce_op) warn on every attribute read
        if issubclass(type(obj), torch.Tensor) and obj.dtype == torch.float64:
            try:
                storage = obj.untyped_storage()
            except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse)
                continue
            found[storage.data_ptr()] = storage.nbytes() // 8
    return found


def _largest_alive(exclude: set[int]) -> int:
    """Elements in the largest float64 storage alive now, except the storages in ``exclude``."""
    return max((n for ptr, n in _alive_storages().items() if ptr not in exclude), default=0)


def _largest_alive_settled(exclude: set[int], below: int, seconds: float = 2.0) -> int:
    """:func:`_largest_alive`, measured again every 10 ms for up to ``seconds`` while it is
    ``below`` or more elements. Why: gloo's worker thread marks a collective done before it drops
    its own reference to the work (and so to the output buffer); for a moment after the student's
    last reference is gone the buffer is still alive, and the reference layer failed this check
    now and then on a busy machine. A buffer the layer really keeps stays alive."""
    deadline = time.monotonic() + seconds
    while True:
        alive = _largest_alive(exclude)
        if alive < below or time.monotonic() >= deadline:
            return alive
        time.sleep(0.01)


def rank_sharded_linear_case(rank, world_size, i, case, cls, seed):
    """Case ``(in, out, bias, batch, input needs grad)``: the student's layer built under
    ``torch.manual_seed`` (float64 default dtype) and its initial parameters; then the case's
    full values loaded; forward on this rank's input with the saved tensors' sizes recorded and
    the largest tensor alive after it (on 2 or more ranks: on one, the shard is the whole layer
    and nothing is graded); backward of ``(out * grad).sum()``;
    collectives logged."""
    in_f, out_f, bias, batch, needs_grad = case
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        if world_size > 1:  # earlier cases' results are not this layer's
            _scan_only_what_comes_next()
        torch.manual_seed(seed + i)
        layer = cls(in_f, out_f, bias)
        initial = [p.detach().clone() for p in layer.parameters()]
        weight, b = linear_values(seed + i, in_f, out_f, bias)
        layer.load_full(weight, b) if bias else layer.load_full(weight)
        del weight, b
        x, grad_out = linear_inputs(seed + i, rank, batch, in_f, out_f)
        x.requires_grad_(needs_grad)
        saved, log = [], []

        def pack(t):
            saved.append(t.untyped_storage().nbytes() // max(t.element_size(), 1))
            return t

        with collectives_sized(log):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
            mine = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            alive = _largest_alive_settled(
                mine | {t.untyped_storage().data_ptr() for t in (x, y, grad_out)},
                below=in_f * out_f) if world_size > 1 else None
            (y * grad_out).sum().backward()
        params = list(layer.parameters())
        return {"initial": describe(initial), "output": describe(y.detach()),
                "input_grad": describe(x.grad) if needs_grad else describe(None),
                "params": describe([p.detach() for p in params]),
                "grads": describe([p.grad for p in params]),
                "sized": log, "saved": saved, "alive": alive}
    finally:
        torch.set_default_dtype(default)
