"""The benchmarks, one module each, behind one command:

    python -m autograder.bench                      # lists them
    python -m autograder.bench NAME [NAME ...]      # runs them in turn, with their defaults
    python -m autograder.bench NAME [OPTIONS]       # one, with its options (NAME --help)

:data:`BENCHMARKS` is the registry: a name, the module that holds the benchmark (a
``main(argv) -> int``, runnable alone as ``python -m autograder.bench.<module>`` too) and what
it measures. Adding one (modules 6-10; ``a9_resilience`` is module 9's, ``pp_schedules``
module 10's) is one module in this package and one line below.
Shared argument parsing, the machine header and plotting are in :mod:`.common`.

This file stays light (no torch, no grader imports): the listing must work anywhere, and a
module that is absent from this copy (the student edition leaves ``a4_sharding``,
``a6_context_parallel`` with ``cp_attention``, the attention it measures, and
``a7_expert_parallel`` with ``moe_dispatch``, its mixture-of-experts layer, out: they hold
Assignments 4's, 6's and 7's answers) is listed as such instead of breaking the command.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    what: str

    @property
    def available(self) -> bool:
        """Whether its module is in this copy (found without importing it)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:
            return False


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("a2_ddp", "autograder.bench.a2_ddp",
              "A2: weak scaling of the reference train_ddp on 1..N processes; its ring vs "
              "dist.all_reduce by message size (needs solutions/)"),
    Benchmark("a4_sharding", "autograder.bench.a4_sharding",
              "A4: per-rank bytes of parameters, gradients and optimizer state, ZeRO stages "
              "0-3; step time of per-parameter, bucketed and overlapped gradient averaging"),
    Benchmark("tp", "autograder.bench.tp",
              "A5 / lesson 13: dense vs tensor-parallel vs data-parallel MLP block, time and "
              "bytes sent (torch's own TP, no solution needed)"),
    Benchmark("a6_context_parallel", "autograder.bench.a6_context_parallel",
              "A6 / lesson 14: full attention vs ring attention vs Ulysses by sequence length "
              "on 1, 2, 4 processes: time, peak memory per rank, bytes sent"),
    Benchmark("a7_expert_parallel", "autograder.bench.a7_expert_parallel",
              "A7 / lesson 15: a mixture-of-experts layer, expert-parallel on 1, 2, 4 "
              "processes, E = 4, 8, 16, untrained vs balanced router: time, bytes sent per "
              "rank, load imbalance"),
    Benchmark("a9_resilience", "autograder.bench.a9_resilience",
              "A9 / lesson 17: torch.distributed.checkpoint save and load time and bytes per "
              "rank, sync vs async, 3 model sizes on 1, 2, 4 processes; kill-to-first-step "
              "restart time under torchrun"),
    Benchmark("pp_schedules", "autograder.bench.pp_schedules",
              "A10 / lesson 18: torch's pipeline schedules (GPipe, 1F1B, interleaved, zero "
              "bubble, ZBV, DualPipeV) on 2 and 4 processes: step time, bubble and activation "
              "memory predicted and measured, messages, gradients vs one process"),
    Benchmark("check-latency", "autograder.bench.check_latency",
              "how long check() takes in a kernel that imported torch, first and repeated, "
              "for A1 and A2, and a whole A1 grading, against `import torch` (needs solutions/)"),
    Benchmark("grading", "autograder.bench.grading",
              "the grader: seconds to grade each assignment's reference and stub, processes "
              "started, slowest checks; table into docs/benchmarks.md"),
]}

USAGE = """\
usage: python -m autograder.bench                   list the benchmarks
       python -m autograder.bench NAME [NAME ...]   run them in turn, each with its defaults
       python -m autograder.bench NAME [OPTIONS]    run one with options (NAME --help for them)"""


def listing() -> str:
    import textwrap

    width = max(map(len, BENCHMARKS))
    lines = ["Benchmarks (python -m autograder.bench NAME; NAME --help for its options):"]
    for b in BENCHMARKS.values():
        note = "" if b.available else " [not in this copy]"
        lines += textwrap.wrap(f"{b.name:<{width}}  {b.what}{note}", 96, initial_indent="  ",
                               subsequent_indent=" " * (width + 4))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Split ``argv`` into benchmark names (leading) and options (from the first word that is
    not a name); options go to one benchmark only, since each parses its own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-l", "--list"):
        print(listing())
        return 0
    if argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{listing()}")
        return 0
    names = []
    while argv and argv[0] in BENCHMARKS:
        names.append(argv.pop(0))
    if not names:
        print(f"unknown benchmark {argv[0]!r}\n{USAGE}\n\n{listing()}", file=sys.stderr)
        return 2
    if argv and len(names) > 1:
        print(f"options ({' '.join(argv)}) go to one benchmark at a time: run "
              f"python -m autograder.bench NAME [OPTIONS] for each", file=sys.stderr)
        return 2
    worst = 0
    for name in names:
        bench = BENCHMARKS[name]
        if not bench.available:
            print(f"{name}: its module {bench.module} is not in this copy (the student edition "
                  "leaves out what holds an assignment's answers)", file=sys.stderr)
            worst = max(worst, 1)
            continue
        if len(names) > 1:
            print(f"=== {name}: {bench.what}", flush=True)
        worst = max(worst, importlib.import_module(bench.module).main(argv) or 0)
    return worst
