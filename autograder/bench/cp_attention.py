"""The attention that ``python -m autograder.bench a6_context_parallel`` measures, and what
counts its memory and bytes (the benchmark itself, its runs, table and plot:
:mod:`autograder.bench.a6_context_parallel`, whose docstring says what each method does).

- :func:`ring_attention`: ring attention over contiguous sequence shards, a
  ``torch.autograd.Function`` (K and V go around the ring with ``batch_isend_irecv`` while the
  current block is computed; blocks merged by their log-sum-exp, :func:`merge`; its backward
  sends K and V around again with their gradients' accumulators, one hop more to come home);
- :func:`ulysses_attention`: all-to-all from sequence shards to head shards, SDPA, and back;
- :func:`full_attention` (SDPA) and :func:`matmul_attention` (S x S scores as real tensors):
  the whole sequence on one process;
- :func:`recorder`: a ``TorchDispatchMode`` that records the peak of live tensor bytes and the
  bytes a rank sends through ``c10d`` operators; :func:`rss_kib` and :func:`reset_peak_rss`
  read and reset the process's peak resident set (Linux).

This is Assignment 6's answer (students write ring attention and Ulysses), so the student
edition leaves this module out, as it does the benchmark (``NEVER`` in
``autograder/integrations/edition.py``). Torch is imported inside the functions: importing this
module is cheap.
"""
from __future__ import annotations

import weakref
from pathlib import Path


# ----------------------------------------------------------------------------- attention itself

def _peer(group, i: int) -> int:
    """The global rank of rank ``i`` of ``group`` (the world when None)."""
    import torch.distributed as dist

    return i if group is None else dist.get_global_rank(group, i)


def _causal_mask(length: int, device):
    """True where a key comes after its query (masked), for a block on the diagonal."""
    import torch

    return torch.ones(length, length, dtype=torch.bool, device=device).triu_(1)


def _scores(q, k, scale: float, diagonal: bool):
    """``q k^T * scale`` (a new tensor), the future masked with -inf on a diagonal block."""
    import torch

    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    if diagonal:
        s.masked_fill_(_causal_mask(q.shape[-2], q.device), float("-inf"))
    return s


def block_attention(q, k, v, scale: float, diagonal: bool = False):
    """Attention of ``q`` over one block of keys: (output, lse), lse = log sum_j exp(score)."""
    import torch

    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse.unsqueeze(-1)).exp_()  # in place: one L x L block alive, not two
    return torch.matmul(p, v), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint key sets from each one's (output, lse): the online-softmax
    step, with no overflow for any finite lse."""
    import torch

    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp().unsqueeze(-1) + out_b * (lse_b - lse).exp().unsqueeze(-1)
    return out, lse


def _ring_shift(tensors, group):
    """Start sending ``tensors`` to the next rank of the ring and receiving as many from the
    previous one: (receive buffers, requests to wait on)."""
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(group), dist.get_rank(group)
    to, frm = _peer(group, (r + 1) % n), _peer(group, (r - 1) % n)
    bufs = [torch.empty_like(t) for t in tensors]
    ops = ([dist.P2POp(dist.isend, t, to, group) for t in tensors]
           + [dist.P2POp(dist.irecv, b, frm, group) for b in bufs])
    return bufs, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _ring_class():
    import torch
    import torch.distributed as dist

    class RingAttention(torch.autograd.Function):
        """Ring attention over a contiguous sequence shard; see :func:`ring_attention`."""

        @staticmethod
        def forward(ctx, q, k, v, causal, group):
            n, r = dist.get_world_size(group), dist.get_rank(group)
            scale = q.shape[-1] ** -0.5
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = lse = None
            cur = (k, v)
            for step in range(n):
                src = (r - step) % n  # whose K/V this rank holds at this step
                if step < n - 1:
                    nxt, works = _ring_shift(cur, group)  # overlaps with the block below
                if not causal or src <= r:
                    o_b, l_b = block_attention(q, cur[0], cur[1], scale, causal and src == r)
                    out, lse = (o_b, l_b) if out is None else merge(out, lse, o_b, l_b)
                if step < n - 1:
                    _wait(works)
                    cur = nxt
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal, ctx.group = causal, group
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            causal, group = ctx.causal, ctx.group
            n, r = dist.get_world_size(group), dist.get_rank(group)
            scale = q.shape[-1] ** -0.5
            dout = dout.contiguous()
            delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O)
            dq = torch.zeros_like(q)
            cur, acc = (k, v), (torch.zeros_like(k), torch.zeros_like(v))
            for step in range(n):
                src = (r - step) % n
                if step < n - 1:
                    nxt, works = _ring_shift(cur, group)
                if not causal or src <= r:
                    kb, vb = cur
                    p = _scores(q, kb, scale, causal and src == r).sub_(lse.unsqueeze(-1)).exp_()
                    acc[1].add_(torch.matmul(p.transpose(-2, -1), dout))          # dV
                    ds = torch.matmul(dout, vb.transpose(-2, -1)).sub_(delta).mul_(p)
                    del p
                    dq.add_(torch.matmul(ds, kb), alpha=scale)
                    acc[0].add_(torch.matmul(ds.transpose(-2, -1), q), alpha=scale)  # dK
                    del ds
                if n > 1:  # the accumulators follow their K/V; the last hop brings them home
                    acc_next, acc_works = _ring_shift(acc, group)
                    _wait(acc_works)
                    acc = acc_next
                if step < n - 1:
                    _wait(works)
                    cur = nxt
            return dq, acc[0], acc[1], None, None

    return RingAttention


def ring_attention(q, k, v, causal: bool = False, group=None):
    """Ring attention: q, k, v (B, H, L, D) are this rank's contiguous sequence shard; returns
    this rank's shard of the output. Differentiable."""
    return _ring_class().apply(q, k, v, causal, group)


