'''Assignment 3 answered a second time, from the released notebook's text alone.

Written from ``assignments/a3_model_pipeline/model_pipeline.ipynb`` (its set-up cell provides
``stage_device``, ``send_activation``, ``recv_activation``, ``device_for``, ``loss``, ``dist``),
without the reference solution at hand: if it loses points, the text (or a check) asks for
something it does not say. Keys are the answer cells' grade ids.
'''

ANSWERS = {
    "split_into_stages": '''\
def _stages_needed(sizes, limit):
    """Fewest contiguous stages of at most `limit` parameters each (greedy)."""
    count, current = 1, 0
    for size in sizes:
        if current + size > limit:
            count, current = count + 1, 0
        current += size
    return count


def split_into_stages(model, devices):
    """Contiguous stages of `model`, stage i on devices[i], the largest as small as possible."""
    layers, k = list(model), len(devices)
    if len(layers) < k:
        raise ValueError(f"{len(layers)} layer(s) cannot fill {k} non-empty stages")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    # Smallest limit on the largest stage that k stages can meet: binary search. Fewer stages
    # than k meeting it is fine, since a stage can always be cut further (every layer is
    # at most the limit, and there are at least k layers).
    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if _stages_needed(sizes, mid) <= k:
            high = mid
        else:
            low = mid + 1
    limit = low
    stages, start = [], 0
    for i, device in enumerate(devices):
        later = k - i - 1
        end, total = start + 1, sizes[start]
        if later == 0:
            end = len(layers)
        else:
            while end < len(layers) - later and total + sizes[end] <= limit:
                total += sizes[end]
                end += 1
        stages.append(nn.Sequential(*layers[start:end]).to(device))
        start = end
    return stages
''',
    "model_parallel_forward": '''\
def model_parallel_forward(stages, x):
    """The stages one after the other, each on its own device; the output on the last one's."""
    h = x
    for stage in stages:
        device = stage_device(stage)
        if device is not None:
            h = h.to(device)
        h = stage(h)
    return h
''',
    "pipelined_forward": '''\
def pipelined_forward(stages, x, num_microbatches):
    """GPipe's forward: micro-batches issued tick by tick, so that stages overlap."""
    m = min(num_microbatches, x.shape[0])
    p = len(stages)
    activations = list(x.tensor_split(m))
    for tick in range(m + p - 1):
        for s, stage in enumerate(stages):
            i = tick - s
            if not 0 <= i < m:
                continue
            h = activations[i]
            device = stage_device(stage)
            if device is not None:
                h = h.to(device)
            activations[i] = stage(h)
    return torch.cat(activations)
''',
    "gpipe_schedule": '''\
def gpipe_schedule(num_stages, num_microbatches):
    """All forwards (as early as possible), then all backwards; 2(m + p - 1) steps."""
    p, m = num_stages, num_microbatches
    steps = [[None] * p for _ in range(2 * (m + p - 1))]
    for s in range(p):
        for i in range(m):
            steps[s + i][s] = ("F", i)
            # the last stage starts backwards right after its last forward (step m + p - 2);
            # each earlier stage one step after the stage behind it
            steps[(m + p - 1) + i + (p - 1 - s)][s] = ("B", i)
    return steps
''',
    "one_f_one_b_schedule": '''\
def one_f_one_b_schedule(num_stages, num_microbatches):
    """1F1B: as short as GPipe, at most num_stages live micro-batches per stage."""
    p, m = num_stages, num_microbatches
    done = {}                       # (kind, i, s) -> step it ran at
    forwards, backwards = [0] * p, [0] * p
    steps = []
    while any(b < m for b in backwards):
        t = len(steps)
        step = [None] * p
        for s in range(p):
            f, b = forwards[s], backwards[s]

            def ran_before(key):
                return key in done and done[key] < t

            backward_ready = (b < f and ran_before(("F", b, s))
                              and (s == p - 1 or ran_before(("B", b, s + 1))))
            forward_ready = f < m and (s == 0 or ran_before(("F", f, s - 1)))
            if backward_ready:
                step[s] = ("B", b)
            elif forward_ready and f - b < p - s:
                step[s] = ("F", f)
        for s, entry in enumerate(step):
            if entry is not None:
                done[(entry[0], entry[1], s)] = t
                if entry[0] == "F":
                    forwards[s] += 1
                else:
                    backwards[s] += 1
        steps.append(step)
    return steps
''',
    "bubble_fraction": '''\
def bubble_fraction(schedule):
    """Idle slots / (stages x makespan); the makespan ends with the last step where a stage
    works."""
    if len(schedule) == 0:
        raise ValueError("a schedule without time steps")
    widths = {len(step) for step in schedule}
    if len(widths) != 1 or 0 in widths:
        raise ValueError("every step needs the same, non-zero number of entries")
    p = widths.pop()
    makespan = len(schedule)
    while makespan and all(entry is None for entry in schedule[makespan - 1]):
        makespan -= 1          # idle steps at the end are not part of the pipeline's time
    if makespan == 0:
        raise ValueError("no stage ever works")
    # per stage, the share of its makespan it is idle; the schedule's is their mean
    per_stage = [sum(schedule[t][s] is None for t in range(makespan)) / makespan
                 for s in range(p)]
    return sum(per_stage) / p
''',
    "pipeline_train_step": '''\
def pipeline_train_step(stage, X, y, num_microbatches, lr):
    """One SGD step of a pipeline of processes; rank r holds stage r. Returns the loss on the
    last rank, None elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    device = device_for(rank)
    batch = X.shape[0]
    m = min(num_microbatches, batch)
    X_parts, y_parts = X.tensor_split(m), y.tensor_split(m)
    inputs, outputs, losses = [], [], []
    for i in range(m):                       # forwards, each sent on at once
        if first:
            h = X_parts[i].to(device)
        else:
            h = recv_activation(rank - 1, device).requires_grad_()
        out = stage(h)
        inputs.append(h)
        outputs.append(out)
        if last:
            losses.append(loss(out, y_parts[i].to(device)).sum() / batch)
        else:
            send_activation(out, rank + 1)
    total = 0.0
    for i in range(m):                       # backwards, in the same micro-batch order
        if last:
            losses[i].backward()
            total += losses[i].item()
        else:
            outputs[i].backward(recv_activation(rank + 1, device))
        if not first:
            send_activation(inputs[i].grad, rank - 1)
    with torch.no_grad():
        for param in stage.parameters():
            if param.grad is not None:
                param -= lr * param.grad
                param.grad = None
    return total if last else None
''',
}
