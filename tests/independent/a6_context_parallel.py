'''Assignment 6 answered a second time, from the released notebook's text alone.

Written from ``assignments/a6_context_parallel/context_parallel.ipynb`` (its markdown, its set-up
cell, which imports ``math``, ``torch``, ``dist``, ``F``, ``nn``, ``check``, ``launch`` and
defines ``TinyCausalLM``, and the answer stubs) and PyTorch's own documentation of
``dist.isend``/``dist.irecv``/``dist.get_global_rank``/``dist.all_to_all_single``, not from the
reference solution, the grader or its tests: if it loses points, the text (or a check) asks for
something it does not say. Keys are the answer cells' grade ids.

Deliberately other choices than a typical solution's:

- ``merge_attention`` takes the larger lse as the pivot and adds ``log1p`` of the smaller one's
  share, and drops a dead part's term with ``torch.where`` (never ``0 * out``);
- ``zigzag_shard`` builds the shard from two ``narrow``s; ``zigzag_unshard`` all-gathers into a
  list and stitches the ``2n`` chunks back from the first and second halves of the pieces;
- ``ring_attention`` keeps its group, size, rank and neighbours' global ranks in a small frozen
  dataclass (picotron/Megatron style), sends K and V as two separate tensors with separate
  ``isend``/``irecv`` calls (each its own tag) posted before a step's compute and waited after
  it, accumulates the forward flash-attention style (running row max, row sum and unnormalised
  output; it never calls ``merge_attention``), plans the (query rows, key columns, diagonal)
  block of each step in one helper that forward and backward share, and writes the backward
  as a separate function in which the gradients of K and V travel home behind their blocks;
- ``ulysses_attention`` packs q, k and v into one tensor (two all-to-alls in all) and uses its
  own ``torch.autograd.Function`` around ``dist.all_to_all_single`` (even splits make the
  backward the same all-to-all);
- ``train_cp`` uses ``torch.optim.SGD`` (no momentum, no weight decay: the same
  ``p -= lr * p.grad``), all-reduces the gradients flattened into one buffer, and picks the
  zig-zag positions with ``index_select`` of its own position list (not ``zigzag_shard``).
'''

