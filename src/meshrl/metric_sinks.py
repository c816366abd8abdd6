"""Metric backends: every record `RunDir.log` writes to metrics.jsonl also goes to these — TensorBoard event files
(`<run dir>/tb/`), Weights & Biases, or a backend of your own. metrics.jsonl stays the run's record; a backend is a
view of it, so none of them is ever read back.

A backend is anything with `log(record)` and `close()` (and optionally `rewind(step, replay)`, called on resume).
A record is one flat dict of `controller/grpo.py` / `controller/sft.py` (`{"phase": "rl", "step": 3,
"reward_mean": ..., "reward/exact_match": ..., "memory/train/trainer0_peak_gib": ...}`): its numbers are logged as
`<phase>/<key>` at global step `step`; strings and lists are left out.

    run.add_sink(*open_sinks(cfg.log, run.path, cfg))     # --log.backends tensorboard,wandb
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from meshrl.errors import ConfigError

TB_DIR = "tb"
WANDB_ID_FILE = "wandb_id.txt"

# The built-in backends; package.module:factory names any other.
METRIC_BACKENDS = ("tensorboard", "wandb")


@dataclass
class LogConfig:
    backends: str = "tensorboard"
    """Where metrics go besides metrics.jsonl, comma-separated: tensorboard (event files in the run dir's tb/),
    wandb (when installed; --log.wandb-project), or package.module:factory (factory(run_path, config) returning an
    object with log(record) and close()). 'none': metrics.jsonl only."""
    rollouts_every: int = 1
    """Write the step's prompts, completions, rewards and policy versions to rollouts.jsonl every this many RL
    steps; 0: never."""
    logprob_gap_warn: float = 0.1
    """Warn (stderr, every RL step while it lasts) when trainer and generator logprobs differ by more than this many
    nats per token on average: they are not computing the same model. Rounding alone gives ~1e-6 in float32 and
    ~1e-2 in bfloat16."""
    wandb_project: str = "meshrl"
    """The Weights & Biases project (with --log.backends ...,wandb). WANDB_MODE=offline keeps the run local."""
    wandb_entity: str | None = None
    """The Weights & Biases entity (team or user); default: your wandb default."""
    plots: bool = field(default_factory=lambda: os.environ.get("MESHRL_PLOTS", "1") != "0")
    """Draw reward_curve.png, training.png and timeline.png at the end of a GRPO run (matplotlib: ~3 s on a small
    CPU). --log.no-plots, or MESHRL_PLOTS=0 in the environment (the test suite sets it), skips them; metrics.jsonl
    and timeline.jsonl hold the same numbers."""

    def __post_init__(self) -> None:
        names = self.backend_names
        unknown = [n for n in names if n not in METRIC_BACKENDS and ":" not in n]
        if unknown or (not names and self.backends.strip().lower() != "none"):
            what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no backend named"
            raise ConfigError(
                f"log.backends={self.backends!r}: {what}; use a comma-separated list of "
                f"{', '.join(METRIC_BACKENDS)} or package.module:factory, or 'none'"
            )
        if "wandb" in names:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(
                    "log.backends asks for wandb, which is not installed: pip install wandb (or drop wandb from "
                    "--log.backends)"
                )
        if self.rollouts_every < 0:
            raise ConfigError(f"log.rollouts_every={self.rollouts_every} must be >= 0 (0: no rollouts.jsonl)")
        if not self.logprob_gap_warn > 0:
            raise ConfigError(f"log.logprob_gap_warn={self.logprob_gap_warn} must be > 0 (nats per token)")

    @property
    def backend_names(self) -> list[str]:
        """The metric backends asked for, in order ([] for 'none')."""
        names = [n.strip() for n in self.backends.split(",") if n.strip()]
        return [] if [n.lower() for n in names] == ["none"] else [n if ":" in n else n.lower() for n in names]


class MetricSink(Protocol):
    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers by key (`phase` and `step` excluded), a flag as 0/1; a dict of numbers (e.g. reward
    failures by kind) as `key/subkey`. Strings, lists and None are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("phase", "step"):
            continue
        if isinstance(value, Mapping):
            out.update({f"{key}/{k}": float(v) for k, v in value.items() if _is_number(v)})
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float)  # a bool too: a 0/1 flag


class TensorBoardSink:
    """Event files under `log_dir`, one scalar series per `<phase>/<key>`. The writer opens at the first record
    (a run that fails at launch leaves no empty event file) and is flushed after every record: a run killed mid-way
    loses at most the record being written, as metrics.jsonl does."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def _open(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        return self._writer

    def log(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return  # nowhere to place it on a step axis
        writer = self._writer or self._open()
        phase = record.get("phase") or "metrics"
        for key, value in scalars(record).items():
            writer.add_scalar(f"{phase}/{key}", value, global_step=step)
        writer.flush()

    def rewind(self, step: int, replay: Sequence[Mapping[str, Any]]) -> None:
        """On resume: TensorBoard hides every point at or after `step` written before (purge_step: a
        SessionLog.START at `step` in a new event file), so the steps run again are not drawn twice; the records
        of `replay` (kept ones at or after `step`: the warm-up's later steps, an evaluation) are logged again after
        it."""
        self.close()
        self._open(purge_step=step)
        for record in replay:
            self.log(record)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """A Weights & Biases run (named after the run dir; `WANDB_MODE=offline` keeps it local). Each phase has its own
    step axis (`<phase>/step`): the warm-up's steps and the RL steps both start at 0, and wandb's own step must only
    grow. A resumed meshrl run continues the same wandb run (its id is kept in the run dir); wandb cannot take
    points back, so the steps run again after a resume appear twice there (TensorBoard and metrics.jsonl drop them)."""

    def __init__(self, run_path: str | Path, *, project: str, entity: str | None, config: Any = None) -> None:
        self.run_path = Path(run_path)
        self.project, self.entity, self.config = project, entity, config
        self._run: Any = None
        self._phases: set[str] = set()

    def _open(self) -> Any:
        import wandb

        id_file = self.run_path / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        config = _plain(self.config) if self.config is not None else None
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_path.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_path),
            config=config,
        )
        self._phases = set()
        return self._run

    def log(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        run = self._run or self._open()
        phase = record.get("phase") or "metrics"
        if phase not in self._phases:
            run.define_metric(f"{phase}/step")
            run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._phases.add(phase)
        run.log({f"{phase}/step": step, **{f"{phase}/{k}": v for k, v in scalars(record).items()}})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _plain(config: Any) -> Any:
    """A config dataclass as JSON-able dicts (wandb's run config)."""
    obj = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    return json.loads(json.dumps(obj, default=str))


def open_sinks(log_cfg: LogConfig, run_path: str | Path, config: Any = None) -> list[MetricSink]:
    """The backends `log_cfg` (the `--log.*` section) asks for, writing under `run_path`. Nothing is opened
    yet: each one starts at its first record."""
    run_path = Path(run_path)
    sinks: list[MetricSink] = []
    for name in log_cfg.backend_names:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(run_path / TB_DIR))
        elif name == "wandb":
            sinks.append(WandbSink(run_path, project=log_cfg.wandb_project, entity=log_cfg.wandb_entity, config=config))
        else:
            sinks.append(_user_sink(name, run_path, config))
    return sinks


def _user_sink(spec: str, run_path: Path, config: Any) -> MetricSink:
    module, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"log.backends: cannot import {spec!r} ({e}); name a function package.module:factory") from e
    sink = factory(run_path, config)
    if not (callable(getattr(sink, "log", None)) and callable(getattr(sink, "close", None))):
        raise ConfigError(f"log.backends: {spec} returned {type(sink).__name__}, which lacks log(record) / close()")
    return sink


__all__ = [
    "METRIC_BACKENDS",
    "LogConfig",
    "MetricSink",
    "TensorBoardSink",
    "WandbSink",
    "open_sinks",
    "scalars",
    "TB_DIR",
]
