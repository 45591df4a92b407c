'''Assignment 1 answered a second time, from the released notebook's text alone.

Written without the reference solution or the grader at hand, as a student who follows
``assignments/a1_data_parallel/data_parallel.ipynb`` to the letter would: if it loses points,
the text (or a check) asks for something it does not say. Keys are the answer cells' grade ids.
'''

ANSWERS = {
    "copy_params": '''\
def copy_params(params, device):
    """New tensors on `device`, equal to `params`, with requires_grad=True."""
    copies = []
    for p in params:
        fresh = torch.empty(p.shape, dtype=p.dtype, device=device)
        with torch.no_grad():
            fresh.copy_(p)
        fresh.requires_grad_(True)
        copies.append(fresh)
    return copies
''',
    "allreduce": '''\
def allreduce(data):
    """In place: every data[i] becomes the sum of all data[j], on its own device."""
    # Accumulate on the first tensor's device, in a separate buffer so that no input changes
    # before every input has been read (entries may share a device).
    total = torch.zeros_like(data[0])
    for t in data:
        total += t.to(total.device)
    for t in data:
        t.copy_(total.to(t.device))
''',
    "split_batch": '''\
def shard_by_sizes(X, y, devices, sizes):
    """Contiguous shards of the given sizes, shard i moved to devices[i]."""
    X_shards, y_shards, start = [], [], 0
    for size, device in zip(sizes, devices):
        X_shards.append(X[start:start + size].to(device))
        y_shards.append(y[start:start + size].to(device))
        start += size
    return X_shards, y_shards


def split_batch(X, y, devices):
    """Contiguous, as-equal-as-possible shards of X and y, shard i on devices[i]."""
    n = len(devices)
    base, extra = divmod(X.shape[0], n)
    sizes = [base + (1 if i < extra else 0) for i in range(n)]
    return shard_by_sizes(X, y, devices, sizes)
''',
    "split_batch_weighted": '''\
def split_batch_weighted(X, y, devices, weights):
    """Contiguous shards with sizes proportional to weights (largest-remainder rounding)."""
    import math

    batch = X.shape[0]
    total = sum(weights)
    quotas = [batch * w / total for w in weights]
    sizes = [math.floor(q) for q in quotas]
    leftover = batch - sum(sizes)
    fractions = [q - s for q, s in zip(quotas, sizes)]
    # largest fractional part first; on a tie the earlier device (stable sort keeps order)
    order = sorted(range(len(weights)), key=lambda i: -fractions[i])
    for i in order[:leftover]:
        sizes[i] += 1
    return shard_by_sizes(X, y, devices, sizes)
''',
    "train_batch": '''\
def train_batch(X, y, device_params, devices, lr):
    """One data-parallel SGD step; every replica ends identical."""
    batch_size = X.shape[0]
    X_shards, y_shards = split_batch(X, y, devices)
    for X_part, y_part, params in zip(X_shards, y_shards, device_params):
        shard_loss = loss(lenet(X_part, params), y_part).sum()
        shard_loss.backward()
    for k in range(len(device_params[0])):
        grads = []
        for params in device_params:
            if params[k].grad is None:  # a replica that saw no example
                params[k].grad = torch.zeros_like(params[k])
            grads.append(params[k].grad)
        allreduce(grads)
    for params in device_params:
        sgd(params, lr, batch_size)
''',
}
