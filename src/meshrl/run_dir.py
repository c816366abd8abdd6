"""The run directory: resolved config, metrics as JSON lines, a reward-curve plot, a summary."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from meshrl.checkpoint import CheckpointManager
from meshrl.errors import ConfigError

LOCK = ".lock"
# This process's run-directory locks. A second RunDir on the same directory in the same process (a run called
# again from Python after the first one failed, its frames still held by the traceback) shares the lock: it guards
# against other processes.
_HELD_LOCKS: dict[Path, IO[str]] = {}


def _lock(path: Path) -> IO[str]:
    """An exclusive lock on `path`'s lock file, or ConfigError naming the process that holds it. flock: the kernel
    drops it when the holder exits, even by kill -9, so a crashed run never leaves a stale lock."""
    if path in _HELD_LOCKS:
        return _HELD_LOCKS[path]
    f = (path / LOCK).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(
            f"run directory {path} is in use by a live run ({holder}); two runs in one directory would mix their "
            "metrics and checkpoints. Wait for it to end (or stop it), or give this run another --run.name"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: ")
    f.write(" ".join(sys.argv) + "\n")
    f.flush()
    _HELD_LOCKS[path] = f
    return f


def holds_run(path: Path) -> str | None:
    """What makes `path` a run that a new one must not overwrite (None: nothing): a checkpoint, a summary, logged
    metrics; or files that are not a meshrl run's at all."""
    found = CheckpointManager(path).complete()
    if found:
        return f"{len(found)} checkpoint(s), the newest {found[-1].name}"
    for done in ("summary.json", "eval.json"):
        if (path / done).is_file():
            return f"a finished run: {done}"
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return f"{sum(1 for line in metrics.open() if line.strip())} metric records in metrics.jsonl"
    if not (path / "config.json").is_file() and any(p.name != LOCK for p in path.iterdir()):
        return "files that are not a meshrl run's"
    return None


