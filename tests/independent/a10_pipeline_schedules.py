'''Assignment 10 answered a second time, from the released notebook's text alone.

Written from ``assignments/a10_pipeline_schedules/pipeline_schedules.ipynb`` (its markdown, its
set-up cell, which imports ``time``, ``torch``, ``dist``, ``nn``, ``check``, ``schedules``
(``course.schedules``) and ``launch``, and the answer stubs), with ``course/schedules.py`` and
lesson 18 for the format; not from the reference solution, the grader or its tests: if it loses
points, the text (or a check) asks for something it does not say. Keys are the answer cells'
grade ids.

Deliberately other choices than a typical solution's:

- ``interleaved_1f1b`` is Megatron-LM's loop written out: a virtual micro-batch counter ``k`` in
  ``0..v*m-1`` mapped to (model chunk, micro-batch) in groups of ``p`` (the backward walks the
  chunks in reverse), an explicit warm-up count ``(v - 1) * p + 2 * (p - 1 - r)`` (``p - 1 - r``
  for ``v = 1``, plain 1F1B), capped at ``v * m``, then ``v * m - warm-up`` steady pairs
  (forward first, then backward) and a cool-down of backwards;
- ``zero_bubble_h1`` and ``zero_bubble_v`` are not written as patterns at all: each runs an
  event-driven list scheduler over unit time slots (F = I = W), in which every free rank picks one
  ready action by a rule, and the lists are the order in which the actions were picked. ZB-H1's
  rule: while a rank's forwards are fewer than ``p - r`` ahead of its input gradients (1F1B's
  warm-up depth), forward first, else input gradient first; a W only when nothing else can run;
  at most ``p`` micro-batches held. ZB-V's rule is a fixed priority, forwards of the rank's later
  stage, forwards of its earlier stage, input gradients of the earlier, of the later, then the
  W's, with at most ``2 p`` stage activations held; the result is checked against the text's
  bounds with ``schedules`` before it is returned (an ``AssertionError`` would say the rule
  failed);
- ``backward_input`` does the backward by hand, under ``torch.no_grad()``: the forward layer by
  layer with functional calls (so an in-place ``ReLU`` never touches ``x``), then ``g @ W`` for each
  ``Linear`` and aten's own element-wise backward kernels (``threshold_backward``,
  ``tanh_backward``, ``gelu_backward``) for the activations (any other module through
  ``torch.func.vjp``); ``saved`` is a list of ``(layer index, layer input, output gradient)`` per
  ``Linear``; ``backward_weight`` forms ``gᵀ h`` and ``g.sum(0)`` and empties ``saved``;
- ``run_schedule`` validates with ``schedules.check``, then pre-posts every ``irecv`` the rank will
  need (one buffer per expected message, its tag encoding stage, micro-batch and direction),
  posts every send as an ``isend`` and waits for them only at the end; it computes with
  ``torch.autograd.grad`` (``retain_graph`` for ``I``) and adds to ``.grad`` itself.
'''

