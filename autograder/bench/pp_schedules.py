"""``python -m autograder.bench pp_schedules [--procs 2 4] [--micro-batches 8] [--depth 16]
[--width 512] [--rows 64] [--schedules NAME ...] [--repeats 5] [--warmup 1] [--out DIR]``: torch's
pipeline schedules side by side on this machine, for module 10 (lesson 18, Assignment 10).

Everything that schedules is torch's own (``torch.distributed.pipelining``: ``PipelineStage``
and the schedule classes below); the theory is :mod:`course.schedules`. None of A10's answers is
here (no list builder, no executor, no split backward of its own), so the student edition keeps
it. Details and a measured table: docs/benchmarks.md.

The model: ``--depth`` blocks of ``Linear(w, w)`` + ReLU, float64, cut into p·v stages of equal
depth; rank r holds the stages torch's ``generate_stage_to_rank_mapping`` gives it (round robin,
or a V). One step is one ``schedule.step`` over m micro-batches of ``--rows`` rows with
``MSELoss`` (forward and backward, no optimizer). Per schedule and p:

- **step s**: median over ``--repeats`` steps (after ``--warmup``) of the slowest rank's seconds,
  each step started from a barrier;
- **bubble**: predicted, ``bubble(check(lists, m))`` of torch's ``pipeline_order`` for (p, m, v)
  (F = 1, B = 2, I = W = 1); measured, the same ratio (idle over compute, the whole step) of the
  timeline recorded by wrapping each stage's ``forward_one_chunk``, ``backward_one_chunk`` and
  ``backward_weight_one_chunk``, median over the steps;
- **memory**: predicted, ``peak_in_flight(lists) / v`` per rank (micro-batches of a rank's share
  of the layers); measured, the peak of the bytes autograd holds for the backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each saved tensor once, parameters left out, held
  until autograd drops it), per rank, in MiB and in units of what one micro-batch's forward
  through depth/p blocks saves;
- **messages**: predicted, ``messages(lists)``; sent, the sends the ranks issued in one step;
- **same**: the gradients of every stage equal a one-process float64 run of the whole batch
  (largest relative difference < 1e-10).

A schedule torch refuses for (p, m) (its constructor's ValueError) is a row that says why. The
ranks are CPU processes on gloo, one thread each, standing in for GPUs (GPUs on NCCL where
there is one per process).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

PROCS, MICRO, DEPTH, WIDTH, ROWS = [2, 4], 8, 16, 512, 64
TOLERANCE = 1e-10
#: name -> (torch class, stages per rank, placement for generate_stage_to_rank_mapping)
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1, "loop"),
    "1F1B": ("Schedule1F1B", 1, "loop"),
    "interleaved 1F1B": ("ScheduleInterleaved1F1B", 2, "loop"),
    "ZB-H1": ("ScheduleInterleavedZeroBubble", 1, "loop"),
    "interleaved ZB": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "ZBV": ("ScheduleZBVZeroBubble", 2, "v"),
    "DualPipeV": ("ScheduleDualPipeV", 2, "v"),
}


# ----------------------------------------------------------------------------- theory

def predict(name: str, p: int, m: int, depth: int) -> dict:
    """What course.schedules says of torch's lists for (p, m): bubble, peaks, messages; or why
    the schedule is skipped (torch's ValueError, or a depth that does not split)."""
    from course import schedules as sch

    cls, v, _ = SCHEDULES[name]
    if depth % (p * v):
        return {"skipped": f"depth {depth} does not split into {p * v} stages"}
    try:
        lists = sch.torch_order(cls.removeprefix("Schedule"), p, m, v)
    except ValueError as err:
        return {"skipped": f"torch refuses: {err}"}
    try:
        timeline = sch.check(lists, n_micro=m)
    except ValueError:
        if name != "1F1B":
            raise
        # torch 2.11-2.15's Schedule1F1B names its last rank's forwards 1..m in these lists (its
        # runtime runs its own loop, not them; lesson 18, section 1): renumbered 0..m-1 in order
        forwards = iter(range(m))
        lists[p - 1] = [a if a is None or a.computation_type.value != "F"
                        else a._replace(microbatch_index=next(forwards)) for a in lists[p - 1]]
        timeline = sch.check(lists, n_micro=m)
    return {"skipped": None, "bubble": sch.bubble(timeline), "messages": sch.messages(lists),
            "in_flight": [n / v for n in sch.peak_in_flight(lists)]}


# ----------------------------------------------------------------------------- the ranks

def build_model(depth: int, width: int):
    """The whole model, float64, the same on every rank (seeded)."""
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, dtype=torch.float64), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


