"""Progress of a long loop: a tqdm bar on a terminal, plain lines in a log.

A bar redraws itself in place on a terminal; redirected to a file it writes a line per update (a 200-step run left
~400 bar lines in its log). Where stderr is not a terminal, `progress` prints one line every `every_s` seconds or
every tenth of the loop, whichever comes first, plus the last step — the same postfix values, readable with grep.

    bar = progress(range(start, total), desc="GRPO", initial=start, total=total)
    for step in bar:
        bar.set_postfix(reward="0.41")
        bar.write("a line of its own")
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def progress(iterable: Iterable[Any], *, desc: str, total: int, initial: int = 0, every_s: float = 30.0) -> Any:
    """A tqdm bar over `iterable` when stderr is a terminal, else a `LineProgress`."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, unit="step", initial=initial, total=total)
    return LineProgress(iterable, desc=desc, total=total, initial=initial, every_s=every_s)


class LineProgress:
    """Progress as occasional lines on stderr (see the module docstring)."""

    def __init__(self, iterable: Iterable[Any], *, desc: str, total: int, initial: int = 0, every_s: float = 30.0):
        self.iterable, self.desc, self.total, self.done = iterable, desc, total, initial
        self.every_s, self.every_n = every_s, max(1, total // 10)
        self.postfix: dict[str, Any] = {}
        self.start = self.last = time.monotonic()

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            yield item
            self.done += 1
            now = time.monotonic()
            if self.done == self.total or self.done % self.every_n == 0 or now - self.last >= self.every_s:
                self._line(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def _line(self, now: float) -> None:
        self.last = now
        values = "".join(f", {k}={v}" for k, v in self.postfix.items())
        line = f"[meshrl] {self.desc}: {self.done}/{self.total} steps, {now - self.start:.0f} s{values}"
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass
