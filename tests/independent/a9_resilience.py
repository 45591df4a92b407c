'''Assignment 9 answered a second time, from the released notebook's text alone.

Written from ``assignments/a9_resilience/resilience.ipynb`` (its markdown, its set-up cell,
which imports ``copy``, ``os``, ``Counter``, ``Path``, ``torch``, ``dist``, ``check``, the
``course.flight`` functions and ``launch``, and the answer stubs); not from the reference
solution, the grader or its tests: if it loses points, the text (or a check) asks for something
it does not say. Keys are the answer cells' grade ids.

Deliberately other choices than a typical solution's:

- ``diagnose`` parses every record into a frozen ``dataclass`` (``_Call``) that validates itself,
  collects every divergence as a sortable ``NamedTuple`` and picks each group's and the first
  with ``sorted``; the reference call is chosen by sorting the calls by (-count, first rank);
  the waits are a map from each rank to the group whose divergence its last call is in, and the
  divergences that wait are a set;
- a checkpoint is a *folder* (``ckpt.<step>.<random>/``: one ``torch.save`` file per tensor,
  written to its path by torch, a JSON manifest of the plain values and of each file's
  blake2b, itself checksummed), committed by an empty marker file made by ``Path.touch()``
  (through ``os.open``); the older ones go after the commit, marker first; ``load_latest``
  walks the marked folders with ``os.scandir``, checks every byte before it changes the state,
  and copies into the state's tensors in place where shapes and dtypes agree;
- ``train_resumable`` uses ``torch.optim.SGD(momentum=0.9)`` (whose momentum buffer is the
  text's velocity), ``backward`` instead of ``autograd.grad``, strided shares of each batch
  (rank r reads rows r, r + W, ...), one all-reduce of all gradients and the loss flattened
  into one vector, and the last rank saves, with no barrier (every rank holds the same state);
- ``async_save`` stages with ``.to("cpu", copy=True)`` and ``copy.deepcopy`` and hands the
  write to a one-thread ``concurrent.futures`` executor (pending saves commit one after the
  other, in the order of the calls); ``wait()`` is the future's ``result()``.
'''

