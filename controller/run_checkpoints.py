"""A program's resumable run checkpoints and the failure that names the last good one."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
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
        self._ctl: Controller | None = None  # the run's Controller, once restore/save saw it (to name dead ranks)

    def restore(self, ctl: Controller) -> dict[str, Any] | None:
        """Load the checkpoint named by `run.resume` into the trainer; its controller state (None: a fresh run)."""
        self._ctl = ctl
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
        self._ctl = ctl
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
        it saves and returns the checkpoint: the caller stops there, as a preempted job would. A SIGTERM that came
        during the step (cli.stop_on_sigterm waits for this boundary from the end of the first step to the end of
        the last) saves this step and raises KeyboardInterrupt: the run ends with the resume command."""
        from meshrl.controller.cli import STEP_BOUNDARY

        signalled, STEP_BOUNDARY.requested = STEP_BOUNDARY.requested, None
        STEP_BOUNDARY.deferring = done < total and not signalled
        if signalled:
            path = self.save(ctl, done, state())
            print(f"[meshrl] stopped after step {done} on {signalled}; checkpoint {path}", file=sys.stderr, flush=True)
            raise KeyboardInterrupt(signalled)  # resume_hint_on_failure prints the resume command
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
            kind, note = self._describe(e)
            raise RunFailedError(
                f"run failed ({kind}): {e}{note}\n"
                f"  last good checkpoint: {latest or 'none yet'}\n"
                f"  resume with: {resume_command(self.program, latest, self.flags)}"
            ) from e
        finally:
            from meshrl.controller.cli import STEP_BOUNDARY

            STEP_BOUNDARY.deferring, STEP_BOUNDARY.requested = False, None
            self.run.close()

    def _describe(self, e: BaseException) -> tuple[str, str]:
        """What kind of failure `e` is, and a line to add: a full disk named with its directory and free space (an
        error raised by the trainer or this process, not a death), a death named by its process where known."""
        full = _no_space(e)
        if full is not None:
            where = Path(full.filename) if full.filename else self.manager.root
            return "the disk is full", f"\n  {disk_space_note(where)}"
        note = ""
        if isinstance(e, ActorDiedError):
            trainer = getattr(self._ctl, "trainer", None)
            if getattr(e, "who", "") == "an actor process" and trainer is not None and (gone := trainer.dead_ranks()):
                note = f"\n  the process gone: {gone}"
            low = _low_space(self.manager.root)
            if low:
                note += f"\n  {low}: it may be why"
            return "an actor process died", note
        if isinstance(e, ActorFrozenError):
            return "an actor process stopped answering", ""
        raised = getattr(e, "exception", None)  # a Monarch ActorError: what the actor raised, it did not die
        if isinstance(raised, BaseException):
            return f"an actor raised {type(raised).__name__}", ""
        return type(e).__name__, ""


def _no_space(e: BaseException) -> OSError | None:
    """The OSError ENOSPC / EDQUOT in `e`, its causes, or the exception a Monarch ActorError carries; an OSError
    without a filename stands for one given only as text ("No space left on device", as torch's checkpoint
    writers report their ranks' errors)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return x
        todo += [x.__cause__, x.__context__, getattr(x, "exception", None)]
    if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
        return OSError(errno.ENOSPC, "No space left on device")
    return None


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def disk_space_note(path: Path) -> str:
    """'no space left on the device of /runs/x/checkpoints: 0.0 MiB free of 20.00 GiB; ...' (what to do)."""
    where = _existing(path)
    usage = shutil.disk_usage(where)
    return (
        f"no space left on the device of {path}: {_gib(usage.free)} free of {_gib(usage.total)} ({where}); free "
        "some space there (fewer checkpoints kept: --run.keep-last-n) or use another --run.output-dir, then resume"
    )


def _low_space(path: Path, floor: int = 256 * 2**20) -> str | None:
    """A line when the device of `path` has less than `floor` bytes free (a write there may have failed)."""
    try:
        free = shutil.disk_usage(_existing(path)).free
    except OSError:
        return None
    return f"the device of {path} has only {_gib(free)} free" if free < floor else None


def _as_json(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