def _all_to_all_class():
    import torch
    import torch.distributed as dist

    class AllToAll(torch.autograd.Function):
        """``all_to_all_single`` with equal splits along dim 0; it is its own adjoint, so the
        backward is the same call on the gradient."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            x = x.contiguous()
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            out = torch.empty_like(grad)
            dist.all_to_all_single(out, grad, group=ctx.group)
            return out, None

    return AllToAll


def ulysses_attention(q, k, v, causal: bool = False, group=None):
    """Ulysses (DeepSpeed): sequence shards (B, H, L, D) -> head shards (B, H/n, S, D) by
    all-to-all, SDPA, and back. Differentiable."""
    import torch.distributed as dist
    import torch.nn.functional as F

    n = dist.get_world_size(group)
    b, h, length, d = q.shape
    if h % n:
        raise ValueError(f"Ulysses needs heads ({h}) divisible by the group's size ({n})")
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    a2a = _all_to_all_class().apply

    def to_heads(x):  # chunk j of dim 0 goes to rank j: my sequence shard of its heads
        y = a2a(x.reshape(b, n, h // n, length, d).transpose(0, 1), group)
        return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, d)  # (B, H/n, S, D)

    def to_sequence(x):  # chunk j goes to rank j: its sequence shard of my heads
        y = a2a(x.reshape(b, h // n, n, length, d).permute(2, 0, 1, 3, 4), group)
        return y.transpose(0, 1).reshape(b, h, length, d)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=causal)
    return to_sequence(out)


def matmul_attention(q, k, v, causal: bool = False):
    """Full attention with matmuls: the (S x S) scores and probabilities are real tensors."""
    import torch

    s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(_causal_mask(q.shape[-2], q.device), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def full_attention(q, k, v, causal: bool = False):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


# ----------------------------------------------------------------------------- counting

def recorder(inputs, world_size: int):
    """A dispatch mode that records, while it is on, the peak of live tensor bytes (the storages
    of ``inputs`` + every storage an operator makes, until it is freed: ``.peak``) and the bytes
    this rank sends through c10d operators (``.sent``, in ``.calls`` calls)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[int, int] = {}
            self.now = self.peak = self.sent = self.calls = 0
            for t in inputs:
                self._track(t.untyped_storage())

        def _track(self, storage) -> None:
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live:
                return
            self.live[key] = size
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)

        def _free(self, key: int) -> None:
            self.now -= self.live.pop(key, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "c10d":
                name = func.name().split("::")[-1].split(".")[0]
                if name == "send":
                    self.sent += sum(t.numel() * t.element_size() for t in args[0])
                    self.calls += 1
                elif name == "alltoall_base_":
                    out_splits, in_splits = args[3], args[4]
                    if in_splits or out_splits:
                        raise NotImplementedError("uneven all-to-all is not counted")
                    x = args[1]
                    self.sent += x.numel() * x.element_size() * (world_size - 1) // world_size
                    self.calls += 1
                elif not any(w in name for w in ("recv", "wait", "barrier")):
                    raise NotImplementedError(f"c10d.{name} is not counted")
            result = func(*args, **kwargs)
            if not func.is_view:
                for t in tree_leaves(result):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        self._track(t.untyped_storage())
            return result

    return Recorder()


def rss_kib() -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of this process in KiB, or None where /proc/self/status is missing."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                      if ":" in line)
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def reset_peak_rss() -> bool:
    """Set this process's VmHWM to its VmRSS now (Linux: ``5`` into /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
