"""Run checkpoints: complete or absent, never half-written.

A run checkpoint is a directory `checkpoints/step_00000012/` holding the trainer's state (torch DCP shards of
model + optimiser, written by every trainer rank into `trainer/`) and the controller's own state
(`controller.json`: step counters, policy version, LR-schedule position, data cursor, RNG states). It is
assembled under a temporary name and renamed into place after a `MANIFEST.json` (every file's size and SHA-256)
and then a `COMPLETE` marker are written, so a crash while saving leaves the previous checkpoint as the latest one.

A checkpoint whose files no longer match its manifest (truncated, changed in place, missing) is not valid: resuming
verifies the manifest and falls back to the newest valid checkpoint, saying which one it skipped and why; pruning
never deletes the newest valid one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"
CONTROLLER_STATE = "controller.json"
TRAINER_DIR = "trainer"


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(checkpoint: Path) -> dict[str, Any]:
    """Every file under `checkpoint` with its size and SHA-256, written atomically as MANIFEST.json."""
    files = {
        str(p.relative_to(checkpoint)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, COMPLETE)
    }
    manifest = {"version": 1, "files": files}
    tmp = checkpoint / f".{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / MANIFEST)
    return manifest


def verify_checkpoint(checkpoint: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """Why `checkpoint` is not valid (None: it is): no COMPLETE marker, an unreadable manifest, a file missing,
    of another size, or (with `checksums`) with other contents than the manifest records. Without `checksums` it
    only compares sizes: quick enough for messages, while resuming checks every byte."""
    p = Path(checkpoint)
    if not (p / COMPLETE).is_file():
        return f"no {COMPLETE} marker (the save did not finish)"
    if not (p / MANIFEST).is_file():  # saved by meshrl before checkpoints carried checksums: nothing to check
        return None
    try:
        files = json.loads((p / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, want in files.items():
        f = p / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if checksums and _sha256(f) != want["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (changed after it was saved)"
    return None


class CheckpointManager:
    def __init__(self, run_path: str | os.PathLike, keep_last_n: int = 2) -> None:
        if keep_last_n < 1:
            raise ValueError(f"keep_last_n={keep_last_n} must be >= 1")
        self.root = Path(run_path) / "checkpoints"
        self.keep_last_n = keep_last_n

    def complete(self) -> list[Path]:
        """Checkpoints whose save finished (COMPLETE marker), oldest first; not verified."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and (p / COMPLETE).is_file()]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        """The newest checkpoint whose files have their manifest's sizes (see `latest_valid` for every byte)."""
        return self.latest_valid(checksums=False)[0]

    def latest_valid(self, *, checksums: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest valid checkpoint, and the newer ones skipped with the reason each is not valid."""
        skipped = []
        for ckpt in reversed(self.complete()):
            reason = verify_checkpoint(ckpt, checksums=checksums)
            if reason is None:
                return ckpt, skipped
            skipped.append((ckpt, reason))
        return None, skipped

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
        write_manifest(tmp)  # checksums of what is on disk now, before the marker that makes it count
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
        """Keep the newest `keep_last_n` checkpoints, and the newest valid one even when it is older than those
        (the newer ones may have been damaged since: it is the one a resume would fall back to)."""
        done = self.complete()
        keep = set(done[-self.keep_last_n :])
        if not any(verify_checkpoint(p, checksums=False) is None for p in keep):
            valid, _ = self.latest_valid(checksums=False)
            keep |= {valid} if valid is not None else set()
        for old in done:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)


def read_controller_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / CONTROLLER_STATE).read_text())


def resolve_resume(resume: str, run_path: Path) -> Path:
    """`resume` is 'latest' (this run's newest valid checkpoint), a checkpoint dir, or a run dir (its newest valid
    checkpoint). Every file is checked against the checkpoint's manifest; a named checkpoint that fails is refused,
    a run's newest that fails is skipped for the newest valid one (said on stdout, with the reason)."""
    p = run_path if resume == "latest" else Path(resume).resolve()
    if (p / COMPLETE).is_file() or (p / CONTROLLER_STATE).is_file():  # one checkpoint, named
        if reason := verify_checkpoint(p):
            raise FileNotFoundError(f"--run.resume {resume}: {p} is not a valid checkpoint: {reason}")
        found, skipped = p, []
    else:
        found, skipped = CheckpointManager(p).latest_valid()
    for ckpt, reason in skipped:
        print(f"[meshrl] skipping checkpoint {ckpt}: {reason}", flush=True)
    if found is None:
        what = "no valid checkpoint" if skipped else "no complete checkpoint"
        raise FileNotFoundError(f"--run.resume {resume}: {what} under {p / 'checkpoints'}")
    if skipped:
        print(f"[meshrl] falling back to {found.name}, the newest valid checkpoint", flush=True)
    if not (found / MANIFEST).is_file():
        print(f"[meshrl] note: {found} has no {MANIFEST} (an older meshrl saved it): resumed unverified", flush=True)
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
        # This interpreter: the project's environment, not whatever `python` is first on the user's PATH.
        [sys.executable, "-m", f"meshrl.controller.{program}", *kept]
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