class RunDir:
    """One run's directory, held for the life of this process: a lock file keeps a second live run out, and a
    directory that already holds a run is refused unless this run resumes it (or every later `--run.resume
    latest` would mix two runs' checkpoints and metrics). A directory whose launch failed before anything was
    logged or saved holds no run: a new one takes it over."""

    def __init__(self, output_dir: str, name: str | None, config: Any, *, resume: bool | None = None) -> None:
        if resume is None:
            resume = bool(getattr(getattr(config, "run", None), "resume", None))
        root = Path(output_dir).resolve()
        if name is None:  # a timestamp; a second run started in the same second gets a suffix
            stamp = time.strftime("%Y%m%d-%H%M%S")
            name = next(n for n in (stamp, *(f"{stamp}-{i}" for i in range(2, 1000))) if not (root / n).exists())
        self.path = root / name
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.path)
        self.metrics_path = self.path / "metrics.jsonl"
        if not resume:
            if held := holds_run(self.path):
                self.close()  # refused: the directory stays free for the run that may continue it
                raise ConfigError(
                    f"run directory {self.path} already holds a run ({held}); a new run there would mix with it. "
                    "Continue it with --run.resume latest, or give this run another --run.name (or --run.output-dir)"
                )
            # A launch that failed before its first record left these behind (empty): start them afresh.
            for leftover in (self.metrics_path, self.path / "timeline.jsonl"):
                leftover.unlink(missing_ok=True)
        (self.path / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2, default=str))

    def close(self) -> None:
        """Release the directory's lock (also released when this process exits, however it ends)."""
        _HELD_LOCKS.pop(self.path, None)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def log(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(record)

    @property
    def sinks(self) -> list[Any]:
        """The metric backends (meshrl.metric_sinks: TensorBoard, wandb) that get every record besides
        metrics.jsonl."""
        return self.__dict__.setdefault("_sinks", [])

    def add_sink(self, *sinks: Any) -> None:
        self.sinks.extend(sinks)

    def close_sinks(self) -> None:
        """Flush and close the metric backends (a later record opens them again)."""
        for sink in self.sinks:
            sink.close()

    @contextmanager
    def sinks_open(self) -> Iterator[RunDir]:
        """The metric backends are closed when the block ends, however it ends."""
        try:
            yield self
        finally:
            self.close_sinks()

    def write_json(self, name: str, obj: Any) -> Path:
        p = self.path / name
        p.write_text(json.dumps(obj, indent=2, default=str))
        return p

    def num_metric_lines(self) -> int:
        return len(self.read_metrics())

    def truncate_metrics(self, num_lines: int) -> None:
        """On resume: drop the records written after the checkpoint (they will be produced again)."""
        records = self.read_metrics()
        kept, dropped = records[:num_lines], records[num_lines:]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        # The backends saw the dropped records too: each takes back what it logged from the first dropped step on
        # and is given again the kept records at or after it (they share its step axis: warm-up steps, an eval).
        steps = [r["step"] for r in dropped if isinstance(r.get("step"), int)]
        if steps:
            first = min(steps)
            replay = [r for r in kept if isinstance(r.get("step"), int) and r["step"] >= first]
            for sink in self.sinks:
                if hasattr(sink, "rewind"):
                    sink.rewind(first, replay)

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


@dataclass
class RunConfig:
    output_dir: str = "runs"
    """Directory the run directories are made in."""
    name: str | None = None
    """Run directory name under output_dir; default: a timestamp."""
    seed: int = 0
    """Controller seed (prompt order, sampling seeds)."""
    call_timeout_s: float = 600.0
    """Longest wait for any one actor call before the run fails instead of hanging."""
    save_every: int = 50
    """Write a resumable checkpoint every this many optimiser steps (and at the end); 0: only at the end."""
    keep_last_n: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    resume: str | None = None
    """Continue a run: 'latest' (with --run.name of that run), a checkpoint dir, or a run dir."""
    stop_at_step: int | None = None
    """Save a checkpoint and stop after this step, as a preempted job would (resume later with run.resume)."""
    max_restarts: int = 3
    """Generator or reward processes replaced during the run after they die or hang (their requests re-sent, no
    sample lost); one more failure ends the run with the resume command. 0: the first failure ends the run."""
    heartbeat_s: float = 20.0
    """A process that answers no heartbeat for this long while a call waits on it is frozen: a generator or reward
    process is replaced (as a dead one is), a trainer rank ends the run. Heartbeats are answered between requests
    and while generating, so long work is not a hang."""
    gpu_defaults: bool = True
    """On a machine whose GPUs this process sees (with --placement local), the command line (grpo, sft, eval) fills
    in what you did not give (a flag or the preset): --trainer.device cuda; --model.dtype and --generator.dtype
    bfloat16 (fp32 master weights stay: --trainer.master-dtype); --model.backend torchtitan for a Qwen3 model when
    torchtitan imports, else hf; --generator.engine vllm when vLLM imports with CUDA (a vision-language model: with
    torchvision), else transformers; --trainer.logprob-chunk-size 4096; grpo: --placement.gpus N (every GPU seen,
    the measured layout); sft: --trainer.num-procs (a rank per GPU). It prints each setting and why
    (meshrl.gpu_defaults). Without GPUs, or with --trainer.device cpu given, nothing changes; a config Python builds
    is never touched. --run.no-gpu-defaults: off."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"run.max_restarts={self.max_restarts} must be >= 0 (0: a failure ends the run)")
        if not self.heartbeat_s > 0:
            raise ConfigError(f"run.heartbeat_s={self.heartbeat_s} must be > 0 (seconds)")
        if self.save_every < 0:
            raise ConfigError(f"run.save_every={self.save_every} must be >= 0")
        if self.keep_last_n < 1:
            raise ConfigError(f"run.keep_last_n={self.keep_last_n} must be >= 1")
        if self.resume == "latest" and self.name is None:
            raise ConfigError("run.resume=latest needs run.name (the run to continue); or pass a checkpoint path")
