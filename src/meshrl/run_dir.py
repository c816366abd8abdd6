"""The run directory: resolved config, metrics as JSON lines, a reward-curve plot, a summary."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any


class RunDir:
    def __init__(self, output_dir: str, name: str | None, config: Any) -> None:
        name = name or time.strftime("%Y%m%d-%H%M%S")
        self.path = Path(output_dir).resolve() / name
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.path / "metrics.jsonl"
        (self.path / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2, default=str))

    def log(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def write_json(self, name: str, obj: Any) -> Path:
        p = self.path / name
        p.write_text(json.dumps(obj, indent=2, default=str))
        return p

    def num_metric_lines(self) -> int:
        return len(self.read_metrics())

    def truncate_metrics(self, num_lines: int) -> None:
        """On resume: drop the records written after the checkpoint (they will be produced again)."""
        kept = self.read_metrics()[:num_lines]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]


def plot_rewards(records: list[dict[str, Any]], path: Path, title: str = "GRPO reward") -> Path | None:
    """Reward mean ± std per RL step (and eval accuracy where present) as a PNG."""
    rl = [r for r in records if r.get("phase") == "rl"]
    if not rl:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rl]
    mean = [r["reward_mean"] for r in rl]
    std = [r["reward_std"] for r in rl]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, label="reward mean")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.12,
        label="± std (samples)",
    )
    # Held-out evaluation (before RL at step 0, every eval.every steps, after RL) next to the training reward.
    evals = [r for r in records if r.get("phase") == "eval" and "accuracy" in r]
    if evals:
        x = [r.get("step", 0) for r in evals]
        ax.plot(x, [r["accuracy"] for r in evals], "o-", label="held-out greedy accuracy")
        # pass@1 (unbiased, from k samples) is mean@k by definition: one line, not two.
        for key in sorted({k for r in evals for k in r if k.startswith(("mean@", "pass@")) and k != "pass@1"}):
            pts = [(r.get("step", 0), r[key]) for r in evals if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", label=f"held-out {key}", alpha=0.8)
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
