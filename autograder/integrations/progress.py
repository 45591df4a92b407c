"""Progress of folder grading: a bar on a terminal (tqdm: graded/total, failures, time left),
one plain line per submission otherwise (CI logs, files), flushed as each one finishes."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, stream=None, bar: bool | None = None, desc: str = "grading"):
        self.stream = stream or sys.stderr
        self.total, self.done, self.failures = total, 0, 0
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.bar = None
        if (isatty if bar is None else bar) and total:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=self.stream, unit="nb", dynamic_ncols=True,
                            desc=desc)

    def update(self, line: str, failed: bool, skipped: bool = False) -> None:
        """One submission finished (``skipped``: its earlier result was kept)."""
        self.done += 1
        self.failures += bool(failed)
        if self.bar is not None:
            self.bar.set_postfix_str(f"failures {self.failures}", refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {line}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