ANSWERS = {
    "interleaved_1f1b": '''\
def _positive_ints(*values):
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected a positive int, got {value!r}")


def interleaved_1f1b(p, v, m):
    """Per-rank action lists of interleaved 1F1B: p ranks, v stages each, m micro-batches."""
    _positive_ints(p, v, m)
    if m % p:
        raise ValueError(f"m = {m} must be a multiple of p = {p}")
    total = v * m                       # virtual micro-batches a rank works through

    def action(rank, k, forward):
        in_group = k % (p * v)
        chunk = in_group // p
        if not forward:
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return f"{rank + chunk * p}{'F' if forward else 'B'}{microbatch}"

    lists = []
    for rank in range(p):
        if v == 1:
            warmup = p - 1 - rank
        else:
            warmup = min(total, (v - 1) * p + 2 * (p - 1 - rank))
        steady = total - warmup
        mine = [action(rank, k, True) for k in range(warmup)]
        for i in range(steady):
            mine.append(action(rank, warmup + i, True))
            mine.append(action(rank, i, False))
        mine.extend(action(rank, k, False) for k in range(steady, total))
        lists.append(mine)
    return lists
''',
    "zero_bubble_h1": '''\
def _event_driven_lists(p, m, rank_of, cap, choose):
    """Unit-slot list scheduling: each free rank picks one ready action with `choose`; the lists
    are the picks in order. rank_of: stage -> rank; cap: most stage activations a rank holds."""
    n = len(rank_of)
    finished = {}                        # (kind, stage, mb) -> slot at whose start it is done
    next_f, next_i = [0] * n, [0] * n
    waiting_w = [[] for _ in range(n)]
    held, busy = [0] * p, [0] * p
    counts = [dict(F=0, I=0, W=0) for _ in range(p)]
    lists = [[] for _ in range(p)]
    left, now = 3 * n * m, 0
    while left:
        for rank in range(p):
            if busy[rank] > now:
                continue
            ready = []
            for stage in (s for s in range(n) if rank_of[s] == rank):
                k = next_f[stage]
                if k < m and held[rank] < cap and (
                        stage == 0 or finished.get(("F", stage - 1, k), now + 1) <= now):
                    ready.append(("F", stage, k))
                k = next_i[stage]
                if k < next_f[stage] and finished.get(("F", stage, k), now + 1) <= now and (
                        stage == n - 1 or finished.get(("I", stage + 1, k), now + 1) <= now):
                    ready.append(("I", stage, k))
                if waiting_w[stage]:
                    ready.append(("W", stage, waiting_w[stage][0]))
            if not ready:
                continue
            kind, stage, k = choose(rank, counts[rank], ready)
            lists[rank].append(f"{stage}{kind}{k}")
            finished[(kind, stage, k)] = now + 1
            counts[rank][kind] += 1
            busy[rank] = now + 1
            left -= 1
            if kind == "F":
                next_f[stage] += 1
                held[rank] += 1
            elif kind == "I":
                next_i[stage] += 1
                waiting_w[stage].append(k)
            else:
                waiting_w[stage].pop(0)
                held[rank] -= 1
        now += 1
        if now > 10 * (3 * n * m + n):
            raise AssertionError("the list scheduler made no progress")
    return lists


def zero_bubble_h1(p, m):
    for value in (p, m):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected a positive int, got {value!r}")
    if m < p:
        raise ValueError(f"ZB-H1 needs m >= p; got m = {m}, p = {p}")

    def choose(rank, counts, ready):
        ahead = counts["F"] - counts["I"]
        preference = "FIW" if ahead < p - rank else "IFW"
        return min(ready, key=lambda a: (preference.index(a[0]), a[2]))

    lists = _event_driven_lists(p, m, list(range(p)), p, choose)
    timeline = schedules.check(lists, m)
    assert schedules.bubble(timeline) <= (p - 1) / (3 * m) + 1e-12
    assert max(schedules.peak_in_flight(lists)) <= p
    return lists
''',
    "zero_bubble_v": '''\
def _event_driven_lists_v(p, m, rank_of, cap, choose):
    """The same unit-slot list scheduler as ZB-H1's (kept in this cell so that it stands alone)."""
    n = len(rank_of)
    finished = {}
    next_f, next_i = [0] * n, [0] * n
    waiting_w = [[] for _ in range(n)]
    held, busy = [0] * p, [0] * p
    lists = [[] for _ in range(p)]
    left, now = 3 * n * m, 0
    while left:
        for rank in range(p):
            if busy[rank] > now:
                continue
            ready = []
            for stage in (s for s in range(n) if rank_of[s] == rank):
                k = next_f[stage]
                if k < m and held[rank] < cap and (
                        stage == 0 or finished.get(("F", stage - 1, k), now + 1) <= now):
                    ready.append(("F", stage, k))
                k = next_i[stage]
                if k < next_f[stage] and finished.get(("F", stage, k), now + 1) <= now and (
                        stage == n - 1 or finished.get(("I", stage + 1, k), now + 1) <= now):
                    ready.append(("I", stage, k))
                if waiting_w[stage]:
                    ready.append(("W", stage, waiting_w[stage][0]))
            if not ready:
                continue
            kind, stage, k = choose(rank, ready)
            lists[rank].append(f"{stage}{kind}{k}")
            finished[(kind, stage, k)] = now + 1
            busy[rank] = now + 1
            left -= 1
            if kind == "F":
                next_f[stage] += 1
                held[rank] += 1
            elif kind == "I":
                next_i[stage] += 1
                waiting_w[stage].append(k)
            else:
                waiting_w[stage].pop(0)
                held[rank] -= 1
        now += 1
        if now > 10 * (3 * n * m + n):
            raise AssertionError("the list scheduler made no progress")
    return lists


def zero_bubble_v(p, m):
    for value in (p, m):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected a positive int, got {value!r}")
    if m < 2 * p:
        raise ValueError(f"ZB-V needs m >= 2p; got m = {m}, p = {p}")
    rank_of = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    # F of the later stage, F of the earlier, I of the earlier, I of the later, W earlier, W later
    rank_priority = {("F", 1): 0, ("F", 0): 1, ("I", 0): 2, ("I", 1): 3, ("W", 0): 4, ("W", 1): 5}

    def choose(rank, ready):
        return min(ready, key=lambda a: (rank_priority[(a[0], int(a[1] >= p))], a[2]))

    lists = _event_driven_lists_v(p, m, rank_of, 2 * p, choose)
    timeline = schedules.check(lists, m)
    assert schedules.bubble(timeline) <= (p - 1) / (6 * m) + 1e-12
    assert max(schedules.peak_in_flight(lists)) <= 2 * p
    return lists
''',
    "backward_input": '''\
def _forward_piece(layer, h):
    """One layer's forward, functional (never in place)."""
    if isinstance(layer, nn.Linear):
        return nn.functional.linear(h, layer.weight, layer.bias)
    if isinstance(layer, nn.ReLU):
        return torch.relu(h)
    if isinstance(layer, nn.Tanh):
        return torch.tanh(h)
    if isinstance(layer, nn.GELU):
        return nn.functional.gelu(h, approximate=layer.approximate)
    return layer(h)


def backward_input(stage, x, grad_output):
    """The gradient of the stage's input, and what backward_weight needs: its forward again on x."""
    layers = list(stage)
    y = h = None
    with torch.no_grad():
        values = [x]                                  # values[i]: the input of layers[i]
        for layer in layers:
            values.append(_forward_piece(layer, values[-1]))
        g = grad_output
        saved = []
        for index in range(len(layers) - 1, -1, -1):
            layer, h, y = layers[index], values[index], values[index + 1]
            values[index + 1] = None                  # free what is no longer needed
            if isinstance(layer, nn.Linear):
                saved.append((index, h, g))           # W needs the layer's input and dL/dy
                g = torch.mm(g, layer.weight)
            elif isinstance(layer, nn.ReLU):
                g = torch.ops.aten.threshold_backward(g, y, 0)
            elif isinstance(layer, nn.Tanh):
                g = torch.ops.aten.tanh_backward(g, y)
            elif isinstance(layer, nn.GELU):
                g = torch.ops.aten.gelu_backward(g, h, approximate=layer.approximate)
            else:
                with torch.enable_grad():
                    _, pullback = torch.func.vjp(lambda t: layer(t), h)
                    (g,) = pullback(g)
                del pullback
        del values, y, h
    saved.reverse()
    return g, saved
''',
    "backward_weight": '''\
def backward_weight(stage, saved):
    """Add the gradients of the stage's weights to their .grad, from backward_input's saved."""
    layers = list(stage)
    with torch.no_grad():
        for index, h, g in saved:
            layer = layers[index]
            parts = [(layer.weight, lambda: torch.mm(g.t(), h))]
            if layer.bias is not None:
                parts.append((layer.bias, lambda: g.sum(dim=0)))
            for param, gradient in parts:
                if not param.requires_grad:
                    continue
                value = gradient()
                if param.grad is None:
                    param.grad = value
                else:
                    param.grad.add_(value)
    saved.clear()                                     # used once: let the tensors go
''',
    "run_schedule": '''\
def run_schedule(schedule, stages, inputs, targets, loss_fn):
    """Run this rank's list of the schedule on its stages; the timeline of its compute actions."""
    m = len(inputs)
    schedules.check(schedule, m)                      # ValueError on Part 1's rules, nothing sent
    placed = schedules.stage_ranks(schedule)
    plan = schedules.parse(schedule)
    world, rank = dist.get_world_size(), dist.get_rank()
    if len(plan) != world:
        raise ValueError(f"the schedule has {len(plan)} ranks; the group has {world}")
    mine = sorted(s for s, r in placed.items() if r == rank)
    missing = [s for s in mine if s not in stages]
    if missing:
        raise ValueError(f"rank {rank} holds stages {mine} but was given no module for {missing}")
    last = len(placed) - 1
    actions = [op for entry in plan[rank] for op in entry if op.kind in ("F", "B", "I", "W")]

    def tag(direction, stage, mb):                   # direction 0: activation into `stage`,
        return (stage * m + mb) * 2 + direction       # 1: gradient of `stage`'s output

    # every message this rank will receive, posted now, each into its own buffer
    posted = {}
    for stage in mine:
        for mb in range(m):
            if stage > 0 and placed[stage - 1] != rank:
                buffer = torch.empty(inputs[mb].shape, dtype=inputs[mb].dtype)
                posted[(0, stage, mb)] = (buffer, dist.irecv(buffer, src=placed[stage - 1],
                                                             tag=tag(0, stage, mb)))
            if stage < last and placed[stage + 1] != rank:
                buffer = torch.empty(inputs[mb].shape, dtype=inputs[mb].dtype)
                posted[(1, stage, mb)] = (buffer, dist.irecv(buffer, src=placed[stage + 1],
                                                             tag=tag(1, stage, mb)))
    in_memory = {}                                    # same-rank hand-overs, keyed like posted
    sending = []                                      # (work, tensor): kept alive until done
    forward_of = {}                                   # (stage, mb) -> (input leaf, output or loss)
    for_w = {}                                        # (stage, mb) -> (output, its gradient)

    def take(direction, stage, mb):
        if (direction, stage, mb) in in_memory:
            return in_memory.pop((direction, stage, mb))
        buffer, work = posted.pop((direction, stage, mb))
        work.wait()
        return buffer

    def give(direction, stage, mb, tensor):           # to `stage` (which consumes it)
        tensor = tensor.detach().contiguous()
        if placed[stage] == rank:
            in_memory[(direction, stage, mb)] = tensor
        else:
            sending.append((dist.isend(tensor, dst=placed[stage], tag=tag(direction, stage, mb)),
                            tensor))

    def add_to_grads(params, grads):
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad.add_(grad)

    timeline = []
    for op in actions:
        stage, kind, mb = op.stage, op.kind, op.mb
        module = stages[stage]
        params = [q for q in module.parameters() if q.requires_grad]
        if kind == "F":
            x = inputs[mb] if stage == 0 else take(0, stage, mb)
            start = time.perf_counter()
            if stage > 0:
                x = x.detach().requires_grad_(True)
            out = module(x)
            if stage == last:
                out = loss_fn(out, targets[mb]) / m
            end = time.perf_counter()
            forward_of[(stage, mb)] = (x, out)
            if stage < last:
                give(0, stage + 1, mb, out)
        elif kind in ("B", "I"):
            g = None if stage == last else take(1, stage, mb)
            start = time.perf_counter()
            x, out = forward_of.pop((stage, mb))
            wants_x = stage > 0
            if kind == "B":
                wrt = params + ([x] if wants_x else [])
                got = torch.autograd.grad(out, wrt, grad_outputs=g, allow_unused=True) if wrt else ()
                add_to_grads(params, got[:len(params)])
                dx = got[-1] if wants_x else None
            else:
                dx = None
                if wants_x:
                    (dx,) = torch.autograd.grad(out, [x], grad_outputs=g, retain_graph=True,
                                                allow_unused=True)
                for_w[(stage, mb)] = (out, g)
            if wants_x and dx is None:
                dx = torch.zeros_like(x)
            end = time.perf_counter()
            if wants_x:
                give(1, stage - 1, mb, dx)
        else:                                         # W
            start = time.perf_counter()
            out, g = for_w.pop((stage, mb))
            if params:
                add_to_grads(params, torch.autograd.grad(out, params, grad_outputs=g,
                                                         allow_unused=True))
            del out, g
            end = time.perf_counter()
        timeline.append((str(op), start, end))
    for work, _ in sending:
        work.wait()
    return timeline
''',
}
