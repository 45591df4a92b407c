"""What the grader and its worker agree on: length-prefixed frames between them, the one door
through which the worker's data enters the grader (:func:`decode_reply`, weights-only
unpickling), and the environment variable that tells a worker to warm up ranks."""
from __future__ import annotations

import io
import os
import select
import struct
import time


#: The largest reply the grader reads (the largest any probe needs is a few MiB of tensors).
MAX_REPLY_BYTES = int(os.environ.get("AUTOGRADER_MAX_REPLY_MB", "256")) << 20

#: Set by the parent for assignments whose checks start ranks (spec.rank_modules).
WARM_RANKS_ENV = "AUTOGRADER_WARM_RANKS"


class BadReply(Exception):
    """The child replied with something the grader does not accept."""



def write_frame(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_frame(fd: int, deadline: float | None = None, on_wait=None,
               limit: int | None = None) -> bytes:
    """Read one frame; ``on_wait`` is called while waiting (the parent's watchdog). A frame
    announcing more than ``limit`` bytes raises :class:`BadReply` before any of it is read."""
    header = _read_exact(fd, 8, deadline, on_wait)
    (size,) = struct.unpack("<Q", header)
    if limit is not None and size > limit:
        raise BadReply(f"your code's result was {_size(size)}, more than the "
                       f"{_size(limit)} the grader reads from one call; return smaller values")
    return _read_exact(fd, size, deadline, on_wait)


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _read_exact(fd, size, deadline, on_wait):
    chunks, got = [], 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], min(left, 0.05))
            if not ready:
                if on_wait:
                    on_wait()
                continue
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def decode_reply(data: bytes):
    """The only way child data enters the grader: weights-only unpickling, on the CPU."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadReply("the code returned an object the grader does not accept (only plain "
                       f"torch.Tensor, numbers, strings, lists and dicts): {first[:300]}") from None