class SavedBytes:
    """Bytes autograd holds for the backward, now and at the peak: as ``saved_tensors_hooks``,
    each tensor counted once (by address and size) while any saved copy of it is held; tensors
    in the storage of a parameter (``skip``: their addresses) are not counted."""

    def __init__(self, skip: set):
        self.skip, self.held, self.now, self.peak = skip, {}, 0, 0

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda kept: kept.tensor)

    def pack(self, tensor):
        return _Kept(self, tensor)

    def add(self, key: tuple, sign: int) -> None:
        """One more (+1) or one fewer (-1) saved copy of the tensor ``key`` (address, bytes)."""
        count = self.held.pop(key, 0) + sign
        if count:
            self.held[key] = count
        if count == 1 and sign > 0:
            self.now += key[1]
            self.peak = max(self.peak, self.now)
        elif not count:
            self.now -= key[1]


class _Kept:
    """One saved tensor, as autograd keeps it; its release is counted when autograd drops it."""

    def __init__(self, counter: SavedBytes, tensor):
        # detached: a tensor saved as its node's output would otherwise hold that node (its
        # grad_fn), which holds this object, a cycle no collector sees (torch saves outputs
        # without their grad_fn); a backward that keeps the graph would then never free it
        self.tensor, self.counter = tensor.detach(), counter
        self.key = None
        if tensor.untyped_storage().data_ptr() not in counter.skip:
            self.key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            counter.add(self.key, +1)

    def __del__(self):
        if self.key is not None:
            self.counter.add(self.key, -1)


def record(stage, records: list, device):
    """Note (stage, kind, micro-batch, start, end) of every F, B, I and W the stage runs (as
    lesson 18 does)."""
    from course.devices import synchronize

    def timed(method, kind_of):
        def call(mb, *args, **kwargs):
            synchronize([device])
            start = time.perf_counter()
            out = method(mb, *args, **kwargs)
            synchronize([device])
            records.append((stage.stage_index, kind_of(kwargs), mb, start, time.perf_counter()))
            return out
        return call

    stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda kw: "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk,
                                     lambda kw: "B" if kw.get("full_backward", True) else "I")
    stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, lambda kw: "W")
    return stage


def no_message_to_itself(stage):
    """torch 2.11 sends a stage's first (warm-up) message to its neighbours even where one is on
    its own rank (a V's turn), which gloo cannot do; later releases skip it (lesson 18)."""
    exchange = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if exchange is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in exchange()
                                                     if op.group_peer != stage.group_rank]
    return stage


