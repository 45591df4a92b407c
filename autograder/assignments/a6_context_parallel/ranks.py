"""What each process of Assignment 6's checks runs, and the inputs, groups and layouts it shares
with the grader (which rebuilds them from the same seeds to compute the float64 truth).

Trusted harness code: a probe starts these on 4 fresh processes with
:func:`autograder.checking.ranks.run_ranks`. One run covers every group size: each rank tries
the student's function on every group of :data:`GROUPS` it belongs to (the whole world with
``group=None``, a group of 3 without global rank 0, two pairs, and a group of 1 per rank),
which the harness creates itself before any student code runs. A group whose cases raised is
noted as ``(group index, "crash")`` (the error and the line of the student's code) and the rank
visits no later group: the groups before it keep their replies (:func:`visit_groups`). What a
rank sends and receives is seen by a pre-hook on every process group (point-to-point calls
included); the matmuls it computes by a ``TorchDispatchMode``; what the autograd graph of the
ring's output keeps for backward by ``saved_tensors_hooks`` and a walk of its custom Functions'
``ctx`` (:func:`held_for_backward`). Every rank imports this module, so it imports nothing
heavier than torch.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autograder.checking.collectives import calls_on_every_group
from autograder.checking.probes import describe

F64 = torch.float64
WORLD = 4
#: ``(label, global ranks, group=None?)`` of every group a run uses, in the order each rank
#: visits those it belongs to (the order makes the waits between groups acyclic).
GROUPS = [("the whole world of 4 processes (group=None)", (0, 1, 2, 3)),
          ("a group of global ranks [1, 2, 3] (without rank 0)", (1, 2, 3)),
          ("a group of global ranks [0, 1]", (0, 1)),
          ("a group of global ranks [2, 3]", (2, 3)),
          *((f"a group of 1 process (global rank {g})", (g,)) for g in range(WORLD))]
WHOLE_AND_PAIRS = (0, 2, 3)  # the groups of 4 and of 2 (training: n in {2, 4})
NOT_THREE = (0, 2, 3, 4, 5, 6, 7)  # Ulysses: n in {1, 2, 4}

#: Attention shapes: batch, heads, local sequence length, head_dim (head_dim <= L/2 and unlike
#: every key length a ring computes with: L and L/2).
B, H, L, D = 2, 2, 8, 3
#: Ring cases: (layout, causal, strided inputs, dtype).
RING_CASES = [("contiguous", False, True, "float64"), ("contiguous", True, False, "float64"),
              ("zigzag", True, False, "float64"), ("zigzag", False, True, "float64"),
              ("contiguous", True, True, "float32")]
#: Ulysses: heads (H/n >= 2 for n in {2, 4}), local length; heads that 4 or 2 ranks cannot split.
U_HEADS, U_L, U_BAD_HEADS = 8, 4, {4: 6, 2: 5}


def randn(seed: int, *shape, dtype=F64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


# ---------------------------------------------------------------------------- layouts

#: The zig-zag layouts the checks use, as values (``public_cases.json``, written from the
#: instructor's answer key): ``{n: {size: [positions of group rank 0, ..., n-1]}}``.
ZIGZAG = {int(n): {int(size): ranks for size, ranks in sizes.items()} for n, sizes in json.loads(
    (Path(__file__).with_name("public_cases.json")).read_text())["zigzag_positions"].items()}


def zigzag_positions(size: int, n: int, r: int) -> torch.Tensor:
    """The positions (along the sequence) that rank ``r`` of ``n`` holds in the zig-zag layout of
    a sequence of ``size``, from the table."""
    return torch.tensor(ZIGZAG[n][size][r], dtype=torch.int64)


def take(x: torch.Tensor, dim: int, n: int, r: int, layout: str) -> torch.Tensor:
    """Rank ``r``'s shard of the whole ``x`` along ``dim`` in ``layout``."""
    if layout == "zigzag":
        return x.index_select(dim, zigzag_positions(x.size(dim), n, r))
    part = x.size(dim) // n
    return x.narrow(dim, r * part, part)


def full_inputs(seed: int, n: int, heads: int = H, length: int = L, dtype: str = "float64"):
    """The whole q, k, v and dL/d(out) of a case on ``n`` ranks: (B, heads, n*length, D)."""
    return [randn(seed + i, B, heads, n * length, D, dtype=getattr(torch, dtype))
            for i in range(4)]


# ---------------------------------------------------------------------------- what a rank sees

_MATMULS = {"mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul", "mv", "addmv", "dot"}


class MatmulCounter(TorchDispatchMode):
    """Records the largest output of every matmul-like op, and the "score entries": the output
    elements of those whose last dimension is not ``head_dim`` (q k^T, dO v^T), an attention
    kernel counting as Lq x Lk per batch and head."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch._dynamo.disable around __torch_dispatch__: it would import torch._dynamo
        (seconds in every rank of every run), and nothing here is compiled."""
        return False

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim, self.largest, self.scores = head_dim, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _MATMULS and isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
            if out.dim() == 0 or out.shape[-1] != self.head_dim:
                self.scores += out.numel()
        elif "scaled_dot_product" in name and len(args) >= 2:
            q, k = args[0], args[1]
            entries = q.numel() // max(q.shape[-1], 1) * k.shape[-2]
            self.largest = max(self.largest, entries)
            self.scores += entries
        return out

    def result(self) -> dict:
        return {"largest": self.largest, "scores": self.scores}


def _error(exc) -> str:
    return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300]


def error_of(call) -> str:
    """What ``call()`` raised, as ``"Type: message"`` ("nothing" if it returned)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        return _error(exc)
    return "nothing"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.int64 if t.element_size() == 8 else torch.int32)


def unchanged(before: list, after: list) -> bool:
    """Bit for bit (NaN and inf included)."""
    return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(before, after))


def crash_of(exc) -> str:
    """``"Type: message"`` and the innermost frame of the notebook's code (the student's line)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<")]
    where = ""
    if frames:
        line = (frames[-1].line or "").strip()
        where = f" (in {frames[-1].name}, line {frames[-1].lineno}" + (f": {line})" if line
                                                                       else ")")
    return (_error(exc) + where)[:500]


def visit_groups(rank, body, which=None) -> dict:
    """``body(out, i, group, n, r)`` on each group of :data:`GROUPS` (among ``which``) that
    holds ``rank``, in order; the first one that raises is noted as ``out[(i, "crash")]`` and
    ends the visit (its peers may be waiting on this rank: they time out there and stop too)."""
    out: dict = {}
    for i, group, n, r in my_groups(rank, which):
        try:
            body(out, i, group, n, r)
        except Exception as exc:  # noqa: BLE001 - reported to the grader, with its group
            out[(i, "crash")] = crash_of(exc)
            break
    return out


def make_groups():
    """Every group of :data:`GROUPS` (all ranks create all, in order); None for the world."""
    return [None if len(ranks) == WORLD else dist.new_group(list(ranks)) for _, ranks in GROUPS]


def my_groups(rank: int, which=None):
    """``(index, group, n, r)`` for each group of :data:`GROUPS` (among ``which``) that holds
    ``rank``."""
    groups = make_groups()
    out = []
    for i, (_, ranks) in enumerate(GROUPS):
        if rank in ranks and (which is None or i in which):
            out.append((i, groups[i], len(ranks), ranks.index(rank)))
    return out


def _leaf(x: torch.Tensor, strided: bool):
    """``(what the function gets, the leaf whose .grad is the gradient, as (B, H, L, D))``:
    a non-contiguous view (B, H, L, D) of a (B, L, H, D) leaf when ``strided``."""
    if not strided:
        leaf = x.clone().requires_grad_()
        return leaf, leaf, lambda g: g
    leaf = x.transpose(1, 2).contiguous().requires_grad_()
    return leaf.transpose(1, 2), leaf, lambda g: g.transpose(1, 2)