ANSWERS = {
    "merge_attention": '''\
def merge_attention(out_a, lse_a, out_b, lse_b):
    """The attention over the union of two disjoint key sets, from the two partial results."""
    dead_a = torch.isneginf(lse_a)
    dead_b = torch.isneginf(lse_b)
    high = torch.maximum(lse_a, lse_b)
    low = torch.minimum(lse_a, lse_b)
    both_dead = torch.isneginf(high)
    pivot = torch.where(both_dead, torch.zeros_like(high), high)
    # low - pivot <= 0, so exp never overflows; with low = -inf the share is exactly 0
    lse = pivot + torch.log1p(torch.exp(low - pivot))
    lse = torch.where(both_dead, torch.full_like(lse, float("-inf")), lse)
    safe_lse = torch.where(both_dead, torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe_lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - safe_lse).unsqueeze(-1)
    zero = torch.zeros((), dtype=out_a.dtype, device=out_a.device)
    part_a = torch.where(dead_a.unsqueeze(-1), zero, weight_a * out_a)
    part_b = torch.where(dead_b.unsqueeze(-1), zero, weight_b * out_b)
    return part_a + part_b, lse
''',
    "zigzag_shard": '''\
def _zigzag_dim(x, dim):
    return dim % x.dim() if x.dim() else dim


def zigzag_shard(x, dim, group=None):
    """This rank's zig-zag shard of the whole tensor x along dim: chunk r, then chunk 2n-1-r."""
    n = dist.get_world_size(group)
    r = dist.get_rank(group)
    dim = _zigzag_dim(x, dim)
    size = x.size(dim)
    if size % (2 * n) != 0:
        raise ValueError(f"size {size} along dim {dim} is not a multiple of 2n = {2 * n}")
    c = size // (2 * n)
    first = x.narrow(dim, r * c, c)
    second = x.narrow(dim, (2 * n - 1 - r) * c, c)
    return torch.cat([first, second], dim=dim)


def zigzag_unshard(x_local, dim, group=None):
    """The whole tensor, on every rank, from each rank's zig-zag shard along dim."""
    n = dist.get_world_size(group)
    dim = _zigzag_dim(x_local, dim)
    size = x_local.size(dim)
    if size % 2 != 0:
        raise ValueError(f"a zig-zag shard has an even size along dim {dim}, not {size}")
    c = size // 2
    local = x_local.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(pieces, local, group=group)
    chunks = [None] * (2 * n)
    for rank, piece in enumerate(pieces):
        chunks[rank] = piece.narrow(dim, 0, c)
        chunks[2 * n - 1 - rank] = piece.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)
''',
    "ring_attention": '''\
from dataclasses import dataclass


@dataclass(frozen=True)
class RingGroup:
    """A process group seen as a ring: its size, this rank in it, and the global ranks of the
    next rank (where blocks go) and the previous one (where they come from)."""
    group: object
    size: int
    rank: int
    next_global: int
    prev_global: int

    @classmethod
    def of(cls, group):
        group = group if group is not None else dist.group.WORLD
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return cls(group, n, r, dist.get_global_rank(group, (r + 1) % n),
                   dist.get_global_rank(group, (r - 1) % n))

    def source(self, step):
        """Group rank whose K/V block this rank holds at `step`."""
        return (self.rank - step) % self.size

    def shift(self, tensors, first_tag):
        """Start passing `tensors` to the next rank, one message each, and receiving the
        previous rank's; `finish()` of the result waits and gives the received tensors."""
        return _Shift(self, tensors, first_tag)


class _Shift:
    def __init__(self, ring, tensors, first_tag):
        self.outgoing = [t.contiguous() for t in tensors]
        self.incoming = [torch.empty_like(t) for t in self.outgoing]
        self.works = []
        for i, buf in enumerate(self.incoming):
            self.works.append(dist.irecv(buf, src=ring.prev_global, group=ring.group,
                                         tag=first_tag + i))
        for i, t in enumerate(self.outgoing):
            self.works.append(dist.isend(t, dst=ring.next_global, group=ring.group,
                                         tag=first_tag + i))

    def finish(self):
        for work in self.works:
            work.wait()
        return tuple(self.incoming)


def _plan(ring, step, length, causal, layout):
    """(query rows, key columns, diagonal?) of this step's block, or None where the causal mask
    hides it all. Forward and backward use the same plan."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    src = ring.source(step)
    if src == ring.rank:
        return everything, everything, True
    if layout == "contiguous":
        return (everything, everything, False) if src < ring.rank else None
    half = length // 2
    if src < ring.rank:          # every query sees the first chunk (chunk src) of the keys
        return everything, slice(0, half), False
    return slice(half, length), everything, False   # the second query chunk sees all keys


def _scores(q_rows, k_cols, diagonal, scale):
    s = torch.matmul(q_rows, k_cols.transpose(-2, -1)) * scale
    if diagonal:
        size = s.size(-1)
        hidden = torch.ones(size, size, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _ring_forward(q, k, v, causal, ring, layout):
    batch, heads, length, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim)
    numerator = torch.zeros(batch, heads, length, head_dim, dtype=q.dtype, device=q.device)
    row_max = torch.full((batch, heads, length), float("-inf"), dtype=q.dtype, device=q.device)
    row_sum = torch.zeros(batch, heads, length, dtype=q.dtype, device=q.device)
    block = (k, v)
    for step in range(ring.size):
        pending = ring.shift(block, 0) if step < ring.size - 1 else None
        plan = _plan(ring, step, length, causal, layout)
        if plan is not None:
            rows, cols, diagonal = plan
            s = _scores(q[:, :, rows], block[0][:, :, cols], diagonal, scale)
            old_max = row_max[:, :, rows]
            new_max = torch.maximum(old_max, s.amax(dim=-1))
            p = torch.exp(s - new_max.unsqueeze(-1))
            decay = torch.exp(old_max - new_max)
            row_sum[:, :, rows] = row_sum[:, :, rows] * decay + p.sum(dim=-1)
            numerator[:, :, rows] = (numerator[:, :, rows] * decay.unsqueeze(-1)
                                     + torch.matmul(p, block[1][:, :, cols]))
            row_max[:, :, rows] = new_max
        if pending is not None:
            block = pending.finish()
    out = numerator / row_sum.unsqueeze(-1)
    lse = row_max + torch.log(row_sum)
    return out, lse


def _ring_backward(grad_out, q, k, v, out, lse, causal, ring, layout):
    """dQ stays home; K/V go around once more (n-1 hops) and the accumulators of their
    gradients follow them, n hops, so that each comes back to its owner complete."""
    length, head_dim = q.size(-2), q.size(-1)
    scale = 1.0 / math.sqrt(head_dim)
    delta = (grad_out * out).sum(dim=-1)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    block = (k, v)
    for step in range(ring.size):
        pending = ring.shift(block, 0) if step < ring.size - 1 else None
        plan = _plan(ring, step, length, causal, layout)
        if plan is not None:
            rows, cols, diagonal = plan
            q_rows, g_rows = q[:, :, rows], grad_out[:, :, rows]
            k_cols, v_cols = block[0][:, :, cols], block[1][:, :, cols]
            p = torch.exp(_scores(q_rows, k_cols, diagonal, scale)
                          - lse[:, :, rows].unsqueeze(-1))
            dv[:, :, cols] += torch.matmul(p.transpose(-2, -1), g_rows)
            dp = torch.matmul(g_rows, v_cols.transpose(-2, -1))
            ds = p * (dp - delta[:, :, rows].unsqueeze(-1)) * scale
            dq[:, :, rows] += torch.matmul(ds, k_cols)
            dk[:, :, cols] += torch.matmul(ds.transpose(-2, -1), q_rows)
        if ring.size > 1:
            dk, dv = ring.shift((dk, dv), 2).finish()
        if pending is not None:
            block = pending.finish()
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, ring, layout):
        out, lse = _ring_forward(q, k, v, causal, ring, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.ring, ctx.layout = causal, ring, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.ring,
                                    ctx.layout)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, causal=False, group=None, layout="contiguous"):
    """This rank's shard of attention over the whole sequence; K/V travel around a ring."""
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"unknown layout {layout!r}")
    if layout == "zigzag" and q.size(-2) % 2 != 0:
        raise ValueError("the zig-zag layout needs an even local length")
    return _RingAttention.apply(q, k, v, bool(causal), RingGroup.of(group), layout)
''',
    "ulysses_attention": '''\
class _AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits along dim 0; its backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        back = torch.empty_like(grad)
        dist.all_to_all_single(back, grad, group=ctx.group)
        return back, None


def ulysses_attention(q, k, v, causal=False, group=None):
    """Attention over the whole sequence by trading the sequence split for a head split."""
    n = dist.get_world_size(group)
    batch, heads, length, head_dim = q.shape
    if heads % n != 0:
        raise ValueError(f"{heads} heads cannot be split over {n} ranks")
    h = heads // n
    packed = torch.stack([q, k, v])                               # (3, B, H, L, D)
    packed = packed.reshape(3, batch, n, h, length, head_dim).permute(2, 0, 1, 3, 4, 5)
    packed = _AllToAll.apply(packed, group)                       # (n_src, 3, B, h, L, D)
    packed = packed.permute(1, 2, 3, 0, 4, 5).reshape(3, batch, h, n * length, head_dim)
    q_h, k_h, v_h = packed.unbind(0)
    out = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal)  # (B, h, S, D)
    out = out.reshape(batch, h, n, length, head_dim).permute(2, 0, 1, 3, 4)
    out = _AllToAll.apply(out, group)                             # (n_src, B, h, L, D)
    return out.permute(1, 0, 2, 3, 4).reshape(batch, heads, length, head_dim)
''',
    "train_cp": '''\
def train_cp(model_fn, tokens, *, mode, steps, lr, group=None):
    """Context-parallel SGD on this rank's slice of the sequence; the global losses and params."""
    attentions = {
        "ring": lambda q, k, v: ring_attention(q, k, v, causal=True, group=group),
        "ring_zigzag": lambda q, k, v: ring_attention(q, k, v, causal=True, group=group,
                                                      layout="zigzag"),
        "ulysses": lambda q, k, v: ulysses_attention(q, k, v, causal=True, group=group),
    }
    if mode not in attentions:
        raise ValueError(f"unknown mode {mode!r}")
    attention = attentions[mode]
    n, r = dist.get_world_size(group), dist.get_rank(group)
    batch, whole = tokens.size(0), tokens.size(1) - 1
    if mode == "ring_zigzag":
        # positions held: chunk r and chunk 2n-1-r of 2n chunks (the conventions' layout)
        c = whole // (2 * n)
        held = torch.cat([torch.arange(r * c, (r + 1) * c),
                          torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])
    else:
        length = whole // n
        held = torch.arange(r * length, (r + 1) * length, dtype=torch.int64)
    inputs = tokens[:, :-1].index_select(1, held)
    targets = tokens[:, 1:].index_select(1, held)
    positions = held

    model = model_fn()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        logits = model(inputs, positions, attention)
        local = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                reduction="sum") / (batch * whole)
        local.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        total = local.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        losses.append(total.item())
        optimizer.step()
    return losses, list(model.parameters())
''',
}