ANSWERS = {
    "diagnose": '''\
import dataclasses
from typing import NamedTuple

_OPS = frozenset("ALLREDUCE BROADCAST REDUCE ALLGATHER REDUCE_SCATTER ALLTOALL BARRIER "
                 "GATHER SCATTER SEND RECV".split())
_FIELDS = frozenset({"seq", "group", "members", "op", "shapes", "dtype", "peer", "state"})
_KIND_ORDER = {k: i for i, k in enumerate(["missing", "op", "shape", "dtype", "order"])}


@dataclasses.dataclass(frozen=True)
class _Call:
    rank: int
    seq: int
    group: str
    members: tuple
    op: str
    shapes: tuple
    dtype: str
    peer: object

    @property
    def what(self):
        return (self.op, self.shapes, self.dtype)

    @classmethod
    def parse(cls, rank, world, record):
        if type(record) is not dict or frozenset(record) != _FIELDS:
            raise ValueError(f"rank {rank}: not a record with the eight keys: {record!r}")
        op, peer, group, members = record["op"], record["peer"], record["group"], record["members"]
        if op not in _OPS:
            raise ValueError(f"rank {rank}: op {op!r} is unknown")
        if record["state"] not in {"started", "completed"}:
            raise ValueError(f"rank {rank}: state {record['state']!r}")
        if type(record["dtype"]) is not str:
            raise ValueError(f"rank {rank}: dtype {record['dtype']!r} is not a string")
        shapes = record["shapes"]
        if type(shapes) is not list or any(type(s) is not list or any(type(d) is not int for d in s)
                                           for s in shapes):
            raise ValueError(f"rank {rank}: shapes {shapes!r} are not lists of ints")
        if type(group) is not str or group == "":
            raise ValueError(f"rank {rank}: group {group!r} is not a non-empty string")
        if type(members) is not list or not members or any(type(m) is not int for m in members):
            raise ValueError(f"rank {rank}: members {members!r} are not a list of ints")
        if (any(b <= a for a, b in zip(members, members[1:])) or members[0] < 0
                or members[-1] >= world or rank not in members):
            raise ValueError(f"rank {rank}: members {members!r} are not sorted ranks holding it")
        if (op in ("SEND", "RECV")) != (peer is not None):
            raise ValueError(f"rank {rank}: {op} with peer {peer!r}")
        if peer is not None and (type(peer) is not int or peer == rank or peer not in members):
            raise ValueError(f"rank {rank}: {op} with peer {peer!r}")
        if type(record["seq"]) is not int:
            raise ValueError(f"rank {rank}: seq {record['seq']!r}")
        return cls(rank, record["seq"], group, tuple(members), op,
                   tuple(tuple(s) for s in shapes), record["dtype"], peer)


class _Divergence(NamedTuple):
    seq: int
    group: str
    ranks: list
    kind: str


def _most_common(calls, members):
    """The reference: the most common call of those made, a tie going to the lowest rank's."""
    tally = {}
    for r in members:
        if r in calls:
            tally.setdefault(calls[r], []).append(r)
    if not tally:
        return None
    return sorted(tally.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))[0][0]


def _collective_divergences(group, members, lines):
    out = []

    def made(seq):
        return {r: lines[r][seq].what for r in members if len(lines.get(r, ())) > seq}

    for seq in range(max(map(len, lines.values()))):
        present = {r: lines[r][seq] for r in members if len(lines.get(r, ())) > seq}
        if present[min(present)].op in ("SEND", "RECV"):
            continue
        if len(present) != len(members):
            out.append(_Divergence(seq, group, [r for r in members if r not in present], "missing"))
            continue
        now, following = made(seq), made(seq + 1)
        reference = _most_common(now, members)
        odd = [r for r in members if now[r] != reference]
        if not odd:
            continue
        reference_next = _most_common(following, members)
        if reference_next is not None and all(
                r in following and now[r] == reference_next and following[r] == reference
                for r in odd):
            kind = "order"
        elif any(present[r].op != reference[0] for r in odd):
            kind = "op"
        elif any(present[r].shapes != reference[1] for r in odd):
            kind = "shape"
        else:
            kind = "dtype"
        out.append(_Divergence(seq, group, odd, kind))
    return out


def _p2p_divergences(group, members, lines):
    out = []
    for src in members:
        for dst in members:
            sent = [c for c in lines.get(src, ()) if c.op == "SEND" and c.peer == dst]
            got = [c for c in lines.get(dst, ()) if c.op == "RECV" and c.peer == src]
            for k in range(max(len(sent), len(got))):
                s = sent[k] if k < len(sent) else None
                g = got[k] if k < len(got) else None
                if s is None:
                    out.append(_Divergence(g.seq, group, [src], "missing"))
                elif g is None:
                    out.append(_Divergence(s.seq, group, [dst], "missing"))
                elif s.shapes != g.shapes:
                    out.append(_Divergence(min(s.seq, g.seq), group, sorted([src, dst]), "shape"))
                elif s.dtype != g.dtype:
                    out.append(_Divergence(min(s.seq, g.seq), group, sorted([src, dst]), "dtype"))
    return out


def diagnose(traces):
    """The first divergence in per-rank collective traces, or None."""
    if type(traces) is not list:
        raise ValueError("traces must be a list of per-rank lists")
    world = len(traces)
    by_group, members_of, last_call = {}, {}, {}
    for rank, records in enumerate(traces):
        if type(records) is not list:
            raise ValueError(f"the trace of rank {rank} is not a list")
        for record in records:
            call = _Call.parse(rank, world, record)
            if members_of.setdefault(call.group, call.members) != call.members:
                raise ValueError(f"group {call.group} is given two member lists")
            line = by_group.setdefault(call.group, {}).setdefault(rank, [])
            if call.seq != len(line):
                raise ValueError(f"rank {rank}: seq {call.seq} on {call.group} should be "
                                 f"{len(line)} (seqs go 0, 1, 2, ...)")
            line.append(call)
            last_call[rank] = call
    # each group's own divergence: its smallest seq, then ranks, then kind
    own = {}
    for group, lines in by_group.items():
        members = members_of[group]
        found = _p2p_divergences(group, members, lines) + \
            _collective_divergences(group, members, lines)
        if found:
            own[group] = sorted(found, key=lambda d: (d.seq, d.ranks, _KIND_ORDER[d.kind]))[0]
    # where each rank waits: the divergence its last call is in (if any)
    waiting_in = {}
    for rank, call in last_call.items():
        d = own.get(call.group)
        if d is not None and call.seq >= d.seq:
            waiting_in[rank] = call.group
    blocked = {g for g, d in own.items() if d.kind == "missing" and
               any(waiting_in.get(r, g) != g for r in d.ranks)}
    candidates = [d for g, d in own.items() if g not in blocked] or list(own.values())
    if not candidates:
        return None
    first = sorted(candidates,
                   key=lambda d: (d.seq, list(members_of[d.group]), d.group, d.ranks))[0]
    return {"group": first.group, "seq": first.seq, "kind": first.kind, "ranks": first.ranks}
''',
    "save_checkpoint": '''\
import hashlib
import io
import json
import secrets
import shutil

_MARK = "COMMITTED"


def _flush(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _blake(data):
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _complete(directory):
    """{step: folder} of the checkpoints whose marker exists (the last one of a step wins)."""
    found = {}
    if not os.path.isdir(directory):
        return found
    with os.scandir(directory) as entries:
        for entry in entries:
            parts = entry.name.split(".")
            if (len(parts) == 3 and parts[0] == "ckpt" and parts[1].isdigit()
                    and os.path.exists(os.path.join(entry.path, _MARK))):
                found[int(parts[1])] = entry.path
    return found


def save_checkpoint(directory, state, step, keep=2):
    """Save state as step's checkpoint in directory: written, flushed, committed; keep the last keep."""
    os.makedirs(directory, exist_ok=True)
    folder = os.path.join(directory, f"ckpt.{step:010d}.{secrets.token_hex(6)}")
    os.mkdir(folder)
    entries = {}
    for index, (key, value) in enumerate(state.items()):
        if torch.is_tensor(value):
            name = f"t{index}.pt"
            target = os.path.join(folder, name)
            torch.save(value.detach().cpu(), target)
            _flush(target)
            with open(target, "rb") as f:
                entries[key] = {"file": name, "blake2b": _blake(f.read())}
        else:
            entries[key] = {"value": value}
    body = json.dumps({"step": step, "entries": entries}, sort_keys=True)
    manifest = json.dumps({"body": body, "blake2b": _blake(body.encode())})
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write(manifest)
        f.flush()
        os.fsync(f.fileno())
    _flush(folder)
    Path(folder, _MARK).touch()          # the commit: the marker exists, or it does not
    _flush(folder)
    _flush(directory)
    complete = _complete(directory)
    for old in sorted(complete)[:-keep]:
        try:
            os.unlink(os.path.join(complete[old], _MARK))   # no longer complete, then gone
        except FileNotFoundError:
            pass
        shutil.rmtree(complete[old], ignore_errors=True)
''',
    "load_latest": '''\
def _read_checkpoint(folder):
    """{key: value} and the step of an intact checkpoint folder, or None."""
    try:
        with open(os.path.join(folder, "manifest.json"), "rb") as f:
            outer = json.loads(f.read().decode())
        body = outer["body"]
        if _blake(body.encode()) != outer["blake2b"]:
            return None
        inner = json.loads(body)
        values = {}
        for key, item in inner["entries"].items():
            if "file" in item:
                with open(os.path.join(folder, item["file"]), "rb") as f:
                    data = f.read()
                if _blake(data) != item["blake2b"]:
                    return None
                values[key] = torch.load(io.BytesIO(data), weights_only=True)
            else:
                values[key] = item["value"]
        return inner["step"], values
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


def load_latest(directory, state):
    """Load the latest complete, intact checkpoint of directory into state; its step, or None."""
    complete = _complete(directory)
    for step in sorted(complete, reverse=True):
        found = _read_checkpoint(complete[step])
        if found is None:
            continue
        saved_step, values = found
        for key, value in values.items():      # only now: everything was checked
            old = state.get(key)
            if (torch.is_tensor(old) and torch.is_tensor(value) and old.shape == value.shape
                    and old.dtype == value.dtype):
                with torch.no_grad():
                    old.copy_(value)
            else:
                state[key] = value
        return saved_step
    return None
''',
    "train_resumable": '''\
def global_batch(seed, step, n, batch_size):
    """The sample ids of global batch `step`: each epoch reads a permutation seeded by it."""
    epoch, k = divmod(step, n // batch_size)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


def train_resumable(model_fn, dataset, *, steps, batch_size, lr, checkpoint_every, directory,
                    seed, log):
    """Data-parallel momentum SGD that resumes exactly from its latest checkpoint."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_fn()
    noise_rng = torch.Generator().manual_seed(seed)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)

    def to_state():
        # what the steps after this one depend on: weights, velocities, the noise generator
        out = {"noise": noise_rng.get_state()}
        for n, p in zip(names, params):
            buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
            out["w:" + n] = p.detach().clone()
            out["v:" + n] = torch.zeros_like(p) if buf is None else buf.clone()
        return out

    restored = to_state()
    first = load_latest(directory, restored)
    if first is None:
        first = 0
    else:
        with torch.no_grad():
            for n, p in zip(names, params):
                p.copy_(restored["w:" + n])
                opt.state[p]["momentum_buffer"] = restored["v:" + n].clone()
        noise_rng.set_state(restored["noise"])
    rows = slice(rank, batch_size, world)          # strided: rows rank, rank + W, ...
    for step in range(first, steps):
        ids = global_batch(seed, step, len(dataset), batch_size)
        xs, ys = zip(*(dataset[i] for i in ids[rows]))
        x, y = torch.stack(xs), torch.stack(ys)
        noise = 0.01 * torch.randn(batch_size, *x.shape[1:], generator=noise_rng,
                                   dtype=torch.float64)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x + noise[rows]) - y) ** 2).sum() / batch_size
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)                      # every gradient and the loss, one call
        torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in params])
        opt.step()
        log(step, flat[-1].item())
        # every rank holds the same state: the last one saves, nobody waits for it
        if (step + 1) % checkpoint_every == 0 and rank == world - 1:
            save_checkpoint(directory, to_state(), step + 1)
    return model.state_dict()
''',
    "async_save": '''\
import concurrent.futures

_WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")


class _Saving:
    def __init__(self, future):
        self._future = future

    def wait(self):
        self._future.result()     # re-raises what the save raised


def _stage(value):
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def async_save(directory, state, step):
    """Stage state, then save it as step's checkpoint in the background; a handle with wait()."""
    frozen = {key: _stage(value) for key, value in state.items()}
    # one writer thread: pending saves commit one after the other, in the order of the calls
    return _Saving(_WRITER.submit(save_checkpoint, directory, frozen, step))
''',
}
