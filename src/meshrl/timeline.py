"""When each actor was busy: intervals recorded in the actors themselves, gathered by the controller per RL step,
written to the run directory as data (`timeline.jsonl`) and as a Gantt-style chart (`timeline.png`).

The controller cannot see this from its side: in the asynchronous loop a generator starts a call when it finishes
the one before, not when the call was sent. So every actor process keeps a `BusyLog` of its own work (wall-clock
`time.time()`, comparable across processes of one host), and hands it over when asked.

    log = BusyLog("generator:0")
    with log.busy("generate"):
        ...
    log.take()    # [{"actor": "generator:0", "what": "generate", "start": 1732.1, "end": 1732.9}], then cleared
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Chart colours by kind of work (anything else: grey).
COLOURS = {
    "generate": "tab:blue",
    "pull_weights": "tab:cyan",
    "score": "tab:orange",
    "forward_backward": "tab:green",
    "forward": "tab:olive",
    "push_weights": "tab:red",
}


class BusyLog:
    """One process's busy intervals since the last `take`."""

    def __init__(self, actor: str) -> None:
        self.actor = actor
        self.intervals: list[dict[str, Any]] = []

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.intervals.append({"actor": self.actor, "what": what, "start": start, "end": time.time()})

    def take(self) -> list[dict[str, Any]]:
        out, self.intervals = self.intervals, []
        return out


def plot_timeline(intervals: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """A Gantt-style chart: one row per actor, one bar per interval, coloured by kind of work; seconds from the
    first interval's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    actors = sorted({i["actor"] for i in intervals}, key=lambda a: (a.split(":")[0] != "controller", a))
    t0 = min((i["start"] for i in intervals), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(actors) + 1.5))
    seen: set[str] = set()
    for row, actor in enumerate(actors):
        for i in (i for i in intervals if i["actor"] == actor):
            what = i["what"]
            label = what if what not in seen else None
            seen.add(what)
            ax.broken_barh(
                [(i["start"] - t0, max(i["end"] - i["start"], 1e-4))],
                (row - 0.4, 0.8),
                color=COLOURS.get(what, "tab:gray"),
                label=label,
            )
    ax.set_yticks(range(len(actors)), actors)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    if seen:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
