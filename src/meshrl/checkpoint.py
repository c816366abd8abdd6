"""Run checkpoints: complete or absent, never half-written.

A run checkpoint is a directory `checkpoints/step_00000012/` holding the trainer's state (torch DCP shards of
model + optimiser, written by every trainer rank into `trainer/`) and the controller's own state
(`controller.json`: step counters, policy version, LR-schedule position, data cursor, RNG states). It is
assembled under a temporary name and renamed into place after a `COMPLETE` marker is written, so a crash
while saving leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
CONTROLLER_STATE = "controller.json"
TRAINER_DIR = "trainer"


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


class CheckpointManager:
    def __init__(self, run_path: str | os.PathLike, keep_last_n: int = 2) -> None:
        if keep_last_n < 1:
            raise ValueError(f"keep_last_n={keep_last_n} must be >= 1")
        self.root = Path(run_path) / "checkpoints"
        self.keep_last_n = keep_last_n

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and (p / COMPLETE).is_file()]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `step` (the trainer writes into `<tmp>/trainer`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step_*.tmp"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".step_{step:08d}.tmp"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, controller_state: dict[str, Any]) -> Path:
        (tmp / CONTROLLER_STATE).write_text(json.dumps(controller_state, indent=1))
        marker = tmp / COMPLETE
        with marker.open("w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        final = self.root / f"step_{step:08d}"
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.prune()
        return final

    def prune(self) -> None:
        for old in self.complete()[: -self.keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)


def read_controller_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / CONTROLLER_STATE).read_text())


def resolve_resume(resume: str, run_path: Path) -> Path:
    """`resume` is 'latest' (this run's newest complete checkpoint), a checkpoint dir, or a run dir."""
    if resume == "latest":
        found = CheckpointManager(run_path).latest()
        if found is None:
            raise FileNotFoundError(f"--run.resume latest: no complete checkpoint under {run_path / 'checkpoints'}")
        return found
    p = Path(resume).resolve()
    if (p / COMPLETE).is_file():
        return p
    found = CheckpointManager(p).latest()
    if found is None:
        raise FileNotFoundError(
            f"--run.resume {resume}: neither a complete checkpoint (no {COMPLETE} marker) nor a run dir with one"
        )
    return found


# Flags that say where a run lives and whether it stops early: the resume command sets its own.
_RUN_PLACEMENT_FLAGS = ("--run.output-dir", "--run.name", "--run.resume", "--run.stop-at-step")


def resume_command(program: str, checkpoint: Path | None, flags: list[str] | None = None) -> str:
    """The command that continues the run of `checkpoint`. `flags`: the command-line flags the run was started
    with (repeated, so the resumed run has the same config), without the run's placement."""
    if checkpoint is None:
        return "(no checkpoint was written yet: rerun from the start)"
    run_dir = checkpoint.parent.parent
    kept, args = [], list(flags or [])
    while args:
        arg = args.pop(0)
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in _RUN_PLACEMENT_FLAGS:
            if "=" not in arg and args and not args[0].startswith("--"):
                args.pop(0)  # its value
            continue
        kept.append(arg)
    return shlex.join(
        ["python", "-m", f"meshrl.controller.{program}", *kept]
        + ["--run.output-dir", str(run_dir.parent), "--run.name", run_dir.name, "--run.resume", "latest"]
    )


def rng_state(rng: random.Random) -> list:
    """A `random.Random`'s state as JSON-able lists (`set_rng_state` restores it exactly)."""
    version, internal, gauss_next = rng.getstate()
    return [version, list(internal), gauss_next]


def set_rng_state(rng: random.Random, state: list) -> None:
    version, internal, gauss_next = state
    rng.setstate((version, tuple(internal), gauss_next))


def config_changes(saved: dict[str, Any], current: dict[str, Any], ignore: tuple[str, ...] = ("run.",)) -> list[str]:
    """'field: saved -> current' for every config field that differs (nested dicts flattened to dotted names),
    except those under the `ignore` prefixes."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(saved), flat(current)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and not k.startswith(ignore)
    ]
