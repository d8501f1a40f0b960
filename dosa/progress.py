"""Progress of long runs (benchmarks, the demo, ``testbed up`` with many hosts): a bar on a
terminal, plain lines when the output is not one (a log file, CI, a pipe).

One helper for every caller, so they all look and behave alike::

    from dosa.progress import progress, track

    with progress(total=len(methods), desc="dosa bench allreduce", unit="method") as p:
        for m in methods:
            p.note(f"{m} ...")          # a line above the bar (or a plain line)
            run(m)
            p.update(1)
    for rnd in track(range(rounds), desc="rounds", unit="round"):
        ...

The bar is tqdm's (on stderr, where progress belongs: stdout keeps the results). Without a
terminal an update prints a line ``desc: 3/8 method (38%), 12.4 s`` -- the first, then at most
one every ``every`` seconds (default 5), and always the last -- so a log shows the run advancing
without a line per step. ``DOSA_PROGRESS=bar|lines|off`` overrides the choice.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")
MODES = ("bar", "lines", "off")


def _mode(stream: TextIO) -> str:
    m = os.environ.get("DOSA_PROGRESS", "").strip().lower()
    if m in MODES:
        return m
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # closed or not a real file
        return "lines"


class Progress:
    """A counter towards ``total`` shown as a bar or as lines (see the module doc)."""

    def __init__(self, total: int | None, desc: str, unit: str = "step", stream: TextIO | None = None,
                 every: float = 5.0, mode: str | None = None):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode or _mode(self.stream)
        if self.mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, not {self.mode!r}")
        self.n = 0
        self.t0 = time.monotonic()
        self._last_line = -1e9
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True,
                             leave=True, mininterval=0.2)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, status: str | None = None) -> None:
        """``n`` more done; ``status`` (optional) is shown after the count."""
        self.n += n
        if self._bar is not None:
            if status:
                self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(n)
        elif self.mode == "lines":
            now = time.monotonic()
            last = self.total is not None and self.n >= self.total
            if last or now - self._last_line >= self.every:
                self._last_line = now
                self._line(status)

    def note(self, text: str) -> None:
        """A message line that does not break the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.mode == "lines":
            print(text, file=self.stream, flush=True)

    def _line(self, status: str | None) -> None:
        if self.total:
            count = f"{self.n}/{self.total} {self.unit} ({100 * self.n // self.total}%)"
        else:
            count = f"{self.n} {self.unit}"
        extra = f", {status}" if status else ""
        print(f"{self.desc}: {count}, {time.monotonic() - self.t0:.1f} s{extra}", file=self.stream,
              flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress(total: int | None, desc: str, unit: str = "step", **kw) -> Progress:
    """A :class:`Progress` (use it as a context manager)."""
    return Progress(total, desc, unit, **kw)


def track(items: Iterable[T], desc: str, total: int | None = None, unit: str = "step",
          **kw) -> Iterator[T]:
    """Iterate over ``items`` showing progress (``total`` from ``len(items)`` when it has one)."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(total, desc, unit, **kw) as p:
        for x in items:
            yield x
            p.update(1)
