"""The training dashboard: `<run dir>/training.png`, one panel per thing to look at when RL goes wrong, drawn from
the RL records of metrics.jsonl (a panel whose keys no record has is left out):

    reward (mean ± std over the step's samples, the verifier's accuracy)   completion length (model tokens)
    entropy (sampled estimate, or what the loss reports)                   KL to the reference (when measured)
    grad norm                                                              trainer/generator logprob mismatch
    time per phase (stacked)                                               memory per process and phase (GPU)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIME_PHASES = (
    ("time_generate_s", "generate"),
    ("time_score_s", "score"),
    ("time_advantages_s", "advantages"),
    ("time_train_s", "train"),
    ("time_weight_sync_s", "weight sync"),
)
# What the losses report (meshrl.losses), per loss token.
KL_LABELS = {
    "kl": "kl: policy to reference (grpo.kl_*)",
    "kl_k3": "kl_k3: generator to trainer (drift, k3)",
}
# memory/<phase>/<process>_<what>_gib (controller/memory.py)
_MEMORY_KEY = re.compile(r"^memory/(?P<phase>[^/]+)/(?P<proc>[A-Za-z]+\d+)_(?P<what>.+)_gib$")
# Per process and phase, the one figure drawn: the peak where the process reports it, else what it holds.
_MEMORY_PREFERENCE = ("peak", "reserved", "device_used", "allocated")


@dataclass
class Panel:
    title: str
    draw: Callable[[Any], None]  # draws on a matplotlib Axes


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _lines(
    records: Sequence[dict[str, Any]], keys: Sequence[str], *, log_scale: bool = False, labels: dict | None = None
) -> Callable:
    def draw(ax: Any) -> None:
        positive = True
        for key in keys:
            x, y = _series(records, key)
            ax.plot(x, y, label=(labels or {}).get(key, key))
            positive = positive and all(v > 0 for v in y)
        if log_scale and positive:
            ax.set_yscale("log")
        if len(keys) > 1 or labels:
            ax.legend(fontsize=7)

    return draw


def training_panels(records: Sequence[dict[str, Any]], *, logprob_gap_warn: float | None = None) -> list[Panel]:
    """The dashboard's panels for these records (RL records only are used)."""
    rl = [r for r in records if r.get("phase") == "rl"]
    keys = {k for r in rl for k in r}
    panels: list[Panel] = []

    def reward(ax: Any) -> None:
        x, mean = _series(rl, "reward_mean")
        _, std = _series(rl, "reward_std")
        ax.plot(x, mean, label="reward mean")
        if len(std) == len(mean):
            low, high = zip(*((m - s, m + s) for m, s in zip(mean, std, strict=True)), strict=True)
            ax.fill_between(x, low, high, alpha=0.15, label="± std")
        if "accuracy_sampled" in keys:
            ax.plot(*_series(rl, "accuracy_sampled"), "--", label="accuracy (sampled)")
        ax.legend(fontsize=7)

    if "reward_mean" in keys:
        panels.append(Panel("reward (mean ± std over samples)", reward))
    if "completion_len_mean" in keys:
        panels.append(Panel("completion length (model tokens, mean)", _lines(rl, ["completion_len_mean"])))
    entropy = sorted(k for k in keys if "entropy" in k)
    if entropy:
        panels.append(Panel("entropy (nats / token)", _lines(rl, entropy)))
    kl = [k for k in KL_LABELS if k in keys]
    if kl:
        panels.append(Panel("KL (nats / token)", _lines(rl, kl, labels=KL_LABELS)))
    if "grad_norm" in keys:
        panels.append(Panel("grad norm (before clipping)", _lines(rl, ["grad_norm"])))
    mismatch = [k for k in ("logprob_diff_mean", "logprob_diff_max") if k in keys]
    if mismatch:
        draw_mismatch = _lines(rl, mismatch, log_scale=True)

        def logprob_gap(ax: Any) -> None:
            draw_mismatch(ax)
            if logprob_gap_warn is not None:
                ax.axhline(logprob_gap_warn, color="red", linestyle=":", label="warning threshold (mean)")
                ax.legend(fontsize=7)

        panels.append(Panel("|trainer - generator| logprob (nats / token)", logprob_gap))
    times = [(k, name) for k, name in TIME_PHASES if k in keys]
    if times:

        def time_split(ax: Any) -> None:
            x = [r["step"] for r in rl]
            ax.stackplot(x, *[[float(r.get(k, 0.0)) for r in rl] for k, _ in times], labels=[n for _, n in times])
            ax.set_ylabel("s")
            ax.legend(fontsize=7, loc="upper left")

        panels.append(Panel("time per step, by phase", time_split))
    memory = memory_series_keys(keys)
    if memory:

        def memory_panel(ax: Any) -> None:
            for key, label in memory:
                ax.plot(*_series(rl, key), label=label)
            ax.set_ylabel("GiB")
            ax.legend(fontsize=6, ncol=2)

        panels.append(Panel("memory per process, by phase", memory_panel))
    return panels


def memory_series_keys(keys: set[str] | Sequence[str]) -> list[tuple[str, str]]:
    """(key, label) of the memory figure drawn per process and phase."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    for key in keys:
        if m := _MEMORY_KEY.match(key):
            found.setdefault((m["proc"], m["phase"]), {})[m["what"]] = key
    out = []
    for (proc, phase), whats in sorted(found.items()):
        what = next((w for w in _MEMORY_PREFERENCE if w in whats), None)
        if what is not None:
            out.append((whats[what], f"{proc} {what} @{phase}"))
    return out


def plot_training(
    records: Sequence[dict[str, Any]], path: str | Path, *, logprob_gap_warn: float | None = None, title: str = ""
) -> Path | None:
    """The dashboard as a PNG at `path` (None, and no file, without RL records)."""
    panels = training_panels(records, logprob_gap_warn=logprob_gap_warn)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        panel.draw(ax)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
