"""What ``make gpu-check`` found, as data (``gpu-report.json``) and for people (``gpu-report.md``).

A report is a list of sections (lessons, grading, NCCL, torchrun, ``course.launch``,
bandwidth), each a list of items with a status. Only ``failed`` items make the command exit
non-zero: ``skipped`` says what this hardware cannot show (with the reason, e.g. a check that
needs two GPUs on a one-GPU machine), ``expected failure`` is a failure the check provokes on
purpose to show why the toolkit avoids it, and ``info`` carries figures.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATUSES = ("passed", "failed", "skipped", "expected failure", "info")


@dataclass
class Item:
    name: str
    status: str
    detail: str = ""
    figures: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")


@dataclass
class Section:
    key: str
    title: str
    items: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ran: bool = True        # False: not run on this machine (no GPU, or left out with --only)
    why_not: str = ""

    def add(self, name: str, status: str, detail: str = "", **figures) -> Item:
        item = Item(name, status, detail, figures)
        self.items.append(item)
        return item

    @property
    def status(self) -> str:
        if not self.ran:
            return "not run"
        if any(i.status == "failed" for i in self.items):
            return "failed"
        return "passed" if self.items else "empty"


@dataclass
class Report:
    date: str
    host: str
    gpu_found: bool
    environment: dict
    sections: list[Section] = field(default_factory=list)

    def failures(self) -> list[str]:
        return [f"{s.title}: {i.name}: {i.detail}" for s in self.sections for i in s.items
                if i.status == "failed"]

    def exit_code(self) -> int:
        """Non-zero when anything that should work on this hardware failed."""
        return 1 if self.failures() else 0

    def to_dict(self) -> dict:
        return {"date": self.date, "host": self.host, "gpu_found": self.gpu_found,
                "environment": self.environment,
                "sections": [{**asdict(s), "status": s.status} for s in self.sections],
                "failures": self.failures(), "exit_code": self.exit_code()}


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def _figures(figures: dict) -> str:
    parts = []
    for k, v in figures.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, (list, tuple)):
            v = ", ".join(map(str, v)) or "none"
        parts.append(f"{k}: {v}")
    return "; ".join(parts)


def markdown(report: Report) -> str:
    env = report.environment
    gpus = env.get("gpus") or []
    model = ", ".join(sorted({g["name"] for g in gpus})) if gpus else "no CUDA GPU"
    lines = [f"# GPU verification report: {model}", "",
             f"Made by `make gpu-check` (`python -m autograder.gpu_check`) on {report.date}, host "
             f"`{report.host}`.", ""]
    if not report.gpu_found:
        lines += ["**No CUDA GPU was found on this machine.** Only the start-up checks ran (the "
                  "command, its imports, the grader's CLI, the notebooks and torchrun are in "
                  "place); every GPU section below is *not run*. Run `make gpu-check` on a "
                  "machine with an NVIDIA GPU and commit its `gpu-report.md` as "
                  "`docs/gpu-report.md`.", ""]
    failures = report.failures()
    lines += [f"**Result: {'FAILED, ' + str(len(failures)) + ' failure(s)' if failures else 'passed'}** "
              f"(exit code {report.exit_code()}).", "", "## Environment", "",
              "| what | value |", "| --- | --- |"]
    for key, value in env.items():
        if key == "gpus":
            continue
        lines.append(f"| {key} | {_cell(value)} |")
    if gpus:
        lines += ["", "| GPU | name | memory | compute capability | multiprocessors |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {g['index']} | {g['name']} | {g['memory_gib']:.1f} GiB | "
                  f"{g['capability']} | {g['multiprocessors']} |" for g in gpus]
    for s in report.sections:
        lines += ["", f"## {s.title}: {s.status}", ""]
        if not s.ran:
            lines += [f"Not run: {s.why_not}"]
            continue
        lines += [f"- {n}" for n in s.notes]
        if s.notes:
            lines.append("")
        lines += ["| item | status | detail | figures |", "| --- | --- | --- | --- |"]
        lines += [f"| {_cell(i.name)} | {i.status} | {_cell(i.detail)} | {_cell(_figures(i.figures))} |"
                  for i in s.items]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {_cell(f)}" for f in failures]
    return "\n".join(lines) + "\n"


def write(report: Report, out: Path) -> tuple[Path, Path]:
    """``gpu-report.md`` and ``gpu-report.json`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "gpu-report.md", out / "gpu-report.json"
    md.write_text(markdown(report))
    js.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    return md, js