def attention_case(fn, seed, n, r, *, layout="contiguous", strided=False, heads=H,
                   length=L, dtype="float64", count=False) -> dict:
    """This rank's q, k, v (shards of the whole ones in ``layout``), ``fn(q, k, v)``, backward
    of dL/d(out); the output, gradients, whether inputs stayed as they were, what each pass sent
    and (``count``) the matmuls it computed."""
    Q, K, V, dO = (take(t, 2, n, r, layout) for t in full_inputs(seed, n, heads, length, dtype))
    views = [_leaf(t, strided) for t in (Q, K, V)]
    args = [v for v, _, _ in views]
    before = [a.detach().clone() for a in args]
    counter = MatmulCounter(D) if count else contextlib.nullcontext()
    saved: list = []
    with calls_on_every_group() as forward, counter, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    fwd = counter.result() if count else None
    held = held_for_backward(out, saved) if count else None
    saved.clear()
    counter = MatmulCounter(D) if count else contextlib.nullcontext()
    backward_ran = isinstance(out, torch.Tensor) and out.requires_grad and out.shape == dO.shape
    with calls_on_every_group() as backward, counter:
        if backward_ran:
            (out * dO).sum().backward()
    grads = [None if leaf.grad is None else back(leaf.grad) for _, leaf, back in views]
    return {"out": describe(out), "grads": describe(grads), "backward_ran": backward_ran,
            "unchanged": unchanged(before, [a.detach() for a in args]),
            "forward": forward, "backward": backward, "held": held,
            "count_forward": fwd, "count_backward": counter.result() if count else None}


def held_for_backward(out, saved: list) -> int:
    """Elements of the distinct storages that ``out``'s autograd graph keeps for backward: the
    tensors saved through ``saved_tensors_hooks`` (``ctx.save_for_backward`` and autograd's own
    ops) and those kept on the ``ctx`` of its custom Functions (also inside lists, tuples, dicts
    and plain objects there). A storage counts whole, once, in elements of the tensor seen in
    it."""
    storages: dict = {}

    def note(t):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            s = t.untyped_storage()
            if s.nbytes():
                key = s.data_ptr()
                storages[key] = max(storages.get(key, 0), s.nbytes() // max(t.element_size(), 1))

    def walk(x, depth, seen):
        if isinstance(x, torch.Tensor):
            return note(x)
        if depth > 4 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, dict):
            items = x.values()
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = x
        elif hasattr(x, "__dict__") and not isinstance(x, type) and \
                type(x).__module__.split(".")[0] not in ("torch", "builtins"):
            items = vars(x).values()
        else:
            return
        for item in items:
            walk(item, depth + 1, seen)

    for t in saved:
        note(t)
    nodes, seen_nodes, seen = [getattr(out, "grad_fn", None)], set(), set()
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            for item in vars(node).values():
                walk(item, 1, seen)
        nodes.extend(f for f, _ in getattr(node, "next_functions", ()))
    return sum(storages.values())


def rank_ring(rank, world_size, fn, seed):
    def body(out, i, group, n, r):
        for c, (layout, causal, strided, dtype) in enumerate(RING_CASES):
            call = functools.partial(fn, causal=causal, group=group, layout=layout)
            out[(i, c)] = attention_case(call, seed + 100 * n + 10 * c, n, r, layout=layout,
                                         strided=strided, dtype=dtype, count=True)
    return visit_groups(rank, body)


def rank_ulysses(rank, world_size, fn, seed):
    def body(out, i, group, n, r):
        for c, causal in enumerate((False, True)):
            call = functools.partial(fn, causal=causal, group=group)
            out[(i, c)] = attention_case(call, seed + 100 * n + 10 * c, n, r, heads=U_HEADS,
                                         length=U_L)
        if n == 1:
            return
        bad = [randn(seed + 7, B, U_BAD_HEADS[n], U_L, D) for _ in range(3)]
        with calls_on_every_group() as sent:
            out[(i, "bad")] = {"error": error_of(lambda: fn(*bad, group=group)),
                               "traffic": sent}
    return visit_groups(rank, body, NOT_THREE)


# ---------------------------------------------------------------------------- zig-zag

#: Zig-zag cases: (shape with the sharded size as c * 2n where it is None, dim).
ZIGZAG_CASES = [((None, 3), 0), ((2, None, 3), -2), ((2, 3, None), -1), ((2, 2, None, 2), 2)]


def zigzag_shape(shape, n: int, c: int = 2):
    return tuple(c * 2 * n if s is None else s for s in shape)


