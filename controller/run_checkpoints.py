"""A program's resumable run checkpoints and the failure that names the last good one."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from meshrl.checkpoint import (
    TRAINER_DIR,
    CheckpointManager,
    config_changes,
    read_controller_state,
    resolve_resume,
    resume_command,
)
from meshrl.controller.api import ActorDiedError, Controller
from meshrl.controller.replicas import ActorFrozenError
from meshrl.errors import ConfigError
from meshrl.run_dir import RunDir


class RunFailedError(RuntimeError):
    """The run cannot continue; the message names the last good checkpoint and the command to resume."""


class RunCheckpoints:
    """A program's resumable checkpoints (shared by `sft` and `grpo`): restore on `--run.resume`, save every
    `run.save_every` steps, at `run.stop_at_step` and at the end, and turn any failure into a message that names
    the last good checkpoint and the command resuming from it.

    A checkpoint (meshrl.checkpoint) holds the trainer's model + optimiser (DCP, every rank), and the
    controller's state: the program's own (data cursor, RNG, ...) plus the step, policy version, the number of
    metrics lines written so far (a resumed run drops later ones and appends) and the config."""

    def __init__(self, program: str, run: RunDir, cfg: Any) -> None:
        self.program, self.run, self.cfg = program, run, cfg
        self.manager = CheckpointManager(run.path, cfg.run.keep_last_n)
        # Started as `python -m meshrl.controller.<program> FLAGS`: the resume command repeats FLAGS.
        self.flags = sys.argv[1:] if Path(sys.argv[0]).stem == program else None
        # Found and verified (every byte against its manifest) now, before any process starts: a run without a
        # valid checkpoint to resume fails here, and a damaged newest one is skipped for the newest valid one.
        try:
            self.resume_from = resolve_resume(cfg.run.resume, run.path) if cfg.run.resume else None
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from e

    def restore(self, ctl: Controller) -> dict[str, Any] | None:
        """Load the checkpoint named by `run.resume` into the trainer; its controller state (None: a fresh run)."""
        if self.resume_from is None:
            return None
        ckpt = self.resume_from
        state = read_controller_state(ckpt)
        ctl.load_checkpoint(str(ckpt / TRAINER_DIR))
        self.run.truncate_metrics(state["metrics_lines"])
        changed = config_changes(state.get("config", {}), _as_json(self.cfg))
        if changed:
            print(f"[meshrl] note: resuming with a config that differs from the checkpoint's: {'; '.join(changed)}")
        print(f"[meshrl] resumed from {ckpt} at step {state['step']} (policy version {ctl.policy_version})")
        return state

    def save(self, ctl: Controller, step: int, state: dict[str, Any]) -> str:
        """Trainer state + controller state, committed atomically as checkpoints/step_<step>."""
        tmp = self.manager.begin(step)
        ctl.save_checkpoint(str(tmp / TRAINER_DIR))
        full = {
            **state,
            "step": step,
            "policy_version": ctl.policy_version,
            "metrics_lines": self.run.num_metric_lines(),
            "config": _as_json(self.cfg),
        }
        return str(self.manager.commit(tmp, step, full))

    def after_step(self, ctl: Controller, done: int, total: int, state: Callable[[], dict[str, Any]]) -> str | None:
        """Call after step `done` (1-based) of `total`: saves when `run.save_every` says so. At `run.stop_at_step`
        it saves and returns the checkpoint: the caller stops there, as a preempted job would."""
        stop = self.cfg.run.stop_at_step == done and done < total
        every = self.cfg.run.save_every
        if not (stop or (every and done % every == 0 and done < total)):
            return None
        path = self.save(ctl, done, state())
        if not stop:
            return None
        print(f"[meshrl] stopped at step {done} (run.stop_at_step); checkpoint {path}")
        print(f"  resume with: {resume_command(self.program, Path(path), self.flags)}")
        return path

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around starting the run's processes (building the Controller): a process or host lost then ends the run
        as a later failure does, with the resume hint and no traceback. Other errors (a ConfigError) pass as
        they are."""
        try:
            yield
        except (ActorDiedError, ActorFrozenError):
            with self.resume_hint_on_failure():
                raise

    @contextmanager
    def resume_hint_on_failure(self) -> Iterator[None]:
        """Any failure inside ends the run with RunFailedError naming the last good checkpoint. On the way out,
        however it goes, the run directory's lock is released (a resume may start now)."""
        try:
            yield
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through cli.stop_on_sigterm: stop, but say how to go on
            latest = self.manager.latest()
            print(
                f"[meshrl] interrupted; last good checkpoint: {latest or 'none yet'}\n"
                f"  resume with: {resume_command(self.program, latest, self.flags)}",
                file=sys.stderr,
                flush=True,
            )
            raise
        except Exception as e:  # noqa: BLE001 - every failure ends with the resume hint
            latest = self.manager.latest()
            kind = type(e).__name__
            if isinstance(e, ActorDiedError):
                kind = "an actor process died"
            elif isinstance(e, ActorFrozenError):
                kind = "an actor process stopped answering"
            raise RunFailedError(
                f"run failed ({kind}): {e}\n"
                f"  last good checkpoint: {latest or 'none yet'}\n"
                f"  resume with: {resume_command(self.program, latest, self.flags)}"
            ) from e
        finally:
            self.run.close()


def _as_json(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