def rank_worker(rank: int, world_size: int, names: list[str], m: int, depth: int, width: int,
                rows: int, warmup: int, repeats: int) -> list[dict]:
    """Every schedule in turn on this rank: per timed step its seconds, records, saved-bytes
    peak and sends; its gradients' largest relative difference from one process."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from course.collectives import watch_group
    from course.devices import synchronize
    from course.launch import device_for

    device = device_for(rank)  # the CPU on gloo; its own GPU on NCCL
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * rows, width, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(m * rows, width, generator=g, dtype=torch.float64).to(device)
    reference = build_model(depth, width).to(device)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    share = SavedBytes({q.untyped_storage().data_ptr() for q in reference.parameters()})
    with share.hooks():  # the unit: one micro-batch through a rank's share of the layers
        out = reference[:2 * depth // world_size](x[:rows])
    unit = share.now
    del out
    results = []
    for name in names:
        cls_name, v, style = SCHEDULES[name]
        n_stages = world_size * v
        mapping = generate_stage_to_rank_mapping(world_size, n_stages, style=style)
        mine = [s for s in range(n_stages) if mapping[s] == rank]
        model, per = build_model(depth, width).to(device), 2 * depth // n_stages
        parts = {s: model[s * per:(s + 1) * per] for s in mine}
        records: list = []
        stages = [no_message_to_itself(record(PipelineStage(parts[s], s, n_stages, device),
                                              records, device)) for s in mine]
        cls = getattr(torch_schedules, cls_name)
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        schedule = cls(stages[0] if single else stages, n_microbatches=m,
                       loss_fn=torch.nn.MSELoss())
        inputs = (x,) if 0 in mine else ()
        target = {"target": y} if n_stages - 1 in mine else {}
        steps = []
        for i in range(max(1, warmup) + repeats):  # the first step also exchanges shapes
            model.zero_grad(set_to_none=True)
            records.clear()
            counter, sends = SavedBytes({q.untyped_storage().data_ptr()
                                         for q in model.parameters()}), []
            synchronize([device])
            dist.barrier()
            start = time.perf_counter()
            with counter.hooks(), watch_group(None, lambda op, *_: sends.append(op)
                                              if op == "SEND" else None):
                schedule.step(*inputs, **target)
            synchronize([device])
            took = time.perf_counter() - start
            if i >= max(1, warmup):
                steps.append({"seconds": took, "records": list(records), "peak": counter.peak,
                              "sends": len(sends)})
        diff = 0.0
        for s in mine:
            want = reference[s * per:(s + 1) * per].parameters()
            for got, ref in zip(parts[s].parameters(), want, strict=True):
                scale = max(ref.grad.abs().max().item(), 1e-300)
                diff = max(diff, (got.grad - ref.grad).abs().max().item() / scale)
        results.append({"name": name, "steps": steps, "diff": diff, "unit": unit})
        dist.barrier()
    return results


# ----------------------------------------------------------------------------- the driver

def measure(procs: list[int], names: list[str], *, m: int = MICRO, depth: int = DEPTH,
            width: int = WIDTH, rows: int = ROWS, warmup: int = 1, repeats: int = 5,
            timeout: float = 600.0, echo=print) -> list[dict]:
    """One row per (p, schedule): the prediction, and the medians of the measured steps."""
    from course import schedules as sch
    from course.launch import PRELOAD_ENV, LaunchError, launch

    # the fork server imports torch's pipelining once for every rank
    os.environ.setdefault(PRELOAD_ENV, "torch.distributed.pipelining,course.collectives")
    rows_out = []
    for p in procs:
        mine = []
        for name in names:
            row = {"schedule": name, "p": p, "v": SCHEDULES[name][1], **predict(name, p, m, depth)}
            rows_out.append(row)
            if row["skipped"]:
                echo(f"{name} x{p}: skipped ({row['skipped']})")
            else:
                mine.append(row)
        if not mine:
            continue
        try:
            ranks = launch(rank_worker, p, [r["schedule"] for r in mine], m, depth, width, rows,
                           warmup, repeats, quiet=True, timeout=timeout,
                           collective_timeout=max(120.0, timeout / 2))
        except (LaunchError, TimeoutError) as err:  # a busy machine: keep the others
            for row in mine:
                row["skipped"] = f"failed: {str(err).splitlines()[0]}"
            echo(f"x{p}: {str(err).splitlines()[0]}")
            continue
        for i, row in enumerate(mine):
            runs = [r[i] for r in ranks]
            steps = list(zip(*(run["steps"] for run in runs)))  # per step: every rank's
            bubbles = [sch.bubble({rank: [(sch.Op(s, kind, mb), a, b) for s, kind, mb, a, b
                                          in step["records"]] for rank, step in enumerate(step)})
                       for step in steps]
            unit = runs[0]["unit"]
            peaks = [max(step["peak"] for step in run["steps"]) for run in runs]
            row.update(seconds=statistics.median(max(s["seconds"] for s in step) for step in steps),
                       measured_bubble=statistics.median(bubbles), unit=unit, saved=peaks,
                       saved_units=[b / unit for b in peaks], diff=max(run["diff"] for run in runs),
                       sent=max(sum(s["sends"] for s in step) for step in steps))
            echo(f"{row['schedule']} x{p}: {row['seconds']:.3f} s, bubble {row['bubble']:.3f} "
                 f"predicted, {row['measured_bubble']:.3f} measured")
    return rows_out


# ----------------------------------------------------------------------------- output

HEAD = ["schedule", "p", "v", "step s", "bubble predicted", "bubble measured",
        "in flight/rank predicted", "saved/rank measured", "saved MiB max", "messages", "sent",
        "grad diff", "same"]


def _per_rank(values: list[float]) -> str:
    return " ".join(f"{x:.1f}" for x in values)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table; a skipped or failed row says why in its fourth cell."""
    lines = []
    for r in rows:
        first = [r["schedule"], str(r["p"]), str(r["v"])]
        if r["skipped"]:
            lines.append(first + [r["skipped"]] + [""] * (len(HEAD) - 4))
            continue
        lines.append(first + [
            f"{r['seconds']:.3f}", f"{r['bubble']:.3f}", f"{r['measured_bubble']:.3f}",
            _per_rank(r["in_flight"]), _per_rank(r["saved_units"]),
            f"{max(r['saved']) / 2**20:.2f}", str(r["messages"]), str(r["sent"]),
            f"{r['diff']:.0e}", "yes" if r["diff"] < TOLERANCE else "NO"])
    lines = [[cell.replace("|", "/") for cell in cells] for cells in lines]
    rule = ["---" if i < 1 else "---:" for i in range(len(HEAD))]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [HEAD, rule, *lines])