def _zigzag_case(shard, unshard, x, dim, n, r, group, upstream) -> dict:
    """zigzag_shard of the whole ``x`` (with its gradient and the traffic, which must be none),
    zigzag_unshard of the trusted shard, and the round trip through both."""
    case: dict = {}
    mine = x.clone().requires_grad_()
    try:
        with calls_on_every_group() as sent:
            got = shard(mine, dim, group)
        case.update(shard=describe(got), shard_traffic=sent)
        if isinstance(got, torch.Tensor) and got.requires_grad and got.shape == upstream.shape:
            (got * upstream).sum().backward()
        case.update(shard_grad=describe(mine.grad), shard_unchanged=unchanged([x], [mine]))
    except Exception as exc:  # noqa: BLE001 - reported to the grader
        case["shard_error"] = _error(exc)
    local = take(x, dim, n, r, "zigzag")
    try:
        case["unshard"] = describe(unshard(local.clone(), dim, group))
        if "shard_error" not in case:
            case["round_trip"] = describe(shard(unshard(local.clone(), dim, group), dim, group))
    except Exception as exc:  # noqa: BLE001
        case["unshard_error"] = _error(exc)
    return case


def rank_zigzag(rank, world_size, fns, seed):
    shard, unshard = fns

    def body(out, i, group, n, r):
        for c, (shape, dim) in enumerate(ZIGZAG_CASES):
            x = randn(seed + 10 * c + n, *zigzag_shape(shape, n, 1 + c % 3))
            upstream = randn(seed + 5 + 10 * c, *take(x, dim, n, r, "zigzag").shape)
            out[(i, c)] = _zigzag_case(shard, unshard, x, dim, n, r, group, upstream)
        odd = randn(seed + 3, 2, 2 * n + 1, 2)
        out[(i, "bad")] = {"shard": error_of(lambda: shard(odd, 1, group)),
                           "unshard": error_of(lambda: unshard(odd[:, :3], 1, group))}
    return visit_groups(rank, body)


# ---------------------------------------------------------------------------- training

#: TinyCausalLM's size in the training checks, batch, whole sequence (divisible by 2 and 4), steps.
MODEL = dict(vocab=11, dim=16, heads=4, max_len=20)
T_BATCH, T_SEQ, T_STEPS, T_LR = 2, 16, 3, 0.2
#: The modes the training checks run (each on the world and on pairs), before an unknown one.
T_MODES = ("ring", "ring_zigzag", "ulysses")


def model_class(setup_source: str):
    """TinyCausalLM from the trusted set-up cell's text: its class definition and the imports
    before it (not the rest of the cell)."""
    def wanted(node):
        if isinstance(node, ast.ClassDef):
            return node.name == "TinyCausalLM"
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        return bool(names) and all(m.split(".")[0] in ("torch", "math") for m in names)

    keep = [node for node in ast.parse(setup_source).body if wanted(node)]
    ns: dict = {"__name__": "__a6_setup__"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "<set-up cell>", "exec"), ns)
    return ns["TinyCausalLM"]


def seeded_model(setup_source: str, seed: int):
    """``model_fn``: the same float64 TinyCausalLM on every call, in every process."""
    cls = model_class(setup_source)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(**MODEL).to(F64)


def train_tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL["vocab"], (T_BATCH, T_SEQ + 1), generator=g)


def rank_train(rank, world_size, fn, seed, setup_source):
    model_fn = functools.partial(seeded_model, setup_source, seed)
    tokens = train_tokens(seed + 1)

    def body(out, i, group, n, r):
        for mode in T_MODES:
            result = fn(model_fn, tokens.clone(), mode=mode, steps=T_STEPS, lr=T_LR,
                        group=group)
            losses, params = result if isinstance(result, (tuple, list)) and len(result) == 2 \
                else (None, None)
            out[(i, mode)] = {"losses": describe(losses), "params": describe(
                [p.detach() if isinstance(p, torch.Tensor) else p for p in params]
                if isinstance(params, (list, tuple)) else params)}
        with calls_on_every_group() as sent:
            error = error_of(lambda: fn(model_fn, tokens.clone(), mode="megatron", steps=1,
                                        lr=T_LR, group=group))
        out[(i, "bad")] = {"error": error, "traffic": sent}
    return visit_groups(rank, body, WHOLE_AND_PAIRS)


def causal_attention(q, k, v):
    """The grader's own plain causal attention (one process, the whole sequence)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
