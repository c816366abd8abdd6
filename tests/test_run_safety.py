"""Run directories that cannot be clobbered and checkpoints that are verified (no actor processes: the GRPO-level
checks, on real runs, are in test_grpo_resume.py)."""

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from meshrl.checkpoint import MANIFEST, CheckpointManager, resolve_resume, verify_checkpoint
from meshrl.config import RunConfig
from meshrl.errors import ConfigError
from meshrl.run_dir import RunDir


@dataclass
class _Cfg:
    run: RunConfig = field(default_factory=RunConfig)


def _checkpoint(manager: CheckpointManager, step: int, payload: bytes = b"weights" * 100) -> None:
    tmp = manager.begin(step)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "__0_0.distcp").write_bytes(payload + bytes([step]))
    manager.commit(tmp, step, {"step": step})


def test_a_directory_holding_a_run_is_refused_without_resume_and_taken_with_it(tmp_path):
    run = RunDir(str(tmp_path), "r", _Cfg())
    run.log({"phase": "rl", "step": 0})
    run.close()
    with pytest.raises(ConfigError, match=r"already holds a run \(1 metric records in metrics.jsonl\).*--run.resume"):
        RunDir(str(tmp_path), "r", _Cfg())
    resumed = RunDir(str(tmp_path), "r", _Cfg(RunConfig(name="r", resume="latest")))
    assert resumed.read_metrics() == [{"phase": "rl", "step": 0}]  # nothing dropped by the resume's start
    resumed.close()
    _checkpoint(CheckpointManager(tmp_path / "s"), 1)
    with pytest.raises(ConfigError, match=r"1 checkpoint\(s\), the newest step_00000001"):
        RunDir(str(tmp_path), "s", _Cfg())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's own files")
    with pytest.raises(ConfigError, match="files that are not a meshrl run's"):
        RunDir(str(tmp_path), "mine", _Cfg())


def test_a_failed_launch_leaves_a_directory_that_a_new_run_takes_over(tmp_path):
    """A launch that failed before its first record (bad model, a process that did not start) leaves config.json
    and an empty metrics file: no run. A new run of that name starts there; a resume finds no checkpoint."""
    first = RunDir(str(tmp_path), "r", _Cfg())
    first.metrics_path.touch()
    first.close()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume("latest", first.path)
    second = RunDir(str(tmp_path), "r", _Cfg())
    assert not second.metrics_path.exists() and (second.path / "config.json").is_file()
    second.close()


def test_default_names_never_collide(tmp_path):
    a, b = RunDir(str(tmp_path), None, _Cfg()), RunDir(str(tmp_path), None, _Cfg())
    assert a.path != b.path and b.path.name.startswith(a.path.name[:15])


def test_a_live_run_holds_its_directory_against_other_processes(tmp_path):
    """Another process (a real one, holding a RunDir as a run does) keeps the directory; it is free once that
    process is gone, however it ended (flock: the kernel releases it at exit)."""
    script = (
        "import time\nfrom meshrl.config import GRPORunConfig\nfrom meshrl.run_dir import RunDir\n"
        f"RunDir({str(tmp_path)!r}, 'live', GRPORunConfig())\nprint('held', flush=True)\ntime.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"is in use by a live run \(pid {holder.pid} on .*another --run.name"):
            RunDir(str(tmp_path), "live", _Cfg(), resume=True)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    RunDir(str(tmp_path), "live", _Cfg(), resume=True).close()


def test_manifest_catches_truncation_and_changes_in_place_and_resume_falls_back(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last_n=3)
    for step in (1, 2, 3):
        _checkpoint(manager, step)
    ckpts = manager.complete()
    assert all(verify_checkpoint(p) is None for p in ckpts)
    manifest = json.loads((ckpts[-1] / MANIFEST).read_text())["files"]
    assert set(manifest) == {"trainer/__0_0.distcp", "controller.json"}

    shard = ckpts[-1] / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    assert "trainer/__0_0.distcp has 691 bytes, the manifest says 701" in verify_checkpoint(ckpts[-1])
    flipped = ckpts[-2] / "trainer" / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[5] ^= 0xFF  # changed in place: the same size
    flipped.write_bytes(bytes(data))
    assert verify_checkpoint(ckpts[-2], checksums=False) is None  # sizes alone cannot tell
    assert "does not match its SHA-256" in verify_checkpoint(ckpts[-2])

    assert resolve_resume("latest", tmp_path) == ckpts[0]
    out = capsys.readouterr().out
    assert f"skipping checkpoint {ckpts[-1]}: trainer/__0_0.distcp has 691 bytes" in out
    assert f"skipping checkpoint {ckpts[-2]}: trainer/__0_0.distcp does not match" in out
    assert "falling back to step_00000001" in out
    with pytest.raises(FileNotFoundError, match="is not a valid checkpoint: trainer/__0_0.distcp does not match"):
        resolve_resume(str(ckpts[-2]), tmp_path)  # named explicitly: refused, not replaced
    (ckpts[0] / "controller.json").unlink()
    with pytest.raises(FileNotFoundError, match="no valid checkpoint under"):
        resolve_resume("latest", tmp_path)


def test_pruning_never_deletes_the_newest_valid_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_n=2)
    _checkpoint(manager, 1)
    _checkpoint(manager, 2)
    (manager.complete()[-1] / "trainer" / "__0_0.distcp").write_bytes(b"")  # damaged after it was saved
    manager.keep_last_n = 1
    manager.prune()  # the newest alone would be kept, but it is not valid: the one a resume needs stays too
    assert [p.name for p in manager.complete()] == ["step_00000001", "step_00000002"]
    _checkpoint(manager, 3)  # valid and newest: the rest can go
    assert [p.name for p in manager.complete()] == ["step_00000003"]


def test_a_checkpoint_saved_before_manifests_still_resumes(tmp_path, capsys):
    manager = CheckpointManager(tmp_path)
    _checkpoint(manager, 1)
    (manager.complete()[0] / MANIFEST).unlink()
    assert resolve_resume("latest", tmp_path).name == "step_00000001"
    assert "resumed unverified" in capsys.readouterr().out