def main(argv: list[str] | None = None) -> int:
    from .common import OUT, introduce, parser

    p = parser("pp_schedules",
               "torch's pipeline schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1, interleaved "
               "zero bubble, ZBV, DualPipeV) on 2 and 4 processes: step time, bubble and peak "
               "activation memory, predicted by course.schedules and measured; messages; "
               "gradients against one process.", repeats=5, out="the table (pp_schedules.md)")
    p.add_argument("--procs", type=int, nargs="+", default=PROCS,
                   help=f"process counts p ({' '.join(map(str, PROCS))})")
    p.add_argument("--micro-batches", type=int, default=MICRO, help=f"micro-batches m ({MICRO})")
    p.add_argument("--depth", type=int, default=DEPTH,
                   help=f"Linear + ReLU blocks; divisible by p x v ({DEPTH})")
    p.add_argument("--width", type=int, default=WIDTH, help=f"features of every block ({WIDTH})")
    p.add_argument("--rows", type=int, default=ROWS, help=f"rows per micro-batch ({ROWS})")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES),
                   metavar="NAME", help="which schedules (all: " + ", ".join(SCHEDULES) + ")")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps first, at least 1: the first step also sends the stages' "
                        "shapes and a warm-up message to each neighbour (1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (600)")
    args = p.parse_args(argv)

    introduce(max(args.procs))
    began = time.time()
    rows = measure(args.procs, args.schedules, m=args.micro_batches, depth=args.depth,
                   width=args.width, rows=args.rows, warmup=args.warmup, repeats=args.repeats,
                   timeout=args.timeout)
    text = (f"{args.depth} x (Linear({args.width}, {args.width}) + ReLU), float64, m = "
            f"{args.micro_batches} micro-batches of {args.rows} rows, MSELoss, forward + backward "
            f"(median of {args.repeats} steps after {args.warmup}; step s: slowest rank; bubble: "
            f"idle / compute over the step, predicted from torch's lists with F = 1, B = 2, "
            f"I = W = 1, measured from the recorded actions; in flight: course.schedules' peak "
            f"per rank / v, saved: measured peak of saved-for-backward bytes per rank, both in "
            f"micro-batches of depth/p blocks; messages: counted from the lists, sent: by the "
            f"ranks in one step; grad diff: largest relative difference from one process, same "
            f"if < {TOLERANCE:g}):\n{table(rows)}\n")
    print(f"\n{text}\n{time.time() - began:.0f} s")
    out = Path(args.out or OUT)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pp_schedules.md").write_text(text)
    print(f"saved {out / 'pp_schedules.md'}")
    bad = [r for r in rows if str(r["skipped"]).startswith("failed")
           or not r["skipped"] and r["diff"] >= TOLERANCE]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
